"""Makes jaxloop's INFO messages visible in a notebook whose user configured no logging.

Importing `jaxloop` in a kernel calls `show_info_if_unconfigured`: if neither the ``jaxloop``
nor the root logger was configured, the ``jaxloop`` logger is set to INFO (with a stderr
handler while the root has none), and the per-step lines of `QUIET_IN_A_NOTEBOOK` to
WARNING. Any configuration of yours wins, e.g. to see the parameter table::

    logging.getLogger('jaxloop.diagnostics.param_table').setLevel(logging.INFO)
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "jaxloop"
# Loggers whose INFO lines are for log files: a line per step, the parameter table.
QUIET_IN_A_NOTEBOOK = ("jaxloop.metrics.writers", "jaxloop.diagnostics.param_table")


class _FallbackHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` while the root logger has no handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().hasHandlers():
            return  # the root's handlers show it (the user's, or basicConfig's)
        self.setStream(sys.stderr)
        super().emit(record)


def _is_default_handler(handler: logging.Handler) -> bool:
    """Whether `handler` is what a bare ``logging.basicConfig()`` installs."""
    if type(handler) is not logging.StreamHandler or handler.level != logging.NOTSET:
        return False
    probe = logging.LogRecord("probe", logging.INFO, __file__, 0, "message", None, None)
    return handler.format(probe) == "INFO:probe:message"  # logging.BASIC_FORMAT's


def unconfigured() -> bool:
    """Whether logging is as Python (and absl's implicit ``basicConfig()``) left it."""
    root = logging.getLogger()
    return (logging.getLogger(LOGGER_NAME).level == logging.NOTSET
            and root.level == logging.WARNING
            and all(_is_default_handler(h) for h in root.handlers))


def show_info_if_unconfigured() -> bool:
    """Shows jaxloop's INFO messages where nothing is configured; returns whether it did."""
    if not unconfigured():
        return False
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    for name in QUIET_IN_A_NOTEBOOK:
        quiet = logging.getLogger(name)
        if quiet.level == logging.NOTSET:  # a level the user set stays
            quiet.setLevel(logging.WARNING)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        logger.addHandler(_FallbackHandler())
    return True
