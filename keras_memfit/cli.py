"""The `keras-memfit` command line (also `python -m keras_memfit`).

Subcommands:
    demo: The Digit Recognizer demo: plain `model.predict` dies of OOM,
        `keras_memfit.safe_predict` recovers and writes `submission.csv`.

Each subcommand is one `_add_<name>(subparsers)` function that declares its
options and sets `handler`, a function taking the parsed arguments and
returning the exit status; `report` and `predict` will be added the same way.
The parser only reads constants from the subcommands' modules; their work
(and TensorFlow, where they need it) is imported when the subcommand runs.

Errors are one line on stderr (`keras-memfit: error: ...`) and a non-zero exit
status: 2 for bad arguments, 1 for failures, 130 for Ctrl-C; never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, NoReturn, Optional, Sequence

PROG = "keras-memfit"


class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type` accepting integers >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in some errors
    return parse


# --------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------
def _add_demo(subparsers: "argparse._SubParsersAction[_Parser]") -> None:
    from keras_memfit.demo import (  # constants only: keras_memfit.demo imports no TensorFlow
        DEFAULT_CPU_MEMORY_LIMIT_MB,
        DEFAULT_EPOCHS,
        DEFAULT_GPU_MEMORY_LIMIT_MB,
        DEFAULT_TRAIN_SAMPLES,
        MIN_CPU_MEMORY_LIMIT_MB,
    )

    parser = subparsers.add_parser(
        "demo",
        help="show plain model.predict dying of OOM and safe_predict recovering",
        description=(
            "Train a small CNN on generated Kaggle Digit Recognizer data, show "
            "model.predict(x_test, batch_size=28000) failing with a real "
            "ResourceExhaustedError under a memory limit, then "
            "keras_memfit.safe_predict succeeding, and write submission.csv. "
            "No download; about a minute on two CPU cores."
        ),
    )
    parser.add_argument(
        "--output", "-o", default="submission.csv", metavar="PATH",
        help="where to write the Kaggle submission (default: %(default)s)",
    )
    parser.add_argument(
        "--memory-limit", type=_int_at_least(1), default=None, metavar="MB",
        help=(
            "device memory limit in MiB (default: "
            f"{DEFAULT_CPU_MEMORY_LIMIT_MB} on CPU, at least {MIN_CPU_MEMORY_LIMIT_MB}; "
            f"{DEFAULT_GPU_MEMORY_LIMIT_MB} on GPU)"
        ),
    )
    parser.add_argument(
        "--epochs", type=_int_at_least(1), default=DEFAULT_EPOCHS,
        help="training epochs (default: %(default)s)",
    )
    parser.add_argument(
        "--train-samples", type=_int_at_least(100), default=DEFAULT_TRAIN_SAMPLES,
        metavar="N", help="generated training images (default: %(default)s)",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "gpu"), default="auto",
        help="where to run: a GPU if TensorFlow sees one (auto), or force one (default: auto)",
    )
    parser.add_argument(
        "--seed", type=_int_at_least(0), default=0,
        help="seed for the generated digits and the model (default: %(default)s)",
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="print only the summary",
    )
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from keras_memfit import demo

    try:
        demo.run_demo(
            args.output,
            memory_limit_mb=args.memory_limit,
            train_samples=args.train_samples,
            epochs=args.epochs,
            verbose=not args.quiet,
            device=args.device,
            seed=args.seed,
        )
    except demo.DemoError as err:
        raise _Failure(str(err)) from err
    except ValueError as err:  # an argument run_demo rejects (e.g. too small a limit)
        raise UsageError(str(err)) from err
    return 0


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
class _Failure(Exception):
    """A command failed (exit status 1); its message is the one line shown."""


def build_parser() -> argparse.ArgumentParser:
    """The `keras-memfit` argument parser with every subcommand.

    Returns:
        The parser; its errors raise `UsageError` instead of exiting.

    Example:
        >>> args = build_parser().parse_args(["demo", "--quiet"])
        >>> args.command, args.quiet
        ('demo', True)
    """
    parser = _Parser(
        prog=PROG,
        description="keras_memfit: Keras without GPU out-of-memory errors.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the `keras-memfit` command line.

    Args:
        argv: Arguments without the program name; default `sys.argv[1:]`.

    Returns:
        The exit status: 0 on success, 1 if the command failed, 2 for bad
        arguments, 130 if interrupted. Errors are one line on stderr.

    Example:
        >>> main(["demo", "--output", "submission.csv"])
        0
    """
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as exit_:  # --help and --version exit through here
            return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2
        return int(args.handler(args))
    except UsageError as err:
        _error(str(err))
        return 2
    except _Failure as err:
        _error(str(err))
        return 1
    except (ValueError, OSError) as err:
        _error(str(err) or type(err).__name__)
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _error(message: str) -> None:
    line = " ".join(message.split())  # exactly one line
    sys.stderr.write(f"{PROG}: error: {line}\n")
    sys.stderr.flush()
