"""The shape the core holds to, measured on its source: subpackages import each other in one direction
(lazy imports included), one module writes state.json, and functions and modules (the pipelines' and
the benchmarks' too) stay readable sizes."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO

CORE = REPO / "rlpipe"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
STATE_WRITER = "rlpipe/store/commit.py"


def _modules() -> dict[str, Path]:
    """rlpipe's modules by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _unit(module: str) -> str | None:
    """The room `module` belongs to: its top folder below rlpipe/ (rlpipe.store.weights -> store,
    rlpipe.services.samplers.client -> services: a room's sub-folders are the room), or itself when it lies
    loose at the top (rlpipe.loop -> loop)."""
    parts = module.split(".")
    if parts[0] != "rlpipe" or len(parts) < 2:
        return None
    return parts[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under `if TYPE_CHECKING:`, which never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for inner in ast.walk(node)}
    return skipped


def _imports(module: str, path: Path, type_checking: bool = False) -> set[str]:
    """Every rlpipe module `module` imports, at the top or inside a function (and under
    `if TYPE_CHECKING:` too with `type_checking`)."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}  # `from rlpipe import loop`
    return {name for name in found if name.startswith("rlpipe.")}


def _import_graph() -> dict[str, set[str]]:
    """unit -> the units it imports (subpackages and top-level modules of rlpipe)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        source = _unit(module)
        if source is None:
            continue
        targets = {_unit(name) for name in _imports(module, path) if name in modules}
        graph.setdefault(source, set()).update(t for t in targets if t and t != source)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_top_level_rooms_import_each_other():
    """A room is a top folder of rlpipe/ (its sub-folders included) or a module loose at the top: no two
    import each other both ways, lazy imports included (engines/ and services/ did: the sampler engine
    asked the samplers' client to reload, and the services run engines)."""
    graph = _import_graph()
    both_ways = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert not both_ways, f"rooms that import each other: {both_ways}"


def test_rlpipe_subpackages_and_modules_import_each_other_in_one_direction():
    graph = _import_graph()
    assert {"store", "spec", "training", "loop"} <= set(graph), sorted(graph)  # the scan sees the core
    cycles = _cycles(graph)
    edges = {unit: sorted(graph[unit] & set(group)) for group in cycles for unit in group}
    assert not cycles, f"import cycles among rlpipe's subpackages/modules: {cycles}; edges inside them: {edges}"


def test_no_circle_inside_a_room():
    """Within one folder, modules import each other in one direction too, type-only imports included
    (a registry in its own module, not in the package's __init__ that registers the built-ins)."""
    modules = _modules()
    graph = {
        module: {name for name in _imports(module, path, type_checking=True) if name in modules and name != module}
        for module, path in modules.items()
    }
    rooms: dict[str, dict[str, set[str]]] = {}
    for module, targets in graph.items():
        room = _unit(module)
        rooms.setdefault(room, {})[module] = {t for t in targets if _unit(t) == room}
    circles = {room: found for room, inside in rooms.items() if (found := _cycles(inside))}
    assert not circles, f"modules of one room that import each other: {circles}"


# Rooms that import a module of another room by its name (importlib), which the import graph above cannot see:
# each is plugin discovery, named here with its reason; any other is a hidden import, and fails below.
IMPORTED_BY_NAME = {
    ("plugins", "algorithms"): "plugin discovery (rlpipe.plugins.discover_built_ins): parsing a spec imports the "
    "built-in algorithms as it imports a user's plugin module, and they register their options with the spec "
    "(rlpipe.spec.register_options); the spec, low in the house, imports neither",
}


def _imported_by_name() -> set[tuple[str, str]]:
    """(room, room it names) for each module that imports by name (importlib.import_module) and whose code
    names a module of another room ('rlpipe.x.y', or 'rlpipe.x.y:name' as a registered name's plugin module)."""
    modules = _modules()
    found = set()
    for module, path in modules.items():
        source = path.read_text()
        if "import_module" not in source and "__import__" not in source:
            continue
        constants, _ = _code_constants_and_names(ast.parse(source))
        for constant in constants:
            named = constant.split(":", 1)[0]
            if named in modules and _unit(named) != _unit(module):
                found.add((_unit(module), _unit(named)))
    return found


