"""The shape the code holds to: the core never imports the KFP layers, the step table is the only
list of steps, and every step the table names has its function and its KFP component."""

import ast
import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlpipe.spec import parse_spec
from rlpipe.steps import BY_NAME, STEP_NAMES, STEPS, merged_steps, modules_for, service_for

from .conftest import REPO


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_core_never_imports_components_or_pipelines():
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in _imported_modules(path) if m.startswith(layer))
        for path in _python_files("rlpipe")
        for layer in ("rlpipe.components", "rlpipe.pipelines")
        if any(m.startswith(layer) for m in _imported_modules(path))
    }
    assert not offenders, f"rlpipe/ imports the KFP layers: {offenders}"


def test_the_step_table_is_the_only_list_of_steps():
    """No tuple, list or set literal outside rlpipe/steps.py names three or more steps."""
    steps = set(STEP_NAMES)
    found = []
    for path in _python_files("rlpipe", "components", "pipelines", "benchmarks"):
        if path == REPO / "rlpipe" / "steps.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in steps]
                if len(named) >= 3:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {named}")
    assert not found, "steps listed outside rlpipe/steps.py:\n" + "\n".join(found)


def test_every_step_has_its_function_and_component():
    from rlpipe.pipelines.rl_pipeline import COMPONENTS

    assert tuple(COMPONENTS) == STEP_NAMES
    for step in STEPS:
        module, _, function = step.function.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), step.name
        for imported in step.computes_with:
            importlib.import_module(imported)


@pytest.mark.parametrize(("resident", "staleness"), [(False, 0), (True, 0), (False, 1)])
def test_light_steps_and_thin_clients_do_not_import_torch(resident: bool, staleness: int):
    """A step that does not compute with torch, or whose service does, imports no torch."""
    spec = parse_spec({"name": "x", "trainer": {"resident": resident}, "loop": {"max_staleness": staleness}})
    light = [s.name for s in STEPS if not s.torch or service_for(s.name, spec)]
    assert {"score", "advantages", "sync_weights"} <= set(light)
    if resident:
        assert {"generate", "update", "evaluate"} <= set(light)
    if staleness:  # generate takes the producer's rollouts from the buffer
        assert "generate" in light
    modules = sorted({m for step in light for m in modules_for(step, spec)} | {"rlpipe.loop", "rlpipe.steps"})
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nassert 'torch' not in sys.modules, 'torch'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_newcomer_follows_one_iteration_in_at_most_15_files():
    """README's "How to read the code": every path on every line exists, one file an item, at most 15
    on either path (the per-step path: items 1-13; the resident trainer's: 1-15)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## How to read the code", 1)[1].split("\n## ", 1)[0]
    items = [line for line in section.splitlines() if line[:1].isdigit()]
    paths = [[word for word in line.split("`")[1::2] if "/" in word or word.endswith(".py")] for line in items]
    assert all(len(found) == 1 for found in paths), paths
    listed = [found[0] for found in paths]
    for name in listed:
        assert (REPO / name).is_file(), name
    assert len(set(listed)) == len(listed) <= 15, listed
    assert listed[-2:] == ["rlpipe/services/trainer/client.py", "rlpipe/services/trainer/server.py"]


def test_reports_are_the_steps_markdown_outputs_and_feed_no_step():
    """Each component's Markdown outputs are its step's `reports`, and no component reads one (the
    pipelines pass every other output on by name)."""
    from rlpipe.pipelines.rl_pipeline import COMPONENTS

    reports = {name for step in STEPS for name in step.reports}
    assert reports == {"rollout_samples", "eval_samples", "time_breakdown"}
    for step in STEPS:
        outputs = COMPONENTS[step.name].component_spec.outputs or {}
        markdown = [name for name, spec in outputs.items() if spec.type.startswith("system.Markdown")]
        assert markdown == list(step.reports), step.name
    read = {name for component in COMPONENTS.values() for name in component.component_spec.inputs or {}}
    assert not read & reports


def test_sync_weights_merges_the_metrics_the_step_table_names():
    """The KFP component takes one `<step>_metrics` input per step the table says sync_weights merges (the
    in-process loop and the Argo steps merge rlpipe.steps.merged_steps, in the same order)."""
    from rlpipe.components.sync_weights.component import sync_weights

    inputs = [name for name in sync_weights.component_spec.inputs if name.endswith("_metrics")]
    assert set(inputs) == {f"{step}_metrics" for step in BY_NAME["sync_weights"].merges}
    ppo = parse_spec({"name": "t", "algorithm": {"name": "ppo"}})
    grpo = parse_spec({"name": "t"})
    assert merged_steps(ppo) == ("generate", "score", "values", "advantages", "update")
    assert merged_steps(grpo) == ("generate", "score", "advantages", "update")


def test_the_docs_map_names_every_module():
    """docs/how-to-read-the-code.md's layout names every module of rlpipe/, pipelines/ and benchmarks/."""
    doc = (REPO / "docs" / "how-to-read-the-code.md").read_text()
    layout = doc.split("## Layout", 1)[1].split("```")[1]
    missing = [
        str(path.relative_to(REPO))
        for folder in ("rlpipe", "pipelines", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != "__init__.py" and path.name not in layout
    ]
    assert not missing, f"modules the docs' map does not name: {missing}"


def test_the_reading_list_is_the_path_one_iteration_runs(initialized_run, tmp_path):
    """Every file README's list names for the per-step path (items 1-13) runs Python in one GRPO
    iteration, so the list cannot name a file the iteration does not pass through."""
    from rlpipe import loop
    from rlpipe.store.weights import read_weight_ref

    readme = (REPO / "README.md").read_text()
    section = readme.split("## How to read the code", 1)[1].split("\n## ", 1)[0]
    listed = [line.split("`")[1] for line in section.splitlines() if line[:1].isdigit()][:13]
    spec, run_root, cache = initialized_run
    ran: set[str] = set()

    def record(frame, event, arg) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)

    sys.setprofile(record)
    threading.setprofile(record)  # rewards run in a thread of their own (reward.timeout_s)
    try:
        loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, tmp_path, cache)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    ran_here = {str(Path(name).resolve().relative_to(REPO)) for name in ran if str(REPO) in str(Path(name).resolve())}
    assert [name for name in listed if name not in ran_here] == []
