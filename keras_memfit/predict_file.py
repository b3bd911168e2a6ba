"""Predicting over files: what `keras-memfit predict` reads, runs and writes.

Split out of `keras_memfit.cli`, which keeps the parser and the subcommand
handlers. This module holds the file handling and the child process's work:

- reading INPUT: a `.npy` (memory-mapped), a `.npz` (one array, or one per
  model input named after it) or a Kaggle Digit Recognizer CSV
  (`pixel0..pixel783`, with or without `label`), mapped and reshaped onto the
  model's inputs;
- loading a saved model (`check_model_file` before TensorFlow starts,
  `load_model` in the child; `keras-memfit report` uses them too);
- `predict_work`, run in the child process by `keras_memfit._child`:
  `safe_predict` streaming into a memory-mapped `.npy`, then written out as
  `.npy` or `.csv` (`ImageId,Label` or `ImageId,p0..pK`) and renamed into place.

Everything here that can fail raises `PredictError` with the one line the
command line shows. The functions that need TensorFlow import it themselves,
so the parent can check files without starting it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from keras_memfit._child import WorkerError  # standard library only: no TensorFlow

__all__ = [
    "CSV_SCALE",
    "INPUT_KINDS",
    "OUTPUT_KINDS",
    "PredictError",
    "check_model_file",
    "load_model",
    "one_line",
    "open_input",
    "predict_work",
]

INPUT_KINDS = (".npy", ".npz", ".csv")
OUTPUT_KINDS = (".npy", ".csv")
CSV_SCALE = 255.0  # what the Kaggle notebooks divide pixels by
_PIXELS = 784  # pixel0..pixel783 in Kaggle's Digit Recognizer CSVs
_CSV_CHUNK_ROWS = 8192  # rows formatted at once when writing a CSV


class PredictError(WorkerError):
    """`keras-memfit predict` cannot go on; the message is the one line shown.

    Raised in the parent (a bad file caught before TensorFlow starts) or in
    the child process, whose `WorkerError`s reach the parent unchanged.
    """

def check_model_file(path: str, shown: str) -> None:
    """Check, before TensorFlow starts, that `path` can be a saved model.

    Args:
        path: The model file (absolute).
        shown: How to name it in the message (as the user typed it).

    Raises:
        PredictError: If it is a folder, missing, or a `.keras` file that is
            not a zip archive.

    Example:
        >>> check_model_file("/tmp/missing.keras", "missing.keras")
        Traceback (most recent call last):
        PredictError: cannot load model missing.keras: no such file
    """
    import zipfile

    if os.path.isdir(path):
        raise PredictError(
            f"cannot load model {shown}: it is a folder (a SavedModel?); keras-memfit "
            "loads .keras and .h5 files with keras.saving.load_model"
        )
    if not os.path.isfile(path):
        raise PredictError(f"cannot load model {shown}: no such file")
    if path.lower().endswith(".keras") and not zipfile.is_zipfile(path):
        raise PredictError(f"cannot load model {shown}: not a .keras file (not a zip archive)")

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


def open_input(path: str, header_only: bool = False) -> _Input:
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

    Example:
        >>> open_input("test.csv").arrays[""].shape
        (28000, 784)
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
            raise PredictError(f"cannot read {label}: {one_line(err)}") from err
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


def predict_work(config: Dict[str, Any], say: Callable[[str], None]) -> Dict[str, Any]:
    """The child process's work for `keras-memfit predict` (imports TensorFlow).

    Args:
        config: From the `predict` handler in `keras_memfit.cli`: model,
            input, out, out_kind, argmax, batch_size, scale, device,
            memory_limit_mb.
        say: Prints a line (unused: the parent prints the summary).

    Returns:
        What the summary `keras_memfit.cli` prints needs.

    Raises:
        PredictError: With one line, for anything wrong with the model, the
            input or the output.
        keras_memfit.OutOfMemoryError: If even one sample does not fit.

    Example:
        >>> _child.run_worker("keras_memfit.predict_file:predict_work", config)
        {'samples': 28000, 'batch_size_used': 4096, 'ooms_paid': 0, ...}
    """
    import keras
    import numpy as np

    import keras_memfit
    from keras_memfit import _child, data

    model = load_model(config["model"], config["memory_limit_mb"])
    source = open_input(config["input"])
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

    used = _child.usual_size(sizes)
    return dict(
        model=model.name, samples=n, input=os.path.basename(config["input"]),
        scale=scale, out_kind=out_kind,
        argmax=bool(config["argmax"]), shape=list(shape), dtype=str(row.dtype),
        device="GPU" if tf.config.list_logical_devices("GPU") else "CPU",
        memory_limit_mb=config["memory_limit_mb"], batch_size=batch_size,
        batch_size_used=used, batch_sizes=_child.describe_sizes(sizes),
        ooms_paid=records.warnings, adaptations=records.messages,
        predict_seconds=predict_seconds,
    )


def _argmax_labels(outputs: Any) -> Any:
    """--argmax's `postprocess`: labels on the device (a single output may be nested)."""
    import keras

    return keras.tree.map_structure(lambda y: keras.ops.argmax(y, axis=-1), outputs)


def load_model(path: str, memory_limit_mb: Optional[int], *, compile: bool = False) -> Any:
    """Load a saved Keras model, or say in one line why it cannot be loaded.

    Args:
        path: A `.keras` or `.h5` file.
        memory_limit_mb: The simulated device's limit in MiB, if any (named
            in the message when loading runs out of memory).
        compile: Whether to restore the optimizer and loss too (predicting
            needs neither).

    Returns:
        The `keras.Model`.

    Raises:
        PredictError: If the file does not load, or holds something that is
            not a Keras model.

    Example:
        >>> model = load_model("digits.keras", None)
    """
    import keras

    from keras_memfit import is_oom_error

    name = os.path.basename(path)
    try:
        model = keras.saving.load_model(path, compile=compile)
    except Exception as err:  # any way a model file can fail to load
        hint = ""
        if memory_limit_mb is not None and is_oom_error(err):
            hint = f" (it does not fit in {memory_limit_mb} MiB)"
        raise PredictError(f"cannot load model {name}{hint}: {one_line(err)}") from err
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
        raise PredictError(f"model '{model.name}' cannot take this input: {one_line(err)}") from err
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
            raise PredictError(f"cannot write {self.path}: {one_line(err)}") from err


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


def one_line(err: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters.

    Args:
        err: The exception.

    Returns:
        Its message's first line, whitespace collapsed; its type's name when
        it has no message.

    Example:
        >>> one_line(ValueError("bad\\nthings"))
        'bad'
    """
    text = str(getattr(err, "message", None) or err).strip()
    line = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."
