"""The `keras-memfit` command line (also `python -m keras_memfit`).

Subcommands:
    demo: The Digit Recognizer demo: plain `model.predict` dies of OOM,
        `keras_memfit.safe_predict` recovers and writes `submission.csv`.
    predict: `safe_predict` a saved model over a `.npy`, `.npz` or Kaggle
        `.csv` file, streaming the outputs to a `.npy` or `.csv` file.

Each subcommand is one `_add_<name>(subparsers)` function that declares its
options and sets `handler`, a function taking the parsed arguments and
returning the exit status; `report` will be added the same way.
The parser only reads constants from the subcommands' modules; their work
(and TensorFlow, where they need it) is imported when the subcommand runs.
Work that needs TensorFlow runs in a child process (`keras_memfit._child`),
so that a memory limit can be set before TensorFlow starts and TensorFlow's
log output and crashes never reach the terminal as more than one line.

Errors are one line on stderr (`keras-memfit: error: ...`) and a non-zero exit
status: 2 for bad arguments, 1 for failures, 130 for Ctrl-C; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from keras_memfit._child import WorkerError  # standard library only: no TensorFlow

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
# predict
# --------------------------------------------------------------------------
_INPUT_KINDS = (".npy", ".npz", ".csv")
_OUTPUT_KINDS = (".npy", ".csv")
_CSV_SCALE = 255.0  # what the Kaggle notebooks divide pixels by
_PIXELS = 784  # pixel0..pixel783 in Kaggle's Digit Recognizer CSVs
_CSV_CHUNK_ROWS = 8192  # rows formatted at once when writing a CSV
_MAX_ADAPTATIONS_SHOWN = 4


class PredictError(WorkerError):
    """`keras-memfit predict` cannot go on; the message is the one line shown.

    Raised in the parent (a bad file caught before TensorFlow starts) or in
    the child process, whose `WorkerError`s reach the parent unchanged.
    """


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
        help=(
            "write class labels: argmax over the last axis, computed on the device "
            "so only labels cross to the host"
        ),
    )
    parser.add_argument(
        "--batch-size", type=_int_at_least(1), default=None, metavar="N",
        help=(
            "largest batch to run (default: 32, as model.predict); lowered "
            "automatically when it does not fit"
        ),
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
        value = float(text)
    except ValueError:
        value = None
    if value is None or not (value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {text!r}")
    return value


def _run_predict(args: argparse.Namespace) -> int:
    import time

    from keras_memfit import _child

    start = time.perf_counter()
    model_path = os.path.abspath(args.model)
    input_path = os.path.abspath(args.input)
    out_path = os.path.abspath(args.out)
    input_kind = _extension(input_path, _INPUT_KINDS, "INPUT")
    out_kind = _extension(out_path, _OUTPUT_KINDS, "--out")
    _check_model_file(model_path, args.model)
    if not os.path.isfile(input_path):
        raise _Failure(f"cannot read {args.input}: no such file")
    _check_output(out_path, (model_path, input_path))
    _open_input(input_path, header_only=True)  # bad files fail here, before TensorFlow starts

    if args.scale is None:
        scale = _CSV_SCALE if input_kind == ".csv" else None
    else:
        scale = None if args.scale == "none" else float(args.scale)
    limit = args.memory_limit
    device = "gpu" if _child.gpu_visible() else "cpu"
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
    say = (lambda line: None) if args.quiet else _child.stdout_reporter
    try:
        result = _child.run_worker(
            "keras_memfit.cli:_predict_work", config, report=say,
            what="the prediction process", segv_hint=segv_hint,
        )
    except _child.WorkerError as err:
        raise _Failure(str(err)) from err
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


def _check_model_file(path: str, shown: str) -> None:
    import zipfile

    if os.path.isdir(path):
        raise _Failure(
            f"cannot load model {shown}: it is a folder (a SavedModel?); keras-memfit "
            "predict loads .keras and .h5 files with keras.saving.load_model"
        )
    if not os.path.isfile(path):
        raise _Failure(f"cannot load model {shown}: no such file")
    if path.lower().endswith(".keras") and not zipfile.is_zipfile(path):
        raise _Failure(f"cannot load model {shown}: not a .keras file (not a zip archive)")


def _check_output(path: str, inputs: Sequence[str]) -> None:
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise _Failure(f"cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise _Failure(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise _Failure(f"cannot write {path}: folder {folder} is not writable")
    for other in inputs:
        if os.path.exists(path) and os.path.samefile(path, other):
            raise UsageError(f"--out {path} would overwrite an input file")


class _Input:
    """An input file's arrays, opened without reading what need not be read.

    Attributes:
        path: The file.
        kind: ".npy", ".npz" or ".csv".
        arrays: Name -> array ("" for the single array of a .npy or .csv; a
            read-only memmap for .npy, uint8 [n, 784] for .csv; a .npz's
            arrays are read when first asked for); empty when opened with
            `header_only`.
        names: Array names in file order.
    """

    def __init__(self, path: str, kind: str, arrays: Any, names: List[str]) -> None:
        self.path = path
        self.kind = kind
        self.arrays = arrays
        self.names = names


def _open_input(path: str, header_only: bool = False) -> _Input:
    """Open INPUT (numpy only, no TensorFlow).

    Args:
        path: A .npy, .npz or .csv file.
        header_only: Only check that the file is readable and well formed as
            far as that is cheap (the .npy header, the .npz directory, the
            CSV header); `arrays` is then empty.

    Returns:
        An `_Input`.

    Raises:
        PredictError: If the file cannot be read or is not in the format
            its extension says.
    """
    import zipfile

    import numpy as np

    kind = os.path.splitext(path)[1].lower()
    name = os.path.basename(path)
    try:
        if kind == ".npy":
            with open(path, "rb") as f:
                if f.read(6) != b"\x93NUMPY":
                    raise ValueError("not a .npy file (no NUMPY header)")
            array = np.load(path, mmap_mode="r")  # reads the header; data on demand
            if not isinstance(array, np.ndarray):
                raise ValueError("it holds no array")
            _check_samples(array, name)
            return _Input(path, kind, {} if header_only else {"": array}, [""])
        if kind == ".npz":
            if not zipfile.is_zipfile(path):
                raise ValueError("not a zip archive")
            archive = np.load(path)  # members are read (whole) when asked for
            names = list(archive.files)
            if not names:
                archive.close()
                raise ValueError("it holds no arrays")
            if header_only:
                archive.close()
                return _Input(path, kind, {}, names)
            return _Input(path, kind, _NpzArrays(archive, name), names)
        return _open_csv(path, name, header_only)
    except PredictError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise PredictError(f"cannot read {name} as {kind}: {detail}") from err


class _NpzArrays:
    """The arrays of an open .npz file, each read and checked when first asked for.

    (.npz members cannot be memory-mapped: each is read into memory whole.)
    """

    def __init__(self, archive: Any, name: str) -> None:
        self._archive = archive
        self._name = name

    def __contains__(self, key: str) -> bool:
        return key in self._archive.files

    def __getitem__(self, key: str) -> Any:
        import zipfile

        label = f"{self._name}[{key!r}]"
        try:
            array = self._archive[key]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise PredictError(f"cannot read {label}: {_one_line(err)}") from err
        _check_samples(array, label)
        return array


def _check_samples(array: Any, label: str) -> None:
    if array.ndim == 0:
        raise PredictError(f"{label} is a scalar; expected one row per sample")
    if array.dtype.hasobject:
        raise PredictError(f"{label} holds Python objects; expected numbers")
    if array.shape[0] == 0:
        raise PredictError(f"{label} holds no samples")


def _open_csv(path: str, name: str, header_only: bool) -> _Input:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        header = f.readline().strip().split(",")
    pixels = [f"pixel{i}" for i in range(_PIXELS)]
    if header not in (pixels, ["label"] + pixels):
        missing = [c for c in pixels if c not in header]
        shown = ",".join(header[:3]) + (",..." if len(header) > 3 else "")
        detail = f"{len(missing)} pixel columns missing" if missing else f"header starts {shown!r}"
        raise PredictError(
            f"{name} is not a Kaggle Digit Recognizer CSV ({detail}); expected the "
            "header 'pixel0,...,pixel783', optionally after a 'label' column"
        )
    if header_only:
        return _Input(path, ".csv", {}, [""])
    from keras_memfit import digits

    try:
        images, _ = digits.load_kaggle_csv(path)
    except ValueError as err:
        raise PredictError(" ".join(str(err).split())) from err
    _check_samples(images, name)
    return _Input(path, ".csv", {"": images.reshape(len(images), _PIXELS)}, [""])


def _model_inputs(model: Any) -> Any:
    """The structure of KerasTensors the model takes, or None if it declares none."""
    try:
        struct = model.input  # Functional: the structure it was built with
    except (AttributeError, ValueError):
        struct = None
    if struct is None:
        inputs = getattr(model, "inputs", None)  # Sequential
        if not inputs:
            return None
        struct = inputs[0] if len(inputs) == 1 else list(inputs)
    return struct


def _arrange_inputs(model: Any, source: _Input) -> Tuple[Any, Any, int]:
    """Map the file's arrays onto the model's inputs.

    Returns:
        `(x, specs, n)`: arrays in the structure of the model's inputs
        (reshaped to its input shapes), the matching KerasTensors (None when
        the model declares no inputs), and the number of samples.
    """
    import keras

    name = os.path.basename(source.path)
    struct = _model_inputs(model)
    if struct is None:  # a subclassed model: feed the file as it is
        if source.kind == ".csv":
            raise PredictError(
                f"model '{model.name}' does not declare its input shape, so the CSV's "
                "pixels cannot be reshaped for it; save them as a .npy of the shape it takes"
            )
        if len(source.names) != 1:
            raise PredictError(
                f"{name} holds {len(source.names)} arrays {source.names}, and model "
                f"'{model.name}' does not declare its inputs; give it one array"
            )
        x = source.arrays[source.names[0]]
        return x, None, int(x.shape[0])

    if isinstance(struct, dict):
        keys = list(struct)
        specs = [struct[k] for k in keys]
        names = [[k, getattr(t, "name", k)] for k, t in zip(keys, specs)]
    else:
        specs = keras.tree.flatten(struct)
        names = [[getattr(t, "name", f"input_{i}")] for i, t in enumerate(specs)]
    shown = [n[0] for n in names]
    if source.kind == ".npz":
        chosen = []
        for aliases in names:
            found = next((a for a in aliases if a in source.arrays), None)
            chosen.append(found)
        if None in chosen:
            if len(specs) == 1 and len(source.names) == 1:
                chosen = [source.names[0]]
            elif len(specs) == 1:
                raise PredictError(
                    f"{name} holds {len(source.names)} arrays {source.names}, but model "
                    f"'{model.name}' takes one input, named {shown[0]!r}: save one array, "
                    "or name the one to use after the input"
                )
            else:
                missing = [n[0] for n, c in zip(names, chosen) if c is None]
                raise PredictError(
                    f"{name} holds arrays {source.names}, but model '{model.name}' takes "
                    f"inputs named {shown} (no array for {missing}): save one array per "
                    "input, named after it: np.savez(path, **{input_name: array})"
                )
        arrays = [source.arrays[c] for c in chosen]
    else:
        if len(specs) != 1:
            raise PredictError(
                f"model '{model.name}' takes {len(specs)} inputs {shown}; a {source.kind} "
                "file holds one array: give a .npz with one array named after each input"
            )
        arrays = [source.arrays[""]]
    fitted = [
        _fit_shape(a, spec, label, name)
        for a, spec, label in zip(arrays, specs, shown)
    ]
    counts = sorted({int(a.shape[0]) for a in fitted})
    if len(counts) > 1:
        raise PredictError(
            f"{name}: the model's inputs must have the same number of samples; "
            f"received {counts}"
        )
    if isinstance(struct, dict):
        x = dict(zip(keys, fitted))
        spec_struct = dict(zip(keys, specs))
    else:
        x = keras.tree.pack_sequence_as(struct, fitted)
        spec_struct = struct
    return x, spec_struct, counts[0]


def _fit_shape(array: Any, spec: Any, label: str, name: str) -> Any:
    """`array` reshaped (a view) to the input's shape, or a PredictError."""
    import math

    have = tuple(int(d) for d in array.shape[1:])
    want = tuple(spec.shape[1:])
    if len(want) == len(have) and all(w is None or w == h for w, h in zip(want, have)):
        return array
    if None not in want and math.prod(have) == math.prod(want):
        squeezed = lambda dims: tuple(d for d in dims if d != 1)  # noqa: E731
        # Rows of flat values (Kaggle's pixel0..pixel783), or the same dims
        # up to axes of size one ((28, 28) for (28, 28, 1)); never a
        # transposition such as (3, 28, 28) for (28, 28, 3).
        if len(have) == 1 or squeezed(have) == squeezed(want):
            return array.reshape((array.shape[0],) + want)
    raise PredictError(
        f"{name} has samples of shape {have}, but the model's input '{label}' takes "
        f"samples of shape {tuple(want)}"
    )