def test_the_only_by_name_imports_across_rooms_are_plugin_discovery():
    """A by-name import of another room (rlpipe.spec once reached rlpipe.steps and rlpipe.algorithms so) hides
    an edge from the import graph: only those listed in IMPORTED_BY_NAME, each with its reason, are allowed."""
    found = _imported_by_name()
    assert found == set(IMPORTED_BY_NAME), f"by-name imports across rooms: {sorted(found)}; listed: {IMPORTED_BY_NAME}"
    assert "spec" not in {source for source, _ in found}, "the spec imports no room above it, by name or not"


def test_at_most_8_modules_lie_loose_at_the_top():
    loose = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose


def test_the_store_is_the_bottom_layer():
    """rlpipe.store imports nothing of rlpipe but itself and plain key names."""
    assert _import_graph().get("store", set()) <= {"metric_keys"}


def test_tracking_is_low_in_the_house():
    """MLflow and the model registries (rlpipe.tracking) read the spec and the store and nothing above them,
    so that evaluation, the loop and the CLI's commands can all record into it."""
    assert _import_graph().get("tracking", set()) <= {"spec", "store", "metric_keys"}


def _code_constants_and_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The string constants a module's code holds (docstrings left out) and the names it uses."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    constants = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    return constants, names


def test_one_module_writes_state_json():
    """run_root names the file (state_uri) and reads it (read_state); only the commit module writes it,
    and everything else that changes the state calls the commit module."""
    naming, using_the_path = [], []
    for path in sorted(CORE.rglob("*.py")):
        constants, names = _code_constants_and_names(ast.parse(path.read_text()))
        name = str(path.relative_to(REPO))
        if "state.json" in constants:
            naming.append(name)
        if "state_uri" in names:
            using_the_path.append(name)
    # rlpipe/data/files.py names a Hugging Face dataset directory's own state.json, which it only reads
    assert naming == ["rlpipe/data/files.py", "rlpipe/store/run_root.py"], naming
    assert using_the_path == [STATE_WRITER, "rlpipe/store/run_root.py"], using_the_path


def test_no_function_or_module_is_too_long_to_read():
    """rlpipe, the pipelines and the benchmarks alike."""
    long_functions, long_modules = [], []
    paths = [path for root in (CORE, REPO / "pipelines", REPO / "benchmarks") for path in sorted(root.rglob("*.py"))]
    assert {"rlpipe", "pipelines", "benchmarks"} <= {path.relative_to(REPO).parts[0] for path in paths}
    for path in paths:
        text = path.read_text()
        name = str(path.relative_to(REPO))
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def _metric_keys_by_module(roots: list[Path]) -> dict[str, set[str]]:
    """Every string literal shaped like a metric key ('policy/loss') in the modules under `roots`, with the
    modules that name it (MIME types aside)."""
    import re

    named: dict[str, set[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                value = node.value if isinstance(node, ast.Constant) else None
                if isinstance(value, str) and re.fullmatch(r"[a-z_0-9]+/[a-z_0-9]+", value):
                    if not value.startswith(("application/", "text/")):
                        named.setdefault(value, set()).add(str(path.relative_to(REPO)))
    return named


def test_metric_keys_named_by_several_modules_are_constants():
    """A metric key that one module writes and another reads back (or several write) is a constant in
    rlpipe/metric_keys.py, so a renamed key cannot silently break its readers."""
    named = _metric_keys_by_module([CORE, REPO / "pipelines", REPO / "components"])
    assert named["policy/loss"] == {"rlpipe/metric_keys.py"}  # the tally and the display name POLICY_LOSS
    shared = {key: sorted(modules) for key, modules in named.items() if len(modules - {"rlpipe/metric_keys.py"}) > 1}
    hint = "make each a constant in rlpipe/metric_keys.py"
    assert not shared, f"metric keys named as bare strings in several modules ({hint}): {shared}"
    assert _metric_keys_by_module([REPO / "tests"])  # the scan sees keys where there are some
