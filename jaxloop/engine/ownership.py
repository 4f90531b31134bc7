"""Which states a training step may consume: those nothing outside the loop refers to.

User code (an action, a hook, a cell) may keep a state or a part of one (``self.best =
state``, ``state.params``); donating it would delete what was kept. A loop marks the state
its caller passed in as held (`mark_held`); `call` marks a state held when user code gained
a reference to its root, containers or arrays (CPython's `sys.getrefcount`, before and
after). A step given a held state runs without donating it.

The library's own actions are not watched: they keep nothing (a checkpoint's background
commit holds the arrays it already copied to the host and never reads them again). A
reference taken by another thread while user code runs counts as kept (a cost, not an
error). What keeping costs: docs/features.md.

Example::

    ownership.call(action, state, outputs)   # may keep `state`
    consume = not ownership.is_held(state)
"""

from __future__ import annotations

import collections
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

# id(state) -> weak reference, for the states user code was seen to keep.
_held: dict[int, weakref.ref] = {}


def _children(node: Any) -> list[Any]:
    return jax.tree.leaves(node, is_leaf=lambda child: child is not node)


def _nodes(tree: Any) -> list[Any]:
    """The root of `tree`, its containers and its array leaves: what holds device memory.
    (Other leaves, such as None or small ints, are shared across the interpreter.)"""
    found, stack = [tree], [tree]
    while stack:
        node = stack.pop()
        for child in _children(node):
            if isinstance(child, jax.Array | np.ndarray):
                found.append(child)
            elif jax.tree.leaves(child):  # a container holding arrays
                found.append(child)
                stack.append(child)
    return found


def mark_held(state: Any) -> None:
    """Records that code outside the loop holds `state` (or part of it)."""
    key = id(state)
    try:
        _held[key] = weakref.ref(state, lambda _: _held.pop(key, None))
    except TypeError:  # no weak references (a tuple): held for as long as it lives
        _held[key] = lambda state=state: state  # type: ignore[assignment]


def is_held(state: Any) -> bool:
    """Whether `state` was marked held."""
    ref = _held.get(id(state))
    return ref is not None and ref() is state


def _edges_from_new(result: Any, known: set[int]) -> collections.Counter:
    """How many references containers of `result` that are not nodes of the watched state
    hold to that state's nodes (`known`: their ids): holders the caller asked for."""
    edges: collections.Counter = collections.Counter()
    stack, seen = [result], set()
    while stack:
        node = stack.pop()
        if id(node) in known or id(node) in seen:
            continue
        seen.add(id(node))
        children = _children(node)
        if len(children) == 1 and children[0] is node:
            continue  # a leaf
        edges.update(id(child) for child in children if id(child) in known)
        stack.extend(children)  # (the state's own nodes are skipped above)
    return edges


def _library(fn: Any) -> bool:
    code = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    module = getattr(code, "__module__", None) or ""
    return module.startswith("jaxloop.") and not module.startswith("jaxloop.examples.")


def call(fn: Callable[..., T], state: Any, *args: Any, **kwargs: Any) -> T:
    """``fn(state, *args, **kwargs)``, marking `state` held if `fn` kept a reference to it
    or to any of its parts (what `fn` returns, such as a new state sharing its parameters,
    is not a keeper).

    Example::

        ownership.call(action, state, outputs, loop=loop)
        new_state, batch = ownership.call(step.begin, state, batch)
    """
    if state is None or is_held(state) or _library(fn):
        return fn(state, *args, **kwargs)
    nodes = _nodes(state)
    before = [sys.getrefcount(node) for node in nodes]
    result = fn(state, *args, **kwargs)
    after = [sys.getrefcount(node) for node in nodes]
    edges = _edges_from_new(result, {id(node) for node in nodes})
    if any(a > b + edges[id(node)] for node, b, a in zip(nodes, before, after, strict=True)):
        mark_held(state)
    return result