def _predict_work(config: Dict[str, Any], say: Callable[[str], None]) -> Dict[str, Any]:
    """The child process's work for `keras-memfit predict` (imports TensorFlow).

    Args:
        config: From `_run_predict`: model, input, out, out_kind, argmax,
            batch_size, scale, device, memory_limit_mb.
        say: Prints a line (unused: the parent prints the summary).

    Returns:
        What the summary needs (see `_predict_summary`).

    Raises:
        PredictError: With one line, for anything wrong with the model, the
            input or the output.
        keras_memfit.OutOfMemoryError: If even one sample does not fit.
    """
    import time

    start = time.perf_counter()
    import keras
    import numpy as np

    import keras_memfit
    from keras_memfit import _child, data

    model = _load_model(config["model"], config["memory_limit_mb"])
    source = _open_input(config["input"])
    x, specs, n = _arrange_inputs(model, source)
    scale = config["scale"]
    prepare = None if scale is None else _scaler(x, specs, scale)
    postprocess = _argmax_labels if config["argmax"] else None
    sample = _one_output_row(model, x, prepare, postprocess)
    row = keras.tree.flatten(sample)[0]
    shape = (n,) + row.shape[1:]
    out_kind, out_path = config["out_kind"], config["out"]
    if out_kind == ".csv" and config["argmax"] and len(shape) != 1:
        raise PredictError(
            f"--argmax gives labels of shape {shape[1:]} per sample; ImageId,Label "
            "needs one label per sample (write a .npy instead)"
        )

    sizes: List[int] = []

    class _BatchSizes(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            # Keras flattens nested logs ({"outputs": {"probs": a}} -> {"probs": a})
            # and turns one-element arrays into floats: a scalar is one row.
            value = next(iter((logs or {}).values()), None)
            sizes.append(int(value.shape[0]) if getattr(value, "ndim", 0) else 1)

    records = _child.LogRecords(None)
    batch_size = config["batch_size"] or data.DEFAULT_BATCH_SIZE
    with _writing(out_path):
        temporary = _temporary_path(out_path)
    try:
        # The outputs go straight into a memory-mapped .npy: for --out .npy it
        # becomes the output; for .csv it is read back a chunk at a time.
        with _writing(out_path):
            target = np.lib.format.open_memmap(
                temporary + ".npy", mode="w+", dtype=row.dtype, shape=shape
            )
        kwargs = dict(
            postprocess=postprocess, out=keras.tree.pack_sequence_as(sample, [target]),
            verbose=0, callbacks=[_BatchSizes()],
        )
        t = time.perf_counter()
        with records.capture():
            if prepare is None:
                keras_memfit.safe_predict(model, x, batch_size=batch_size, **kwargs)
            else:
                batches = _prepared_batches(x, n, batch_size, prepare)
                keras_memfit.safe_predict(model, batches, max_batch_size=batch_size, **kwargs)
        predict_seconds = time.perf_counter() - t
        if sum(sizes) != n:
            raise PredictError(f"predicted {sum(sizes)} of {n} samples")
        with _writing(out_path):
            target.flush()
            if out_kind == ".csv":
                _write_csv(temporary + ".csv", target, config["argmax"])
            del target, kwargs
            os.replace(temporary + out_kind, out_path)
    finally:
        for suffix in (".npy", ".csv"):
            if os.path.exists(temporary + suffix):
                os.remove(temporary + suffix)

    import tensorflow as tf

    used = max(sorted(set(sizes), reverse=True), key=sizes.count) if sizes else 0
    return dict(
        model=model.name, samples=n, input=os.path.basename(config["input"]),
        input_kind=source.kind, scale=scale, out=out_path, out_kind=out_kind,
        argmax=bool(config["argmax"]), shape=list(shape), dtype=str(row.dtype),
        device="GPU" if tf.config.list_logical_devices("GPU") else "CPU",
        memory_limit_mb=config["memory_limit_mb"], batch_size=batch_size,
        batch_size_used=used, batches=len(sizes), batch_sizes=_child.describe_sizes(sizes),
        ooms_paid=records.warnings, adaptations=records.messages,
        predict_seconds=predict_seconds, worker_seconds=time.perf_counter() - start,
    )


def _argmax_labels(outputs: Any) -> Any:
    """--argmax's `postprocess`: labels on the device (a single output may be nested)."""
    import keras

    return keras.tree.map_structure(lambda y: keras.ops.argmax(y, axis=-1), outputs)


def _load_model(path: str, memory_limit_mb: Optional[int]) -> Any:
    """`keras.saving.load_model(path)`, or a PredictError saying why not."""
    import keras

    from keras_memfit import is_oom_error

    name = os.path.basename(path)
    try:
        model = keras.saving.load_model(path, compile=False)  # predicting needs no optimizer
    except Exception as err:  # any way a model file can fail to load
        hint = ""
        if memory_limit_mb is not None and is_oom_error(err):
            hint = f" (it does not fit in {memory_limit_mb} MiB)"
        raise PredictError(f"cannot load model {name}{hint}: {_one_line(err)}") from err
    if not isinstance(model, keras.Model):
        raise PredictError(f"{name} holds a {type(model).__name__}, not a Keras model")
    return model


def _one_output_row(
    model: Any, x: Any, prepare: Optional[Callable], postprocess: Optional[Callable]
) -> Any:
    """The (post-processed) outputs for the first sample, as numpy: their shape and dtype.

    Found with `model.predict_on_batch`, not `safe_predict`, so that the
    planner's memory of this model and input signature starts clean.
    """
    import keras
    import numpy as np

    from keras_memfit import data

    first = data.rows(x, 0, 1)
    if prepare is not None:
        first = prepare(first)
    try:
        sample = model.predict_on_batch(first)
    except Exception as err:
        raise PredictError(f"model '{model.name}' cannot take this input: {_one_line(err)}") from err
    leaves = keras.tree.flatten(sample)
    if len(leaves) != 1:
        raise PredictError(
            f"model '{model.name}' has {len(leaves)} outputs; keras-memfit predict "
            "writes one array (use safe_predict from Python for several)"
        )
    row = np.asarray(leaves[0])
    if row.ndim == 0 or row.shape[0] != 1:
        raise PredictError(
            f"model '{model.name}' does not keep the batch dimension: one sample gave "
            f"shape {row.shape}"
        )
    if postprocess is None:
        return keras.tree.map_structure(np.asarray, sample)
    if row.ndim < 2:
        raise PredictError(
            f"--argmax needs outputs with a class axis; model '{model.name}' gives "
            "one value per sample"
        )
    return keras.tree.map_structure(keras.ops.convert_to_numpy, postprocess(sample))


def _scaler(x: Any, specs: Any, scale: float) -> Callable[[Any], Any]:
    """A function dividing a batch of `x` by `scale`, as the float type its input takes."""
    import keras
    import numpy as np

    def float_type(spec: Any) -> Any:
        try:
            dtype = np.dtype(getattr(spec, "dtype", None) or "float32")
        except TypeError:  # bfloat16 and other types numpy does not know
            return np.float32
        return dtype.type if dtype.kind == "f" else np.float32

    types = keras.tree.map_structure(float_type, specs if specs is not None else x)

    def prepare(piece: Any) -> Any:
        return keras.tree.map_structure(
            lambda a, kind: np.asarray(a).astype(kind) / kind(scale), piece, types
        )

    return prepare


def _prepared_batches(x: Any, n: int, batch_size: int, prepare: Callable) -> Any:
    """Batches of `x`, each passed through `prepare` (host memory: one batch)."""
    from keras_memfit import data

    for begin in range(0, n, batch_size):
        # A 1-tuple: Keras reads a 2- or 3-tuple (or list) as (x, y[, weights]).
        yield (prepare(data.rows(x, begin, min(n, begin + batch_size))),)


class _writing:
    """Turns an OSError while writing `path` into a one-line PredictError."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, traceback: Any) -> None:
        if isinstance(err, OSError):
            raise PredictError(f"cannot write {self.path}: {_one_line(err)}") from err


def _temporary_path(out_path: str) -> str:
    """A fresh path prefix next to the output, so the final rename is atomic."""
    import tempfile

    folder, base = os.path.split(out_path)
    handle, path = tempfile.mkstemp(prefix=f".{base}.", suffix=".partial", dir=folder)
    os.close(handle)
    os.remove(path)
    return path


def _write_csv(path: str, values: Any, argmax: bool) -> None:
    """Write `ImageId,Label` or `ImageId,p0..pK` rows, a chunk at a time.

    Args:
        path: The CSV to write.
        values: Labels [n] (argmax) or outputs [n, ...] (flattened per row
            into p0..pK); a memmap is read a chunk at a time.
        argmax: Whether `values` are labels.
    """
    import numpy as np

    n = int(values.shape[0])
    width = int(np.prod(values.shape[1:], dtype=np.int64)) if values.ndim > 1 else 1
    if values.dtype.kind == "f":
        # Enough digits for the value to read back exactly.
        fmt = "%.17g" if values.dtype.itemsize > 4 else "%.9g"
    else:
        fmt = "%d"
    header = "ImageId,Label" if argmax else "ImageId," + ",".join(f"p{i}" for i in range(width))
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(header + "\n")
        for begin in range(0, n, _CSV_CHUNK_ROWS):
            stop = min(n, begin + _CSV_CHUNK_ROWS)
            block = np.asarray(values[begin:stop]).reshape(stop - begin, width).tolist()
            f.write("".join(
                f"{i}," + ",".join(fmt % v for v in row) + "\n"
                for i, row in zip(range(begin + 1, stop + 1), block)
            ))


def _predict_summary(result: Dict[str, Any], args: argparse.Namespace, seconds: float) -> List[str]:
    """The few lines `keras-memfit predict` prints when it is done."""
    scale = f" (scaled by 1/{result['scale']:g})" if result["scale"] else ""
    limit = result["memory_limit_mb"]
    where = result["device"] + (f", memory limited to {limit} MiB" if limit else "")
    ooms = result["ooms_paid"]
    lines = [
        f"keras-memfit predict: {result['samples']} samples of {result['input']}{scale} "
        f"through model '{result['model']}' on {where}",
        f"  batch size: {result['batch_size']} asked, {result['batch_size_used']} used "
        f"(batches run: {result['batch_sizes']}); {ooms} OOM{'' if ooms == 1 else 's'} paid",
    ]
    adaptations = result["adaptations"]
    for message in adaptations[:_MAX_ADAPTATIONS_SHOWN]:
        lines.append(f"  adapted: {message}")
    if len(adaptations) > _MAX_ADAPTATIONS_SHOWN:
        lines.append(f"  adapted: ... and {len(adaptations) - _MAX_ADAPTATIONS_SHOWN} more")
    if result["out_kind"] == ".csv":
        what = "ImageId,Label" if result["argmax"] else "ImageId,p0..pK"
        what = f"{what}; {result['samples']} rows"
    else:
        what = f"{'labels' if result['argmax'] else 'outputs'} {result['dtype']} {tuple(result['shape'])}"
    lines.append(
        f"  wrote {args.out} ({what}) in {seconds:.1f} s "
        f"(predict {result['predict_seconds']:.1f} s)"
    )
    return lines


def _one_line(err: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters."""
    text = str(getattr(err, "message", None) or err).strip()
    line = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."


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
    _add_predict(subparsers)
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
    except (_Failure, WorkerError) as err:
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
