"""The package's shape, as docs/DESIGN.md "Layout" and issue 15 state it: no import cycle between
the packages of `megatron_rl/` (lazy imports inside functions count; `if TYPE_CHECKING:` blocks
do not), `config/` imports only the standard library, yaml and the registries' names, the training
loop stays short, and no function of `trainer/` or file of `megatron_rl/` grows past its limit."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_rl"


def _unit(module: str) -> str:
    """`megatron_rl.rollout.client` -> `rollout`; `megatron_rl.errors` -> `errors`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    """Every `megatron_rl.*` module imported by `path`, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_rl."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_rl"):
            found.add(node.module if node.module != "megatron_rl" else "megatron_rl.__init__")
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        src = _unit(".".join(rel.parts))
        deps = {_unit(m) for m in _imports(path)} - {src, "__init__"}
        graph.setdefault(src, set()).update(deps)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    cycle = _find_cycle(_graph())
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_imports_only_registry_names():
    # registries' names: algorithms.options (torch-free), the dataset adapters and reward functions
    # (looked up lazily, inside the cross-section checks)
    allowed = {"config", "registry", "errors", "algorithms", "data", "rewards"}
    for path in (PKG / "config").glob("*.py"):
        units = {_unit(m) for m in _imports(path)}
        assert units <= allowed, (path.name, units - allowed)
        for m in _imports(path):
            if _unit(m) == "algorithms":
                assert m == "megatron_rl.algorithms.options", (path.name, m)  # names + options, no torch


def test_size_limits():
    loop = PKG / "trainer" / "loop.py"
    assert len(loop.read_text().splitlines()) < 300
    for path in PKG.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 700, path
    for path in (PKG / "trainer").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, (path.name, node.name)


def test_test_file_basenames_are_unique():
    """tests/ has no __init__.py files, so pytest imports each test file by its basename
    (rootdir-relative "rootdir/basename" mode): two files with one basename stop the whole
    collection ("import file mismatch"), which is how CI failed once."""
    tests = PKG.parent / "tests"
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("*.py")):
        if ".venv" in path.parts:
            continue
        assert path.name not in seen or path.name == "conftest.py", (path, seen.get(path.name))
        seen[path.name] = path
