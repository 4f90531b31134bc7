"""Run record: the configuration, package versions, devices and mesh, written once when a run
starts as ``run.json`` and TensorBoard hparams, so a result can be traced to its code::

    record = run_record.write(workdir, config={'lr': 1e-3, 'batch_size': 128},
                              mesh=partitioner.mesh, writer=train_writer, state=state)
    record['devices']['kinds']  # {'cpu': 8}
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

import jax

from jaxloop.diagnostics import param_table

__all__ = ["FILE_NAME", "PACKAGES", "collect", "hparams", "write"]

FILE_NAME = "run.json"

PACKAGES = ("jaxloop", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "clu",
            "numpy", "tensorflow-datasets", "tensorflow", "tensorflow-cpu", "jax-cuda12-plugin",
            "libtpu", "mlflow-skinny", "mlflow", "wandb")
"""Packages whose installed versions are recorded (read from metadata, not imported)."""


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a config value (dataclasses, namespaces, ConfigDicts, arrays)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):  # ml_collections.ConfigDict
        value = value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:  # numpy / jax scalars
        return value.item()
    return str(value)


def collect(config: Any = None, mesh: Any = None) -> dict[str, Any]:
    """The run record as a JSON-safe dict; `config` a mapping, dataclass, `argparse.Namespace`
    or ``ConfigDict``, `mesh` a Mesh or a partitioner."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # not installed
            versions[name] = importlib.metadata.version(name)
    mesh = getattr(mesh, "mesh", mesh)  # a Partitioner carries its mesh
    return {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "host": socket.gethostname(),
        "config": _plain(config) if config is not None else {},
        "versions": versions,
        "devices": {
            "platform": jax.default_backend(),
            "kinds": dict(collections.Counter(d.device_kind for d in jax.devices())),
            "count": jax.device_count(),
            "local_count": jax.local_device_count(),
            "process_count": jax.process_count(),
        },
        "mesh": None if mesh is None else {"axis_names": list(mesh.axis_names),
                                           "shape": dict(mesh.shape)},
    }


def hparams(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record for ``write_hparams``: the config under its own names, the rest ``run.*``."""
    flat = dict(record["config"])
    flat["run.versions"] = dict(record["versions"])
    flat["run.devices"] = {
        "platform": record["devices"]["platform"],
        "kinds": ", ".join(f"{k} x{n}" for k, n in record["devices"]["kinds"].items()),
        "count": record["devices"]["count"],
        "process_count": record["devices"]["process_count"],
    }
    if record["mesh"] is not None:
        flat["run.mesh"] = " x ".join(f"{k}={v}" for k, v in record["mesh"]["shape"].items())
    return flat


def write(workdir: str | os.PathLike[str] | None, config: Any = None, mesh: Any = None,
          writer: Any = None, state: Any = None) -> dict[str, Any]:
    """Records this run (process 0): ``workdir/run.json`` and hparams through `writer`, with
    `state` its `param_table.totals` and the table as text; returns it. A resumed run keeps
    the earlier record as ``run.<started>.json``."""
    record = collect(config, mesh)
    if state is not None:
        record["state"] = param_table.totals(state)
    if jax.process_index() != 0:
        return record
    if workdir is not None:
        path = pathlib.Path(workdir, FILE_NAME)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            started = str(json.loads(path.read_text()).get("started", "earlier"))
            path.replace(path.with_name(f"run.{started.replace(':', '-')}.json"))
        tmp = path.with_name(f"{FILE_NAME}.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        tmp.replace(path)  # atomic: a reader never sees half a file
    if writer is not None:
        writer.write_hparams(hparams(record))
        if state is not None:
            writer.write_texts(0, {"parameters": param_table.markdown(state)})
        writer.flush()
    return record
