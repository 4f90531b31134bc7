"""SimpleTrainer: train a model in a few lines, with checkpoints, summaries and evaluation.

It builds a train step and an eval step (`SimpleStep` unless told otherwise), a
`TrainLoop`, one `EvalLoop` per `EvalSpec`, and an `OuterLoop`, and runs them for
``epochs * steps_per_epoch`` steps, one train loop per epoch.

Example::

    trainer = SimpleTrainer(
        MLP(), epochs=5, steps_per_epoch=100,
        batch_spec={'input_features': [32, 1], 'output_features': [32, 1]},
        optimizer=optax.adam(1e-2),
        checkpointing_config=CheckpointingConfig(workdir),
    )
    outputs = trainer.train(train_batches, eval_specs=[EvalSpec(dataset=eval_batches)])
    len(outputs['loss']), outputs['loss'][-1].compute()  # one clu Average per step
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import nnx

from jaxloop import action_loop, outer_loop, partition, types
from jaxloop import actions as actions_lib
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import step as step_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import writers
from jaxloop.trainers import simple_step, trainer_utils

State = types.TrainState
Output = types.Output

DEFAULT_LEARNING_RATE = 1e-4
"""The learning rate of the default optimizer, ``optax.adam(1e-4)`` (google/jaxloop's)."""

# Keyword arguments the trainer sets itself on each part; a user passing them gets told.
_STEP_SET = frozenset({"model", "base_prng", "train", "optimizer", "partitioner"})
_LOOP_SET = frozenset({"step", "begin_actions", "end_actions"})
_OUTER_SET = frozenset({"train_loop", "eval_loops", "checkpoint_spec"})


def _accepted_names(cls: type) -> set[str]:
    """The keyword arguments a class's constructor accepts by name.

    Follows ``**kwargs`` up the class hierarchy (subclasses that forward them to their
    base), so `TrainLoop` accepts what `StatLoop` names.
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names |= {
            p.name for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return names


def _check_class(name: str, cls: Any, base: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{name} must be a subclass of {base.__qualname__}, got {cls!r}")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class SimpleTrainer:
    """Trains a model with a step class, a train loop, eval loops and an outer loop.

    Args:
      model: the model: a flax linen module (called with ``train=``), or what `step_class`
        accepts.
      epochs: how many train loops to run.
      steps_per_epoch: steps per train loop.
      batch_spec: the spec of one batch (see `trainer_utils.TrainerBatchSpec`), e.g.
        ``{'input_features': [32, 1], 'output_features': [32, 1]}`` or
        `SimpleDataLoader.get_batch_spec()`.
      checkpointing_config: save every few epochs and resume from the latest checkpoint
        (None: no checkpoints).
      summary_config: write TensorBoard summaries (None: none).
      log_num_params: log the parameter count at initialisation.
      optimizer: the optax optimizer (default: a fresh ``optax.adam(1e-4)``).
      partitioner: where arrays live (default: a fresh `SingleDevicePartitioner`); the eval
        step uses the same one. ``partioner=`` (google/jaxloop's spelling) is accepted too.
      step_class / train_loop_class / eval_loop_class / outer_loop_class: the classes to
        build, with keyword arguments.
      base_prng: the step's PRNG key(s) (default ``{'params': key(0), 'dropout': key(1)}``).
      additional_begin_actions / additional_end_actions: more actions for the train loop
        (copied; the trainer adds its checkpoint and summary actions to its own list).
      **kwargs: passed, by name, to each part whose constructor accepts it: the steps
        (e.g. ``should_shard_batch``), the loops (``steps_per_execution``,
        ``global_batch_size``, ``stat_names``) and the outer loop (``progress``,
        ``prefetch``). With an nnx module class as `model`, the others are its constructor
        arguments. Anything no part accepts raises TypeError naming it.

    Subclassing: the structure is google/jaxloop's. ``__init__`` builds ``_train_step``,
    the train loop's actions (``_build_actions(additional_begin_actions,
    additional_end_actions)`` returns ``(begin_actions, end_actions)``), ``_train_loop``,
    ``_eval_step``, ``_eval_loop`` (the first EvalSpec's loop), ``_outer_loop``, and then
    ``_setup(**kwargs)`` initialises ``_model_state``; `train` runs ``_outer_loop`` on
    ``_model_state``. Override a hook, or write an ``__init__`` that builds these
    attributes itself (as google's notebooks do); `train` runs such an ``_outer_loop`` as
    built.
    """

    # Set only by this class's __init__, which then gives the outer loop an eval loop per
    # EvalSpec; a subclass building `_outer_loop` itself leaves it None.
    _outer_kw: dict[str, Any] | None = None

    def __init__(
        self,
        model: Any,
        epochs: int,
        steps_per_epoch: int,
        batch_spec: types.BatchSpec,
        checkpointing_config: trainer_utils.CheckpointingConfig | None = None,
        summary_config: trainer_utils.SummaryConfig | None = None,
        log_num_params: bool = False,
        optimizer: optax.GradientTransformation | None = None,
        partitioner: partition.Partitioner | None = None,
        step_class: type[step_lib.Step] = simple_step.SimpleStep,
        train_loop_class: type[train_loop_lib.TrainLoop] = train_loop_lib.TrainLoop,
        eval_loop_class: type[eval_loop_lib.EvalLoop] = eval_loop_lib.EvalLoop,
        outer_loop_class: type[outer_loop.OuterLoop] = outer_loop.OuterLoop,
        base_prng: types.PRNGType | None = None,
        additional_begin_actions: Sequence[actions_lib.Action] | None = None,
        additional_end_actions: Sequence[actions_lib.Action] | None = None,
        **kwargs: Any,
    ):
        if "partioner" in kwargs:
            if partitioner is not None:
                raise TypeError("pass either partitioner= or partioner=, not both")
            partitioner = kwargs.pop("partioner")
        self._epochs = _positive_int("epochs", epochs)
        self._steps_per_epoch = _positive_int("steps_per_epoch", steps_per_epoch)
        _check_class("step_class", step_class, step_lib.Step)
        _check_class("train_loop_class", train_loop_class, train_loop_lib.TrainLoop)
        _check_class("eval_loop_class", eval_loop_class, action_loop.ActionLoop)
        _check_class("outer_loop_class", outer_loop_class, outer_loop.OuterLoop)
        if checkpointing_config is not None and not isinstance(
            checkpointing_config, trainer_utils.CheckpointingConfig
        ):
            raise TypeError(
                f"checkpointing_config must be a CheckpointingConfig, got {checkpointing_config!r}"
            )
        if summary_config is not None and not isinstance(
            summary_config, trainer_utils.SummaryConfig
        ):
            raise TypeError(f"summary_config must be a SummaryConfig, got {summary_config!r}")

        self._model = model
        self._batch_spec = batch_spec
        self._log_num_params = log_num_params
        self._checkpointing_config = checkpointing_config
        self._summary_config = summary_config
        self._eval_loop_class = eval_loop_class
        self._outer_loop_class = outer_loop_class
        # Fresh objects for every trainer: nothing is shared through default arguments.
        self._optimizer = optimizer if optimizer is not None else optax.adam(DEFAULT_LEARNING_RATE)
        self._partitioner = (
            partitioner if partitioner is not None else partition.SingleDevicePartitioner()
        )
        if base_prng is None:
            base_prng = {"params": jax.random.key(0), "dropout": jax.random.key(1)}

        step_kw, train_loop_kw, self._eval_loop_kw, self._outer_kw = self._route_kwargs(
            kwargs, model, step_class, train_loop_class, eval_loop_class, outer_loop_class
        )

        # The parts are built in google/jaxloop's order, through its overridable hooks
        # (`_build_actions`, `_setup`), so a subclass may replace any of them.
        self._train_step = step_class(
            model=model, base_prng=base_prng, train=True, optimizer=self._optimizer,
            partitioner=self._partitioner, **step_kw,
        )
        begin_actions, end_actions = self._build_actions(
            additional_begin_actions, additional_end_actions
        )
        self._train_loop = train_loop_class(
            step=self._train_step, begin_actions=begin_actions, end_actions=end_actions,
            **train_loop_kw,
        )
        self._eval_step = step_class(
            model=model, base_prng=base_prng, train=False, partitioner=self._partitioner,
            **step_kw,
        )
        self._eval_loop = self._new_eval_loop(0)
        self._more_eval_loops: list[Any] = []
        self._outer_loop = self._build_outer_loop([])
        self._setup()

    # -- construction helpers -------------------------------------------------------------------

    @staticmethod
    def _route_kwargs(
        kwargs: dict[str, Any], model: Any, step_class: type, train_loop_class: type,
        eval_loop_class: type, outer_loop_class: type,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Splits the trainer's extra keyword arguments among the parts that accept them."""
        for name in ("begin_actions", "end_actions"):
            if name in kwargs:
                raise TypeError(
                    f"SimpleTrainer got {name}=: pass additional_{name}= for the train loop"
                )
        step_names = _accepted_names(step_class) - _STEP_SET
        train_loop_names = _accepted_names(train_loop_class) - _LOOP_SET
        eval_loop_names = _accepted_names(eval_loop_class) - _LOOP_SET
        outer_names = _accepted_names(outer_loop_class) - _OUTER_SET
        nnx_class = isinstance(model, type) and issubclass(model, nnx.Module)
        step_kw, train_loop_kw, eval_loop_kw, outer_kw = {}, {}, {}, {}
        for name, value in kwargs.items():
            taken = False
            for names, target in ((step_names, step_kw), (train_loop_names, train_loop_kw),
                                  (eval_loop_names, eval_loop_kw), (outer_names, outer_kw)):
                if name in names:
                    target[name] = value
                    taken = True
            if taken:
                continue
            if nnx_class and name not in _STEP_SET | _LOOP_SET | _OUTER_SET:
                step_kw[name] = value  # an argument of the nnx module's constructor
                continue
            parts = ", ".join(c.__name__ for c in (step_class, train_loop_class,
                                                   eval_loop_class, outer_loop_class))
            if name in _STEP_SET | _LOOP_SET | _OUTER_SET:
                raise TypeError(
                    f"SimpleTrainer got keyword argument {name!r}, which the trainer sets "
                    f"itself on {parts}"
                )
            raise TypeError(
                f"SimpleTrainer got an unexpected keyword argument {name!r}: none of {parts} "
                "accepts it"
            )
        return step_kw, train_loop_kw, eval_loop_kw, outer_kw

    def _summary_action(self, collection: str) -> actions_lib.SummaryAction:
        config = self._summary_config
        writer = writers.create_default_writer(
            config.path, asynchronous=config.asynchronous, collection=collection
        )
        self._writers.append(writer)
        return actions_lib.SummaryAction(
            writer, interval=config.interval, flush_each_call=config.flush_each_call
        )

    def _build_actions(
        self,
        additional_begin_actions: Sequence[actions_lib.Action] | None,
        additional_end_actions: Sequence[actions_lib.Action] | None,
    ) -> tuple[list[actions_lib.Action], list[actions_lib.Action]]:
        """The train loop's begin and end actions (google/jaxloop's hook): copies of the
        additional ones, then a `CheckpointAction` and a `SummaryAction` when the configs ask
        for them. Sets `_checkpoint_manager` and starts `_writers`."""
        begin_actions = list(additional_begin_actions or [])
        end_actions = list(additional_end_actions or [])
        self._checkpoint_manager = None
        config = self._checkpointing_config
        if config is not None:
            self._checkpoint_manager = checkpoint.make_manager(
                config.checkpoint_spec.checkpoint_dir, max_to_keep=config.max_checkpoints
            )
            end_actions.append(actions_lib.CheckpointAction(
                self._checkpoint_manager, config.checkpoint_interval
            ))
        self._writers: list[Any] = []
        if self._summary_config is not None:
            end_actions.append(self._summary_action("train"))
        return begin_actions, end_actions

    def _setup(self, **kwargs: Any) -> None:
        """Initialises `_model_state` from the batch spec (google/jaxloop's hook); `kwargs` go
        to `initialize_model`."""
        self._model_state = self._train_step.initialize_model(
            self._batch_spec, self._log_num_params, **kwargs
        )
        if not isinstance(self._model, nn.Module):
            # Non-linen models (nnx) keep per-step model structure: initialise the eval
            # step too, as google/jaxloop does. A linen model is stateless: nothing to do.
            self._eval_step.initialize_model(self._batch_spec, False, **kwargs)

    def _new_eval_loop(self, index: int) -> Any:
        """A new eval loop on the eval step for the `index`-th EvalSpec, with its own summary
        collection (``eval``, ``eval_1``, ...) when summaries are on."""
        kwargs = dict(self._eval_loop_kw)
        if self._summary_config is not None:
            kwargs["end_actions"] = [
                self._summary_action("eval" if index == 0 else f"eval_{index}")
            ]
        return self._eval_loop_class(step=self._eval_step, **kwargs)

    def _eval_loop_at(self, index: int) -> Any:
        """The eval loop for the `index`-th EvalSpec: `_eval_loop` for the first, the others
        built on first use."""
        if index == 0:
            return self._eval_loop
        while len(self._more_eval_loops) < index:
            self._more_eval_loops.append(self._new_eval_loop(len(self._more_eval_loops) + 1))
        return self._more_eval_loops[index - 1]

    def _build_outer_loop(self, eval_loops: list[Any]) -> outer_loop.OuterLoop:
        """An outer loop over the train loop and `eval_loops`, resuming from the checkpoint
        directory when checkpointing is on."""
        checkpoint_spec = (
            self._checkpointing_config.checkpoint_spec if self._checkpointing_config else None
        )
        kwargs = dict(self._outer_kw)
        if eval_loops:
            kwargs["eval_loops"] = eval_loops
        return self._outer_loop_class(
            self._train_loop, checkpoint_spec=checkpoint_spec, **kwargs
        )

    # -- public API -------------------------------------------------------------------------------

    def train(
        self,
        train_dataset: Iterable[types.Batch],
        eval_specs: Sequence[outer_loop.EvalSpec] | None = None,
        **kwargs: Any,
    ) -> Output | None:
        """Trains up to ``epochs * steps_per_epoch`` steps; returns the last train loop's
        outputs (every key a per-step list: ``outputs['loss'][i]`` is step i's loss).

        With a `CheckpointingConfig`, training resumes from the latest checkpoint in its
        directory. Each `EvalSpec` evaluates (by its own schedule, default every epoch)
        without changing the training state.

        Args:
          train_dataset: an iterator or iterable of batches (e.g. a `SimpleDataLoader`).
          eval_specs: evaluations to run between epochs.
          **kwargs: passed to the outer loop's call.
        """
        specs = list(eval_specs or [])
        if self._outer_kw is not None:
            # Built by this class's __init__: the outer loop gets one eval loop per spec. A
            # subclass whose __init__ builds `_outer_loop` itself (google/jaxloop's structure)
            # runs that one as it is.
            eval_loops = [self._eval_loop_at(i) for i in range(len(specs))]
            if self._outer_loop.eval_loops != eval_loops:
                self._outer_loop = self._build_outer_loop(eval_loops)
        state, outputs = self._outer_loop(
            self._model_state,
            train_dataset,
            self._epochs * self._steps_per_epoch,
            self._steps_per_epoch,
            specs,
            **kwargs,
        )
        self._model_state = state
        return outputs

    def close(self) -> None:
        """Waits for checkpoint writes and closes the summary writers."""
        if self._checkpoint_manager is not None:
            self._checkpoint_manager.wait_until_finished()
        for writer in self._writers:
            writer.close()

    @property
    def model_state(self) -> State:
        """The training state (after the last `train`, or as initialised)."""
        return self._model_state

    @property
    def train_step(self) -> step_lib.Step:
        return self._train_step

    @property
    def eval_step(self) -> step_lib.Step:
        return self._eval_step

    @property
    def train_loop(self) -> train_loop_lib.TrainLoop:
        return self._train_loop

    @property
    def eval_loops(self) -> list[Any]:
        """The eval loops `train` runs, one per EvalSpec of its last call."""
        return list(self._outer_loop.eval_loops)

    @property
    def checkpoint_manager(self) -> Any:
        """The orbax CheckpointManager writing the trainer's checkpoints, or None."""
        return self._checkpoint_manager
