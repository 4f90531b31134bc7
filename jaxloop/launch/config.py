"""Run configuration: a dataclass describes a run; the command line overrides its fields.

`parse` makes each field a flag (``train_steps``: ``--train-steps``) typed by its annotation
and documented by its comment, with simple_parsing (the ``examples`` extra); bad values and
unknown fields are argparse errors naming the flag::

    @dataclasses.dataclass
    class Config:
        train_steps: int = 600
        learning_rate: float = 3e-3  # peak learning rate
        partitioner: Literal['dp', 'fsdp'] = 'dp'

    config = config_lib.parse(Config, ['--train-steps', '100'])  # Config(train_steps=100, ...)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["parse"]

T = TypeVar("T")


def parse(config_type: type[T], argv: Sequence[str] | None = None,
          description: str | None = None) -> T:
    """The `config_type` dataclass with its defaults overridden by `argv` (default:
    ``sys.argv[1:]``); a bad override exits through argparse."""
    if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
        raise TypeError(f"config_type must be a dataclass type, got {config_type!r}")
    try:
        import simple_parsing  # noqa: PLC0415 (an `examples` extra, not a core dependency)
    except ImportError as e:
        raise ImportError(
            "config.parse needs simple_parsing: pip install 'jaxloop[examples]'") from e

    parser = simple_parsing.ArgumentParser(
        description=description,
        add_option_string_dash_variants=simple_parsing.DashVariant.DASH,
        add_dest_to_option_strings=False,
    )
    parser.add_arguments(config_type, dest="config")
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except ValueError as e:  # the dataclass's own checks (__post_init__)
        parser.error(str(e))
    if unknown:
        fields = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(config_type)]
        hints = []
        for flag in (arg.split("=")[0] for arg in unknown if arg.startswith("-")):
            close = difflib.get_close_matches(flag, fields, n=1)
            hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}"
                     + (f"; unknown fields: {', '.join(hints)}" if hints else ""))
    return namespace.config
