"""`keras-memfit predict`'s work in the child process: safe_predict over a file."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

import keras
import numpy as np

import keras_memfit
from keras_memfit._internal import batches
from keras_memfit.app import records
from keras_memfit.app.errors import PredictError, one_line
from keras_memfit.app.inputs import arrange_inputs, open_input
from keras_memfit.app.models import load_model
from keras_memfit.app.outputs import temporary_path, write_csv, writing
from keras_memfit.backend import get as backend
from keras_memfit.planning import data


def predict_work(config: Dict[str, Any], say: Callable[[str], None]) -> Dict[str, Any]:
    """`keras-memfit predict`'s work (imports TensorFlow): what the CLI's summary needs.

    Raises:
        PredictError: For anything wrong with the model, the input or the output.
        keras_memfit.OutOfMemoryError: If even one sample does not fit.
    """
    model = load_model(config["model"], config["memory_limit_mb"])
    source = open_input(config["input"])
    x, specs, n = arrange_inputs(model, source)
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
    logged = records.LogRecords(None)
    batch_size = config["batch_size"] or data.DEFAULT_BATCH_SIZE
    with writing(out_path):
        temporary = temporary_path(out_path)
    try:
        # A memory-mapped .npy: it becomes --out .npy, or is read back a chunk at a time.
        with writing(out_path):
            target = np.lib.format.open_memmap(
                temporary + ".npy", mode="w+", dtype=row.dtype, shape=shape
            )
        kwargs = dict(
            postprocess=postprocess, out=keras.tree.pack_sequence_as(sample, [target]),
            verbose=0, callbacks=[records.batch_sizes(sizes)],
        )
        t = time.perf_counter()
        with logged.capture():
            if prepare is None:
                keras_memfit.safe_predict(model, x, batch_size=batch_size, **kwargs)
            else:
                prepared = _prepared_batches(x, n, batch_size, prepare)
                keras_memfit.safe_predict(model, prepared, max_batch_size=batch_size, **kwargs)
        predict_seconds = time.perf_counter() - t
        if sum(sizes) != n:
            raise PredictError(f"predicted {sum(sizes)} of {n} samples")
        with writing(out_path):
            target.flush()
            if out_kind == ".csv":
                write_csv(temporary + ".csv", target, config["argmax"])
            del target, kwargs
            os.replace(temporary + out_kind, out_path)
    finally:
        for suffix in (".npy", ".csv"):
            if os.path.exists(temporary + suffix):
                os.remove(temporary + suffix)

    keras_sizes = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    return dict(
        model=model.name, samples=n, input=os.path.basename(config["input"]),
        scale=scale, out_kind=out_kind,
        argmax=bool(config["argmax"]), shape=list(shape), dtype=str(row.dtype),
        device="GPU" if backend().list_accelerators() else "CPU",
        memory_limit_mb=config["memory_limit_mb"], batch_size=batch_size,
        batch_size_used=records.usual_size(sizes), batch_sizes=records.describe_sizes(sizes),
        adapted=sizes != keras_sizes,
        ooms_paid=logged.warnings, adaptations=logged.messages,
        predict_seconds=predict_seconds,
    )


def _argmax_labels(outputs: Any) -> Any:
    """--argmax's `postprocess`: labels on the device (a single output may be nested)."""
    return keras.tree.map_structure(lambda y: keras.ops.argmax(y, axis=-1), outputs)


def _one_output_row(
    model: Any, x: Any, prepare: Optional[Callable], postprocess: Optional[Callable]
) -> Any:
    """The first sample's outputs, as numpy; `predict_on_batch` keeps the planner's memory clean."""
    first = batches.rows(x, 0, 1)
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
    for begin in range(0, n, batch_size):
        # A 1-tuple: Keras reads a 2- or 3-tuple (or list) as (x, y[, weights]).
        yield (prepare(batches.rows(x, begin, min(n, begin + batch_size))),)
