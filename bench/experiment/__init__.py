"""The latency-hiding experiment (``make run``, the README's main command): an application of Bunshin and
``speculator``, kept outside the SDK's import path. Run it from the checkout's root: ``python -m bench.experiment``
(``--help`` lists its options)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._runner import ExperimentResult


def main(
    argv: list[str] | None = None,
    *,
    progress: Callable[[str], None] = print,
    on_result: Callable[[ExperimentResult], object] | None = None,
) -> int:
    """Parse ``argv`` (default: the command line) and run the experiment; the exit status. ``progress`` gets its
    progress lines, ``on_result`` its result (``tests/bench/accounting_check`` samples beside it by them)."""
    from ._cli import add_arguments
    from ._cli import main as run

    parser = argparse.ArgumentParser(prog="python -m bench.experiment", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), progress=progress, on_result=on_result)
