"""rlpipe.spec is a package of one concern per module (schema, placement, validation, migration, encoding),
importing each other in one direction, behind one public API: `from rlpipe.spec import X` as before."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import rlpipe.spec
from rlpipe.spec import SpecError, parse_spec, spec_to_dict

from .conftest import REPO

PACKAGE = REPO / "rlpipe" / "spec"
# bottom first: each module may import only the ones before it
ORDER = [
    "section",
    "schema",
    "migration",
    "algorithm",
    "training",
    "held_out",
    "placement",
    "sharing",
    "run_spec",
    "validation",
    "encoding",
    "reference",
]


def _spec_imports(path: Path) -> set[str]:
    """The rlpipe.spec modules `path` imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlpipe.spec."):
            found.add(node.module.removeprefix("rlpipe.spec."))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("rlpipe.spec.") for a in node.names if a.name.startswith("rlpipe.spec.")}
    return found


def test_the_spec_modules_import_each_other_in_one_direction():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(ORDER), "a new module in rlpipe.spec: place it in ORDER (and in __init__'s docstring)"
    for position, module in enumerate(ORDER):
        imported = _spec_imports(PACKAGE / f"{module}.py")
        later = imported - set(ORDER[:position])
        assert not later, f"rlpipe.spec.{module} imports {sorted(later)}, which sit above it ({ORDER})"


def test_the_package_says_where_each_module_lives_and_exports_every_public_name():
    for module in ORDER:
        assert f"- {module}:" in rlpipe.spec.__doc__, module
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        public = {
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
        } | {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name) and not target.id.startswith("_")
        }
        missing = sorted(public - set(rlpipe.spec.__all__))
        assert not missing, f"rlpipe.spec does not re-export {missing} of rlpipe.spec.{module}"
    assert all(hasattr(rlpipe.spec, name) for name in rlpipe.spec.__all__)


def test_importing_the_spec_loads_nothing_heavy_and_nothing_of_the_rest_of_rlpipe():
    code = (
        "import sys, rlpipe.spec\n"
        "print(sorted(m for m in sys.modules if m.startswith('rlpipe') and not m.startswith('rlpipe.spec')))\n"
        "print(sorted(m for m in ('yaml', 'torch', 'numpy', 'pyarrow', 'kfp', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["['rlpipe']", "[]"], out


def test_a_spec_error_is_named_where_users_import_it_from():
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "rollout": {"engine": "jax"}})
    assert traceback.format_exception_only(err.value)[0].startswith("rlpipe.spec.SpecError: invalid run spec <dict>:")


def test_kl_coef_and_dpo_beta_each_document_one_thing():
    """algorithm.kl_coef is the KL penalty's coefficient (every algorithm's); algorithm.beta is DPO's temperature
    (dpo's own option): neither's doc calls it by the other's name, and both keys keep their names."""
    common = {f.name: f.metadata["doc"] for f in dataclasses.fields(rlpipe.spec.AlgorithmSpec)}
    dpo = {f.name: f.metadata["doc"] for f in dataclasses.fields(rlpipe.spec.options_class("dpo"))}
    assert common["kl_coef"].startswith("The KL penalty coefficient") and "beta" not in common["kl_coef"]
    assert dpo["beta"].startswith("DPO's temperature") and "Not a KL coefficient" in dpo["beta"]
    assert "beta" not in common
    spec = parse_spec({"name": "x", "algorithm": {"name": "dpo", "kl_coef": 0.0, "beta": 0.2}})
    assert (spec.algorithm.kl_coef, spec.algorithm.beta) == (0.0, 0.2)
    assert spec_to_dict(parse_spec({"name": "x", "algorithm": {"kl_coef": 0.04}}))["algorithm"]["kl_coef"] == 0.04


def test_replaced_keys_are_refused_with_what_to_write_before_any_other_check():
    from rlpipe.spec import replaced_keys

    assert replaced_keys(["not", "a", "mapping"]) == []
    assert replaced_keys({"name": "x"}) == []
    with pytest.raises(SpecError) as err:
        parse_spec({"task": {"name": "addition", "digits": 3}, "bogus": 1})
    message = str(err.value)
    assert message.startswith("invalid run spec <dict>:\n  task: the `task` section is now `data`")
    assert '  data:\n    generator: "addition"\n    options: {"digits": 3}' in message
    assert "bogus" not in message  # the replaced key is the one problem named
