"""Makes jaxloop's messages in a notebook cell one line per event a user acts on
(docs/notebooks.md): importing `jaxloop` in a kernel with logging unconfigured sets the
``jaxloop`` logger to INFO (with a stderr handler while the root has none), routine lines and
a Stop's notices left out; scripts keep every line, and any configuration of yours wins::

    from jaxloop.metrics import notebook_logging
    notebook_logging.show_routine()  # the routine lines too, in a notebook
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "jaxloop"
WRITERS = "jaxloop.metrics.writers"
# Loggers whose INFO lines are for log files: a line per step, the parameter table.
QUIET_IN_A_NOTEBOOK = (WRITERS, "jaxloop.diagnostics.param_table")
# Routine lines of loggers that also report events (logger name, message format).
ROUTINE = (("jaxloop.actions", "Saving checkpoint for step %d to %s."),
           ("jaxloop.checkpointing.checkpoint",
            "No checkpoint found in %s. Returning the original model state."))
# The loggers of a Stop's notices, which mark their records with `preemption.STOP_NOTICE`.
_STOP_LOGGERS = ("jaxloop.launch.preemption", "jaxloop.outer_loop")
_FILTERED = [logging.getLogger(name) for name in (*dict(ROUTINE), *_STOP_LOGGERS)]


class _FallbackHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` while the root logger has no handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().hasHandlers():
            return  # the root's handlers show it (the user's, or basicConfig's)
        self.setStream(sys.stderr)
        tqdm_std = sys.modules.get("tqdm.std")
        if tqdm_std is None:
            super().emit(record)
            return
        try:  # on a line of its own: tqdm clears a text bar drawn there and redraws it below
            tqdm_std.tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _not_in_a_cell(record: logging.LogRecord) -> bool:
    """Drops the routine lines and a Stop's notices (a filter on their loggers)."""
    return (not getattr(record, "jaxloop_stop_notice", False)
            and (record.name, record.msg) not in ROUTINE)


def _is_default_handler(handler: logging.Handler) -> bool:
    """Whether `handler` is what a bare ``logging.basicConfig()`` installs."""
    probe = logging.LogRecord("probe", logging.INFO, __file__, 0, "message", None, None)
    return (type(handler) is logging.StreamHandler and handler.level == logging.NOTSET
            and handler.format(probe) == "INFO:probe:message")  # logging.BASIC_FORMAT's


def unconfigured() -> bool:
    """Whether logging is as Python (and absl's implicit ``basicConfig()``) left it."""
    root = logging.getLogger()
    return (logging.getLogger(LOGGER_NAME).level == logging.NOTSET
            and root.level == logging.WARNING
            and all(_is_default_handler(h) for h in root.handlers))


def show_info_if_unconfigured() -> bool:
    """Shows jaxloop's INFO messages, routine lines left out, if nothing is configured."""
    if not unconfigured():
        return False
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    for name in QUIET_IN_A_NOTEBOOK:
        quiet = logging.getLogger(name)
        if quiet.level == logging.NOTSET:  # a level the user set stays
            quiet.setLevel(logging.WARNING)
    for filtered in _FILTERED:
        filtered.addFilter(_not_in_a_cell)  # once: addFilter skips a filter already there
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        logger.addHandler(_FallbackHandler())
    return True


def show_routine(show: bool = True) -> None:
    """Shows (``show=False``: hides) the routine lines at INFO: checkpoint saves, each write of
    a `LoggingWriter` (the parameter table is logged at DEBUG, by its own logger)."""
    logging.getLogger(WRITERS).setLevel(logging.INFO if show else logging.WARNING)
    for filtered in _FILTERED:
        (filtered.removeFilter if show else filtered.addFilter)(_not_in_a_cell)
