"""jaxloop uses other libraries through their public API only.

Every module under jaxloop/ is parsed (comments and docstrings are prose, not use) and fails on:

- ``jax._src`` anywhere in code, strings included (e.g. ``import_module('jax._src.x')``);
- another library's underscore-private names: ``import x._y``, ``from x._y import z``,
  ``from x import _y``, ``x._y`` and ``getattr(x, '_y')`` where ``x`` was bound by importing
  another library (stdlib included). jaxloop's own private names (``writers._events_file``,
  ``self._x``), local aliases of public modules and dunders (``__version__``) are fine;
- tensorboardX below its top level: its documented API is the package's own names
  (``SummaryWriter``, ...), while ``tensorboardX.proto``, ``.summary``, ``.event_file_writer``
  etc. are its implementation;
- matching another library's error text: inside ``except ... as e``, ``str(e)``, ``repr(e)``,
  ``e.args`` or an f-string of ``e`` compared with, or searched for, a string. Errors should
  be told apart by type, or avoided by asking first.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxloop"
OWN = "jaxloop"
# Libraries whose public API is their top-level namespace only (see the module docstring).
TOP_LEVEL_ONLY = {"tensorboardX"}
# What writers.SummaryWriter writes with instead of tensorboardX's top-level writer, whose
# flush leaves the events queued for its thread unwritten (a write then a flush, 30 times:
# none readable); the modules that top-level writer is made of, called the way it calls them.
TOP_LEVEL_EXCEPTIONS = {
    "tensorboardX.summary", "tensorboardX.event_file_writer", "tensorboardX.proto.event_pb2"}
_TEXT_METHODS = {"startswith", "endswith", "find", "rfind", "index", "rindex", "count"}
_SEARCH_FUNCTIONS = {"search", "match", "fullmatch", "findall", "finditer"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(module: str) -> bool:
    return module.split(".")[0] != OWN


def _module_problem(module: str) -> str | None:
    """What is wrong with importing dotted `module` (None: nothing)."""
    parts = module.split(".")
    if module == "jax._src" or module.startswith("jax._src."):
        return f"imports {module} (jax._src is JAX's implementation)"
    if any(_private(p) for p in parts):
        return f"imports private module {module}"
    if parts[0] in TOP_LEVEL_ONLY and len(parts) > 1 and module not in TOP_LEVEL_EXCEPTIONS:
        return f"imports {module}: {parts[0]}'s public API is its top-level names"
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _foreign_bindings(tree: ast.AST) -> dict[str, str]:
    """Local names bound by importing another library -> what they name."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _foreign(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _error_text(node: ast.AST, name: str) -> bool:
    """Whether `node` is the text of exception variable `name` (str(e), e.args, ...)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("str", "repr", "format") and node.args:
            return isinstance(node.args[0], ast.Name) and node.args[0].id == name
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("lower", "casefold", "strip"):  # str(e).lower() is still its text
            return _error_text(node.func.value, name)
    if isinstance(node, ast.Subscript):
        return _error_text(node.value, name)
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == name and node.attr in (
            "args", "message", "msg", "strerror")
    if isinstance(node, ast.JoinedStr):
        return any(
            isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)
            and v.value.id == name for v in node.values
        )
    return False


def _has_string(nodes: list[ast.AST]) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str)
        or isinstance(n, ast.Tuple | ast.List | ast.Set)
        and any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)
        for n in nodes
    )


def _error_matches(handler: ast.ExceptHandler) -> list[tuple[int, str]]:
    name = handler.name
    found = []
    for node in ast.walk(handler):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_error_text(o, name) for o in operands) and _has_string(operands):
                found.append((node.lineno, f"compares the text of {name} with a string"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _TEXT_METHODS and _error_text(node.func.value, name):
                found.append((node.lineno, f"searches the text of {name}"))
            elif node.func.attr in _SEARCH_FUNCTIONS and any(
                _error_text(a, name) for a in node.args
            ):
                found.append((node.lineno, f"matches a pattern against the text of {name}"))
    return found


def problems(source: str) -> list[str]:
    """``'line N: what'`` for each use of another library's private API in `source`."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    bound = _foreign_bindings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and (problem := _module_problem(alias.name)):
                    found.append((node.lineno, problem))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _foreign(node.module):
            if problem := _module_problem(node.module):
                found.append((node.lineno, problem))
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"imports {alias.name} from {node.module}"))
                elif node.module in TOP_LEVEL_ONLY and importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                ) and (  # a submodule: `from tensorboardX import record_writer`
                    problem := _module_problem(f"{node.module}.{alias.name}")
                ):
                    found.append((node.lineno, problem))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, f"uses {ast.unparse(node)} ({bound[base.id]})"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if (
                node.func.id in ("getattr", "hasattr") and len(args) >= 2
                and isinstance(args[0], ast.Name) and args[0].id in bound
                and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                and _private(args[1].value)
            ):
                found.append((node.lineno, f"uses {args[0].id}.{args[1].value} via getattr"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "jax._src" in node.value and id(node) not in docstrings:
                found.append((node.lineno, f"names jax._src in {node.value!r}"))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.extend(_error_matches(node))
    return [f"line {line}: {what}" for line, what in sorted(set(found))]


MODULES = sorted(p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_module_uses_only_public_api(module):
    found = problems((PACKAGE.parent / module).read_text())
    assert not found, f"{module} uses private API of another library:\n" + "\n".join(found)


# The checker itself: what it must catch, and what it must leave alone.

def _handler(error: str, body: str) -> str:
    return f"try:\n    f()\nexcept {error}:\n    {body}"


CAUGHT = {
    "from jax._src import distributed": "imports jax._src",
    "import jax._src.xla_bridge": "imports jax._src.xla_bridge",
    "from orbax.checkpoint._src.path import step": "private module orbax.checkpoint._src.path",
    "from optax import _src": "imports _src from optax",
    "import numpy as np\nx = np._NoValue": "uses np._NoValue (numpy)",
    "import jax\nx = jax.interpreters._x.y": "uses jax.interpreters._x",
    "from jax.sharding import Mesh\nMesh._cache.clear()": "uses Mesh._cache",
    "import jax\ngetattr(jax, '_src')": "uses jax._src via getattr",
    "import importlib\nimportlib.import_module('jax._src.core')": "names jax._src",
    "from tensorboardX.proto import event_pb2": "tensorboardX's public API",
    "from tensorboardX import record_writer": "tensorboardX's public API",
    "import tensorboardX.record_writer": "tensorboardX's public API",
    _handler("ValueError as e", "ok = 'single, unnamed' not in str(e)"): "compares the text of e",
    _handler("Exception as err", "ok = err.args[0] == 'x'"): "compares the text of err",
    _handler("OSError as e", "ok = str(e).lower().startswith('no such')"):
        "searches the text of e",
    "import re\n" + _handler("ValueError as e", "ok = re.search('bad', str(e))"):
        "matches a pattern against the text of e",
    _handler("ValueError as e", "ok = 'x' in f'{e}'"): "compares the text of e",
}

LEFT_ALONE = [
    "class A:\n    def f(self):\n        return self._x",
    "from jaxloop.metrics import writers\nwriters._events_file('.')",  # jaxloop's own helpers
    "from jaxloop.examples import dry_run\ndry_run._x()",
    "import jax\nv = jax.__version__",  # dunders are public
    "from tensorboardX import SummaryWriter",
    "from jax.experimental.compilation_cache import compilation_cache as _cc\n_cc.set_cache_dir()",
    "from typing import NamedTuple\nclass P(NamedTuple):\n    a: int\nP(1)._replace(a=2)",
    "import jax\ndef f(x):\n    return x._private",  # a value's attribute, not a module's
    '"""Never use jax._src (a docstring)."""',
    _handler("ValueError as e", "raise RuntimeError(f'failed: {e}') from e"),
    _handler("ValueError as e", "ok = e is None"),
]


@pytest.mark.parametrize("source, expected", CAUGHT.items(), ids=range(len(CAUGHT)))
def test_checker_catches(source, expected):
    found = problems(textwrap.dedent(source))
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("source", LEFT_ALONE, ids=range(len(LEFT_ALONE)))
def test_checker_leaves_public_and_own_names_alone(source):
    assert problems(source) == []
