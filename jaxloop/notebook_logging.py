"""Makes jaxloop's INFO messages visible in a notebook whose user configured no logging.

What a user asks jaxloop to log (``initialize_model(..., log_num_params=True)``, "Training
from step 0 to 500.") is logged at INFO, which Python's default WARNING level hides. In a
notebook kernel (``ipykernel`` loaded), `jaxloop` calls `show_info_if_unconfigured` when it
is imported: if neither the ``jaxloop`` logger nor the root logger was configured, it sets
the ``jaxloop`` logger to INFO. Records then reach the root logger's handler, the one
``logging.basicConfig()`` makes (absl calls it the first time orbax logs, which happens when
jaxloop is imported); where the root has no handler at all, a stderr handler of jaxloop's
own shows them, and stays silent once the root has one (no line is printed twice).

Two kinds of INFO lines are for log files, not for a cell, and stay hidden there: the
metric lines of `writers.LoggingWriter` (``create_default_writer``'s logging half: a line
per written step, 400 lines for 400 steps; the progress bar shows the latest values, and
`OuterLoop.history` and TensorBoard keep them all) and the state's parameter table that
`OuterLoop` logs (``jaxloop.param_table``; ask for it with
``print(param_table.table(state))``). Their loggers (`QUIET_IN_A_NOTEBOOK`) are set to
WARNING, so their warnings and errors still show.

Any configuration of yours wins: a level on the ``jaxloop`` logger, a root level other than
WARNING, or root handlers other than basicConfig's default leave everything as it is; a
level you set on one of the quiet loggers, before or after, is kept. Example, show the
parameter table that every new `OuterLoop` logs::

    logging.getLogger('jaxloop.param_table').setLevel(logging.INFO)

Example, configured logging (nothing is added)::

    import logging
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', force=True)
    import jaxloop
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "jaxloop"
QUIET_IN_A_NOTEBOOK = ("jaxloop.writers", "jaxloop.param_table")
"""Loggers whose INFO lines a notebook does not show (see the module docstring)."""


class _FallbackHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (a kernel replaces it) while the root logger
    has no handler of its own."""

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
    return (
        logging.getLogger(LOGGER_NAME).level == logging.NOTSET
        and root.level == logging.WARNING
        and all(_is_default_handler(h) for h in root.handlers)
    )


def show_info_if_unconfigured() -> bool:
    """Shows jaxloop's INFO messages where nothing is configured; returns whether it did.

    Example::

        from jaxloop import notebook_logging
        notebook_logging.show_info_if_unconfigured()  # what importing jaxloop in a kernel does
    """
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
