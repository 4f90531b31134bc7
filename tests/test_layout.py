"""The package's layout: google/jaxloop's modules at the top, one concern per folder beneath,
imports flowing one way, and CONTRIBUTING's table naming every module."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxloop"

GOOGLE = {"types.py", "step.py", "partition.py", "loop.py", "stat_loop.py", "action_loop.py",
          "train_loop.py", "eval_loop.py", "outer_loop.py", "actions.py", "stop_handler.py",
          "async_action_context.py", "pipeline_loop.py", "constants.py", "trainers",
          "step_number_writer"}
CONCERNS = {"engine", "hooks", "state", "data", "checkpointing", "orchestration", "metrics",
            "recipes", "diagnostics", "launch"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The jaxloop modules `name` imports, anywhere in its body (function-level included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.split(".")[0] == "jaxloop"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _unit(module: str) -> str:
    """A module's top-level entry: its folder, or itself."""
    return module.split(".")[1] if module.count(".") else module


def test_the_top_level_is_google_modules_and_concerns():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == GOOGLE | CONCERNS | {"__init__.py", "examples"}


@pytest.mark.parametrize("level", ["module", "folder"])
def test_no_import_cycles(level):
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "jaxloop" or ".examples" in name or ".trainers" in name:
            continue  # the package's face and the programs at the top import anything
        deps = _imports(name, path, modules) - {"jaxloop"}
        if level == "folder":
            name, deps = _unit(name), {_unit(d) for d in deps} - {_unit(name)}
        graph.setdefault(name, set()).update(deps)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_contributing_names_every_module():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for concern in CONCERNS:
        for path in (PACKAGE / concern).glob("*.py"):
            if path.stem != "__init__":
                assert f"`{path.stem}`" in text, f"CONTRIBUTING.md lacks {concern}/{path.name}"


def test_a_module_of_an_earlier_release_names_its_new_home():
    with pytest.raises(ImportError, match=r"jaxloop.checkpoint is now jaxloop.checkpointing."
                                          r"checkpoint: write `from jaxloop.checkpointing import"):
        from jaxloop import checkpoint  # noqa: F401
    import jaxloop

    assert not hasattr(jaxloop, "no_such_module")
