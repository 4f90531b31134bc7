"""Experiment trackers as metric writers: `MlflowWriter` and `WandbWriter` go wherever a
`writers.MetricWriter` goes; each needs its extra (``pip install jaxloop[mlflow]`` or
``jaxloop[wandb]``). Only process 0 talks to the tracker. A resumed job continues the same
run: save the run id with the checkpoints and read it back (`checkpoint.read_meta`)::

    run_id = checkpoint.read_meta(ckpt_dir).get(trackers.RUN_ID_KEY)  # None at the start
    writer = trackers.MlflowWriter(experiment='digits', run_id=run_id)
    checkpoints = CheckpointAction(manager, meta={trackers.RUN_ID_KEY: writer.run_id})
    train_loop = TrainLoop(step, end_actions=[SummaryAction(writer), checkpoints])
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxloop.launch import distributed
from jaxloop.metrics import writer_values as values
from jaxloop.metrics import writers

__all__ = ["RUN_ID_KEY", "MlflowWriter", "WandbWriter"]

log = logging.getLogger(__name__)

RUN_ID_KEY = "tracker_run_id"  # the checkpoint metadata key of the tracker's run id


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"{name} is not installed; install it with `pip install jaxloop[{name}]`") from e


class MlflowWriter(values.Closing):
    """Writes metrics to an MLflow run (scalars as metrics, hparams as params, texts as
    artifacts, histograms as their mean/min/max; videos and audio are skipped with a warning):
    `run_id` continues a run, None starts one in `experiment` (created when missing). MLflow 3
    needs ``MLFLOW_ALLOW_FILE_STORE=true`` for a ``file:///`` store. ``run_id`` is the run's id
    (None on processes other than 0 when none was given)."""

    def __init__(self, experiment: str = "jaxloop", run_id: str | None = None,
                 run_name: str | None = None, tracking_uri: str | None = None,
                 tags: Mapping[str, str] | None = None):
        self._active = distributed.is_main_process()
        self.run_id, self._closed = run_id, False
        if not self._active:
            return
        mlflow = _import("mlflow")
        self._entities = mlflow.entities
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            exp = self._client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(experiment)
            run = self._client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
            self.run_id = run.info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")  # "Run '<id>' not found" if none

    def write_scalars(self, step: int, scalars: values.Arrays) -> None:
        if not self._active or not scalars:
            return
        step = values.as_step(step)
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(key, value, now, step)
                   for key, value in values.prepare_scalars(scalars).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def write_images(self, step: int, images: values.Arrays) -> None:
        if not self._active:
            return
        step = values.as_step(step)
        for key, value in images.items():
            for i, image in enumerate(values.pixels("Image", key, value)):
                self._client.log_image(self.run_id, image, key=f"{key}/{i}" if i else key,
                                       step=step)

    def write_videos(self, step: int, videos: values.Arrays) -> None:
        if self._active and videos:
            values.warn_once(self, "%s does not record videos; skipped.", log)

    def write_audios(self, step: int, audios: values.Arrays, *, sample_rate: int) -> None:
        if self._active and audios:
            values.warn_once(self, "%s does not record audio; skipped.", log)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        if not self._active:
            return
        step = values.as_step(step)
        for key, text in texts.items():
            self._client.log_text(self.run_id, str(text), f"texts/{key}/step_{step}.txt")

    def write_histograms(self, step: int, arrays: values.Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        self.write_scalars(step, {f"{key}/{f}": getattr(np.asarray(value, np.float64), f)()
                                  for key, value in arrays.items() for f in ("mean", "min", "max")})

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        if not self._active:
            return
        params = [self._entities.Param(key, str(values.hparam_value(v))[:6000])
                  for key, v in values.flatten_hparams(hparams).items()]
        existing = self._client.get_run(self.run_id).data.params
        # MLflow params are immutable: a resumed run logs only the new ones.
        new = [p for p in params if p.key not in existing]
        changed = sorted(p.key for p in params if p.key in existing and existing[p.key] != p.value)
        if changed:
            log.warning("MLflow run %s keeps its earlier values of params %s", self.run_id,
                        changed)
        for i in range(0, len(new), 100):  # MLflow's batch limit is 100 params
            self._client.log_batch(self.run_id, params=new[i : i + 100])

    def flush(self) -> None:
        """Nothing to do: every call is written when made."""

    def close(self) -> None:
        """Marks the run finished."""
        if self._active and not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id)


class WandbWriter(values.Closing):
    """Writes metrics to a Weights & Biases run: `run_id` continues a run, None starts one;
    `init_kwargs` go to ``wandb.init``. W&B drops values at a step earlier than one already
    written (as after restoring an older checkpoint). ``run`` is the ``wandb`` Run (None on
    processes other than 0), ``run_id`` its id."""

    def __init__(self, project: str | None = None, run_id: str | None = None,
                 name: str | None = None, mode: str | None = None,
                 dir: str | os.PathLike[str] | None = None,  # noqa: A002 (wandb's name)
                 config: Mapping[str, Any] | None = None, **init_kwargs: Any):
        self._active = distributed.is_main_process()
        self._closed, self.run = False, None
        if not self._active:
            self.run_id = run_id
            return
        self._wandb = _import("wandb")
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        init_kwargs.setdefault("settings", self._wandb.Settings(silent=True, console="off"))
        self.run = self._wandb.init(
            project=project, id=run_id, name=name, mode=mode,
            dir=os.fspath(dir) if dir is not None else None,
            config=dict(config) if config is not None else None,
            resume="allow", reinit="create_new", **init_kwargs)
        self.run_id = self.run.id

    def _log(self, step: int, logged: Mapping[str, Any]) -> None:
        if self._active and logged:
            self.run.log(dict(logged), step=values.as_step(step))

    def write_scalars(self, step: int, scalars: values.Arrays) -> None:
        self._log(step, values.prepare_scalars(scalars) if self._active else {})

    def write_images(self, step: int, images: values.Arrays) -> None:
        if self._active:
            self._log(step, {key: [self._wandb.Image(i) for i in values.pixels("Image", key, v)]
                             for key, v in images.items()})

    def write_videos(self, step: int, videos: values.Arrays) -> None:
        """As GIFs, N videos of a key tiled into one; needs moviepy (``jaxloop[video]``)."""
        if not self._active or not videos or not values.has_moviepy(self):
            return
        logged = {}
        for key, value in videos.items():
            v = values.pixels("Video", key, value)
            v = v[..., [0, 0, 0]] if v.shape[-1] == 1 else v[..., :3]  # RGB, as GIF has it
            logged[key] = self._wandb.Video(np.moveaxis(v, -1, -3), fps=4, format="gif")
        self._log(step, logged)

    def write_audios(self, step: int, audios: values.Arrays, *, sample_rate: int) -> None:
        if self._active:
            self._log(step, {key: [self._wandb.Audio(clip, sample_rate=sample_rate)
                                   for clip in values.audios_ntc(key, value)]
                             for key, value in audios.items()})

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        if self._active:
            self._log(step, {key: self._wandb.Html(f"<pre>{text}</pre>")
                             for key, text in texts.items()})

    def write_histograms(self, step: int, arrays: values.Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        if not self._active:
            return
        buckets = dict(num_buckets or {})
        self._log(step, {key: self._wandb.Histogram(
            np.asarray(value), num_bins=buckets.get(key, writers.DEFAULT_HISTOGRAM_BUCKETS))
            for key, value in arrays.items()})

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        if self._active:
            flat = {k: values.hparam_value(v) for k, v in values.flatten_hparams(hparams).items()}
            self.run.config.update(flat, allow_val_change=True)

    def flush(self) -> None:
        """Nothing to do: W&B's own service writes in the background."""

    def close(self) -> None:
        """Finishes the run (``wandb.teardown()`` waits for W&B's service to write its files)."""
        if self._active and not self._closed:
            self._closed = True
            self.run.finish()
