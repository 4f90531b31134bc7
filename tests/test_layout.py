"""The package's layout: google/jaxloop's modules at the top, one concern per folder beneath,
imports flowing one way, and CONTRIBUTING's table naming every module."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxloop"

GOOGLE = {"types.py", "step.py", "partition.py", "loop.py", "stat_loop.py", "action_loop.py",
          "train_loop.py", "eval_loop.py", "outer_loop.py", "actions.py", "stop_handler.py",
          "async_action_context.py", "pipeline_loop.py", "constants.py", "trainers",
          "step_number_writer"}
CONCERNS = {"engine", "state", "data", "checkpointing", "orchestration", "metrics", "recipes",
            "diagnostics", "launch", "sharding", "hooks"}
# CONTRIBUTING's floors: each unit (a folder, or a module at the top) imports only units on
# floors below its own.
FLOORS = {
    "types": 1, "constants": 1, "stop_handler": 1, "async_action_context": 1,
    "step_number_writer": 1, "launch": 1, "data": 1, "sharding": 1,
    "engine": 2,
    "hooks": 3, "partition": 3,
    "metrics": 4, "diagnostics": 4,
    "recipes": 5, "checkpointing": 5,
    "state": 6,
    "step": 7, "actions": 7,
    "loop": 8, "orchestration": 8,
    "stat_loop": 9, "action_loop": 10, "train_loop": 11, "eval_loop": 11,
    "pipeline_loop": 12, "outer_loop": 12,
    "trainers": 13, "examples": 13,
}
# The core: what a step and a loop are made of. What plugs into it comes from above.
CORE = {"step", "loop", "engine"}
PLUGS = {"recipes", "diagnostics", "metrics", "checkpointing", "orchestration"}


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


def _unit_imports() -> dict[str, dict[str, set[str]]]:
    """For each unit, the units each of its modules imports (function-level included)."""
    modules = _modules()
    found: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        if name != "jaxloop":  # the package's face resolves any name on first use
            deps = {_unit(d) for d in _imports(name, path, modules) - {"jaxloop"}}
            found.setdefault(_unit(name), {})[name] = deps - {_unit(name)}
    return found


def test_the_core_imports_nothing_that_plugs_into_it():
    # Recipes, diagnostics, metrics, checkpoints and orchestration plug into the step and the
    # loop from above (their hooks and arguments), never the other way.
    wrong = {module: sorted(deps & PLUGS) for unit, modules in _unit_imports().items()
             if unit in CORE for module, deps in modules.items() if deps & PLUGS}
    assert not wrong, f"the core imports from above it: {wrong}"


def test_every_import_goes_to_a_lower_floor():
    units = _unit_imports()
    assert set(units) <= set(FLOORS), f"no floor for {sorted(set(units) - set(FLOORS))}"
    upward = {module: sorted(d for d in deps if FLOORS[d] >= FLOORS[unit])
              for unit, modules in units.items() for module, deps in modules.items()
              if any(FLOORS[d] >= FLOORS[unit] for d in deps)}
    assert not upward, f"imports of a unit on the same floor or above: {upward}"


def test_contributing_gives_each_unit_its_floor():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("| floor | place |"):text.index("## Development set-up")]
    said = {}
    for row in table.strip().splitlines()[2:]:
        floor, place = (cell.strip() for cell in row.strip("|").split("|")[:2])
        low, _, high = floor.partition("-")
        for name in re.findall(r"`([a-z_]+)(?:\.py|/)`", place):
            said[name] = range(int(low), int(high or low) + 1)
    present = {p.stem for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert set(said) == present, f"table vs package: {sorted(set(said) ^ present)}"
    wrong = {name: FLOORS[name] for name, floors in said.items() if FLOORS[name] not in floors}
    assert not wrong, f"CONTRIBUTING gives these units other floors than FLOORS: {wrong}"


def test_the_package_names_its_exports_in_one_place():
    # One table in __init__.py gives each name its module (and `__all__`); no import block
    # repeats it for type checkers.
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    assert not [ast.unparse(n) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jaxloop")]
    import jaxloop

    assert jaxloop.__all__ == sorted(jaxloop.__all__) and "Step" in jaxloop.__all__
