"""The command-line arguments of the file handling every tool shares: ``--max-input-gib``
(:func:`add_max_input_argument`) and ``--out`` / ``--overwrite`` (:func:`add_output_arguments`)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .limits import DEFAULT_MAX_ARRAY_BYTES

__all__ = ["add_max_input_argument", "add_output_arguments"]

def add_max_input_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--max-input-gib`` of a command-line tool (default :data:`DEFAULT_MAX_ARRAY_BYTES`): ``what`` files
    declaring more GiB of data are refused before they are read. The value must be a number > 0; the
    limit in bytes is ``int(args.max_input_gib * 2**30)``."""

    def gib(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    parser.add_argument(
        "--max-input-gib",
        type=gib,
        default=DEFAULT_MAX_ARRAY_BYTES / 2**30,
        help=f"refuse {what} declaring more than this many GiB of data, before reading (default %(default)g)",
    )


def add_output_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str, **out: Any
) -> None:
    """``--out`` (``help`` and ``out``: its other ``add_argument`` settings, ``default=``, ``required=``,
    ``type=``) and ``--overwrite`` of a command-line tool: the pair :func:`prepare_output_dir` checks."""
    parser.add_argument("--out", help=help, **out)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the outputs of an earlier run in --out"
    )
