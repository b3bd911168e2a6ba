"""The `keras-memfit` command line (also `python -m keras_memfit`): `demo`, `predict`, `report`.

Each subcommand is one `_add_<name>(subparsers)` that declares its options and
sets `handler` (parsed arguments -> exit status). The parser imports only the
subcommands' constants; work that needs TensorFlow runs in a child process
(`keras_memfit.app.worker`), so that a memory limit is set before TensorFlow
starts and its logs and crashes reach the terminal as one line at most.
Errors are one line on stderr (`keras-memfit: error: ...`), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence

# The standard library (and numpy, when a file is checked) only: no TensorFlow.
from keras_memfit.app import demo, env, inputs, models, outputs, worker
from keras_memfit.app.errors import PredictError, WorkerError, one_line

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
            if (value := int(text)) >= low:
                return value
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")

    return parse


# --------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------
def _add_demo(subparsers: "argparse._SubParsersAction[_Parser]") -> None:
    parser = subparsers.add_parser(
        "demo",
        help="show plain fit and predict dying of OOM, MemFit and safe_predict recovering",
        description=(
            "On generated Kaggle Digit Recognizer data, under a memory limit: show "
            f"a small CNN's model.fit(batch_size={demo.FIT_BATCH_SIZE}) failing with a real "
            "ResourceExhaustedError, then fit(..., callbacks=[MemFit()]) training at "
            "that batch to plain Keras's weights without the limit; show "
            "model.predict(x_test, batch_size=28000) failing, then "
            "keras_memfit.safe_predict succeeding, and write submission.csv. "
            "No download; a minute or two on two CPU cores."
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
            f"{demo.DEFAULT_CPU_MEMORY_LIMIT_MB} on CPU, at least {demo.MIN_CPU_MEMORY_LIMIT_MB}; "
            f"{demo.DEFAULT_GPU_MEMORY_LIMIT_MB} on GPU)"
        ),
    )
    parser.add_argument(
        "--epochs", type=_int_at_least(1), default=demo.DEFAULT_EPOCHS,
        help="training epochs (default: %(default)s)",
    )
    parser.add_argument(
        "--train-samples", type=_int_at_least(100), default=demo.DEFAULT_TRAIN_SAMPLES,
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
    except ValueError as err:  # an argument run_demo rejects (e.g. too small a limit)
        raise UsageError(str(err)) from err
    return 0


# --------------------------------------------------------------------------
# predict
# --------------------------------------------------------------------------
_MAX_ADAPTATIONS_SHOWN = 4


def _add_predict(subparsers: "argparse._SubParsersAction[_Parser]") -> None:
    parser = subparsers.add_parser(
        "predict",
        help="run safe_predict over a .npy/.npz/.csv file, streaming outputs to a file",
        description=(
            "Load a saved Keras model (keras.saving.load_model), run "
            "keras_memfit.safe_predict over INPUT and write the outputs to --out "
            "without holding them all in device or host memory. INPUT is a .npy "
            "file (memory-mapped, so larger-than-RAM inputs are read a batch at a "
            "time), a .npz file (one array, or one array per model input named "
            "after the input), or a Kaggle Digit Recognizer CSV (pixel0..pixel783, "
            "with or without a label column; reshaped to the model's input shape). "
            "--out is a .npy file (the model's outputs, or labels with --argmax) or "
            "a .csv file (ImageId,Label with --argmax, as Kaggle's submission.csv; "
            "ImageId,p0..pK otherwise; ImageId counts from 1)."
        ),
        epilog=(
            "Example: keras-memfit predict model.keras test.csv --out submission.csv "
            "--argmax --batch-size 28000"
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="saved model (.keras or .h5)")
    parser.add_argument("input", metavar="INPUT", help="input samples: .npy, .npz or .csv")
    parser.add_argument(
        "--out", "-o", required=True, metavar="FILE",
        help="where to write the predictions: .npy or .csv (overwritten)",
    )
    parser.add_argument(
        "--argmax", action="store_true",
        help="write class labels: argmax over the last axis, on the device (only labels cross)",
    )
    parser.add_argument(
        "--batch-size", type=_int_at_least(1), default=None, metavar="N",
        help="largest batch to run (default: 32, as model.predict); lowered when it does not fit",
    )
    parser.add_argument(
        "--scale", type=_scale, default=None, metavar="S",
        help=(
            "divide the inputs by S (as float) before predicting, e.g. 255 for "
            "pixels, as the Kaggle notebooks do; 'none' feeds them as stored "
            "(default: 255 for .csv, none for .npy/.npz)"
        ),
    )
    parser.add_argument(
        "--memory-limit", type=_int_at_least(1), default=None, metavar="MB",
        help=(
            "simulate a device with MB MiB of memory, as the demo does: a capped "
            "CPU allocator, or a GPU logical device (default: no limit)"
        ),
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="print nothing unless it fails",
    )
    parser.set_defaults(handler=_run_predict)


def _scale(text: str) -> "float | str":
    """An argparse `type` for --scale: a positive number or 'none'."""
    if text.strip().lower() == "none":
        return "none"
    try:
        if 0 < (value := float(text)) < float("inf"):
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {text!r}")


def _run_predict(args: argparse.Namespace) -> int:
    import time

    start = time.perf_counter()
    model_path = os.path.abspath(args.model)
    input_path = os.path.abspath(args.input)
    out_path = os.path.abspath(args.out)
    input_kind = _extension(input_path, inputs.INPUT_KINDS, "INPUT")
    out_kind = _extension(out_path, outputs.OUTPUT_KINDS, "--out")
    models.check_model_file(model_path, args.model)
    if not os.path.isfile(input_path):
        raise PredictError(f"cannot read {args.input}: no such file")
    worker.check_writable(out_path)
    for other in (model_path, input_path):
        if os.path.exists(out_path) and os.path.samefile(out_path, other):
            raise UsageError(f"--out {out_path} would overwrite an input file")
    # Bad files fail here, before TensorFlow starts.
    inputs.open_input(input_path, header_only=True)

    if args.scale is None:
        scale = inputs.CSV_SCALE if input_kind == ".csv" else None
    else:
        scale = None if args.scale == "none" else float(args.scale)
    limit = args.memory_limit
    device = "gpu" if env.gpu_visible() else "cpu"
    config = dict(
        model=model_path, input=input_path, out=out_path, out_kind=out_kind,
        argmax=bool(args.argmax), batch_size=args.batch_size, scale=scale,
        device=device, memory_limit_mb=limit,
    )
    segv_hint = (
        "TensorFlow crashes instead of raising when the capped CPU allocator cannot "
        f"hold what it must (the model's weights, one sample): try a --memory-limit above {limit}"
        if device == "cpu" and limit is not None else None
    )
    say = (lambda line: None) if args.quiet else worker.stdout_reporter
    result = worker.run_worker(
        "keras_memfit.app.predict_file:predict_work", config, report=say,
        what="the prediction process", segv_hint=segv_hint,
    )
    for line in _predict_summary(result, args, time.perf_counter() - start):
        say(line)
    return 0


def _extension(path: str, allowed: Sequence[str], what: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in allowed:
        raise UsageError(
            f"{what} must be a {', '.join(allowed[:-1])} or {allowed[-1]} file; "
            f"received {os.path.basename(path)!r}"
        )
    return ext


def _predict_summary(result: Dict[str, Any], args: argparse.Namespace, seconds: float) -> List[str]:
    """The few lines `keras-memfit predict` prints when it is done."""
    scale = f" (scaled by 1/{result['scale']:g})" if result["scale"] else ""
    limit = result["memory_limit_mb"]
    where = result["device"] + (f", memory limited to {limit} MiB" if limit else "")
    ooms = result["ooms_paid"]
    used = f"{result['batch_size_used']} used" if result["adapted"] else "nothing adapted"
    lines = [
        f"keras-memfit predict: {result['samples']} samples of {result['input']}{scale} "
        f"through model '{result['model']}' on {where}",
        f"  batch size: {result['batch_size']} asked, {used} "
        f"(batches run: {result['batch_sizes']}); {ooms} OOM{'' if ooms == 1 else 's'} paid",
    ]
    adaptations = result["adaptations"]
    lines += [f"  adapted: {message}" for message in adaptations[:_MAX_ADAPTATIONS_SHOWN]]
    if len(adaptations) > _MAX_ADAPTATIONS_SHOWN:
        lines.append(f"  adapted: ... and {len(adaptations) - _MAX_ADAPTATIONS_SHOWN} more")
    if result["out_kind"] == ".csv":
        what = "ImageId,Label" if result["argmax"] else "ImageId,p0..pK"
        what = f"{what}; {result['samples']} rows"
    else:
        kind = "labels" if result["argmax"] else "outputs"
        what = f"{kind} {result['dtype']} {tuple(result['shape'])}"
    lines.append(
        f"  wrote {args.out} ({what}) in {seconds:.1f} s "
        f"(predict {result['predict_seconds']:.1f} s)"
    )
    return lines


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------
_MIB = 1 << 20


def _add_report(subparsers: "argparse._SubParsersAction[_Parser]") -> None:
    parser = subparsers.add_parser(
        "report",
        help="print the memory report of a saved model at a batch size",
        description=(
            "Load a saved Keras model (keras.saving.load_model) and print "
            "keras_memfit.memory_report(model, batch_size=N): per layer, the "
            "weights, optimizer slots and activations it holds in memory, and the "
            "total peak; with --budget, the largest batch size that fits. "
            "Training memory by default (weights, gradients, optimizer slots, "
            "activations kept for the backward pass); --inference for predict."
        ),
        epilog="Example: keras-memfit report model.keras --batch-size 512 --budget 15000",
    )
    parser.add_argument("model", metavar="MODEL", help="saved model (.keras or .h5)")
    parser.add_argument(
        "--batch-size", type=_int_at_least(1), default=32, metavar="N",
        help="batch size to size the activations for (default: %(default)s)",
    )
    parser.add_argument(
        "--inference", action="store_true",
        help="report inference memory (no gradients, no optimizer slots)",
    )
    parser.add_argument(
        "--budget", type=_int_at_least(1), default=None, metavar="MB",
        help="device memory in MiB to compare the peak against (default: none)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON object",
    )
    parser.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    model_path = os.path.abspath(args.model)
    models.check_model_file(model_path, args.model)  # before TensorFlow starts
    config = dict(
        model=model_path, batch_size=args.batch_size, training=not args.inference,
        budget=None if args.budget is None else args.budget * _MIB,
        # The report needs no device memory: run where TensorFlow would, unlimited.
        device="gpu" if env.gpu_visible() else "cpu", memory_limit_mb=None,
    )
    result = worker.run_worker(
        "keras_memfit.app.cli:_report_work", config, report=lambda line: None,
        what="the report process",
    )
    if args.json:
        print(json.dumps(result["report"], indent=2, sort_keys=True), flush=True)
    else:
        print(result["table"].rstrip("\n"), flush=True)
    return 0


def _report_work(config: Dict[str, Any], say: Callable[[str], None]) -> Dict[str, Any]:
    """`keras-memfit report`'s work in the child process (imports TensorFlow).

    Returns:
        `{"table": the report's summary text, "report": its to_dict(), JSON-safe}`.

    Raises:
        PredictError: If the model does not load or cannot be reported on.
    """
    import keras_memfit

    # Training memory needs the optimizer the model was saved with; a model
    # whose compile configuration will not load is still reported, without.
    try:
        model = models.load_model(config["model"], None, compile=config["training"])
    except PredictError:
        if not config["training"]:
            raise
        model = models.load_model(config["model"], None, compile=False)
    try:
        report = keras_memfit.memory_report(
            model, batch_size=config["batch_size"], training=config["training"],
            budget=config["budget"],
        )
    except ValueError as err:  # a model the report cannot size (e.g. no input shape)
        raise PredictError(
            f"cannot report on model '{model.name}': {one_line(err)}"
        ) from err
    safe = json.loads(json.dumps(report.to_dict(), default=_jsonable))
    return dict(table=str(report), report=safe)


def _jsonable(value: Any) -> Any:
    """`json.dumps`'s fallback: numpy scalars and arrays, tuples of shapes, the rest as text."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The `keras-memfit` parser with every subcommand; its errors raise `UsageError`."""
    parser = _Parser(
        prog=PROG,
        description="keras_memfit: Keras without GPU out-of-memory errors.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subparsers)
    _add_predict(subparsers)
    _add_report(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the `keras-memfit` command line.

    Args:
        argv: Arguments without the program name; default `sys.argv[1:]`.

    Returns:
        The exit status: 0 on success, 1 if the command failed, 2 for bad
        arguments, 130 if interrupted.
    """
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help exits through here (errors raise UsageError)
            return int(exit_.code or 0)
        return int(args.handler(args))
    except UsageError as err:
        _error(str(err))
        return 2
    except (WorkerError, ValueError, OSError) as err:
        _error(str(err) or type(err).__name__)
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _error(message: str) -> None:
    line = " ".join(message.split())  # exactly one line
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
