"""Run configuration: a dataclass describes a run; the command line overrides its fields.

`parse` builds the command line from the dataclass with simple_parsing (an extension of
argparse): each field is a flag of the same name with dashes (``train_steps`` is
``--train-steps``), typed by its annotation (``Literal[...]`` gives choices, ``bool`` a
switch: ``--telemetry`` or ``--telemetry false``), documented by the field's docstring or
comment (``--help``). A value of the wrong type, a choice not offered and a field that does
not exist (with the closest names suggested) are argparse errors naming the flag; a
``ValueError`` from the dataclass's ``__post_init__`` (checks across fields) is reported the
same way. Pass the parsed dataclass to `run_record.write` to record it as given.

Why simple_parsing: the examples' flags were argparse flags, and simple_parsing is argparse
(the flags, their errors and ``--help`` stay what they were) driven by a dataclass, with
no global flag registry (absl's, which ``ml_collections.config_flags`` and etils's
``eapp`` need) and nothing to learn beyond a dataclass. It is installed with the
``examples`` extra (``pip install jaxloop[examples]``).

Example::

    @dataclasses.dataclass
    class Config:
        train_steps: int = 600
        learning_rate: float = 3e-3  # peak learning rate
        partitioner: Literal['dp', 'fsdp'] = 'dp'

    config = config_lib.parse(Config, ['--train-steps', '100'])  # Config(train_steps=100, ...)
    run_record.write(workdir, config=config)
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
    ``sys.argv[1:]``).

    Raises:
      SystemExit: a bad override (argparse prints the error, naming the flag, and the usage).
      TypeError: `config_type` is not a dataclass.

    Example::

        config = config_lib.parse(Config, ['--learning-rate', '0.1'])
    """
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
        for arg in unknown:
            flag = arg.split("=")[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, fields, n=1)
                hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}"
                     + (f"; unknown fields: {', '.join(hints)}" if hints else ""))
    return namespace.config
