"""Reading `keras-memfit predict`'s INPUT and fitting it to the model's inputs.

`open_input` uses numpy only, so the parent checks a file before TensorFlow starts.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, List, NamedTuple, Tuple

from keras_memfit.app.errors import PredictError, one_line

INPUT_KINDS = (".npy", ".npz", ".csv")
CSV_SCALE = 255.0  # what the Kaggle notebooks divide pixels by
_PIXELS = 784  # pixel0..pixel783 in Kaggle's Digit Recognizer CSVs


class InputFile(NamedTuple):
    """An input file's arrays by name ("" for a .npy's or .csv's one), each read when needed."""

    path: str
    kind: str
    arrays: Any
    names: List[str]


def open_input(path: str, header_only: bool = False) -> InputFile:
    """Open a .npy, .npz or .csv INPUT, or raise `PredictError`; with `header_only`, no arrays."""
    import numpy as np

    kind = os.path.splitext(path)[1].lower()
    name = os.path.basename(path)
    try:
        if kind == ".npy":
            with open(path, "rb") as f:
                if f.read(6) != b"\x93NUMPY":
                    raise ValueError("not a .npy file (no NUMPY header)")
            array = np.load(path, mmap_mode="r")  # reads the header; data on demand
            _check_samples(array, name)
            return InputFile(path, kind, {} if header_only else {"": array}, [""])
        if kind == ".npz":
            if not zipfile.is_zipfile(path):
                raise ValueError("not a zip archive")
            archive = np.load(path)  # members are read (whole) when asked for
            names = list(archive.files)
            if header_only or not names:
                archive.close()
            if not names:
                raise ValueError("it holds no arrays")
            return InputFile(path, kind, {} if header_only else _NpzArrays(archive, name), names)
        return _open_csv(path, name, header_only)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise PredictError(f"cannot read {name} as {kind}: {detail}") from err


class _NpzArrays:
    """The arrays of an open .npz, each read (whole) and checked when first asked for."""

    def __init__(self, archive: Any, name: str) -> None:
        self._archive = archive
        self._name = name

    def __getitem__(self, key: str) -> Any:
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


def _open_csv(path: str, name: str, header_only: bool) -> InputFile:
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
        return InputFile(path, ".csv", {}, [""])
    from keras_memfit.app import digits

    try:
        images, _ = digits.load_kaggle_csv(path)
    except ValueError as err:
        raise PredictError(" ".join(str(err).split())) from err
    _check_samples(images, name)
    return InputFile(path, ".csv", {"": images.reshape(len(images), _PIXELS)}, [""])


def _model_inputs(model: Any) -> Any:
    """The structure of KerasTensors the model takes, or None if it declares none."""
    try:
        return model.input  # Functional: the structure it was built with
    except (AttributeError, ValueError):  # not called: Keras raises, never returns None
        pass
    inputs = getattr(model, "inputs", None)  # Sequential
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else list(inputs)


def arrange_inputs(model: Any, source: InputFile) -> Tuple[Any, Any, int]:
    """`(x, specs, n)`: the arrays reshaped onto the model's inputs (`specs` None if undeclared)."""
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
        specs = list(struct.values())
        names = [[k, getattr(t, "name", k)] for k, t in struct.items()]
    else:
        specs = keras.tree.flatten(struct)
        names = [[getattr(t, "name", f"input_{i}")] for i, t in enumerate(specs)]
    shown = [n[0] for n in names]
    if source.kind != ".npz" and len(specs) != 1:
        raise PredictError(
            f"model '{model.name}' takes {len(specs)} inputs {shown}; a {source.kind} "
            "file holds one array: give a .npz with one array named after each input"
        )
    # A .npy's or .csv's one array is named "": it goes to the model's one input.
    chosen = [next((a for a in aliases if a in source.names), None) for aliases in names]
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
    if isinstance(struct, dict):  # in its own key order, which keras.tree would sort
        x = dict(zip(struct, fitted))
    else:
        x = keras.tree.pack_sequence_as(struct, fitted)
    return x, struct, counts[0]


def _fit_shape(array: Any, spec: Any, label: str, name: str) -> Any:
    """`array` reshaped (a view) to the input's shape, or a PredictError."""
    import math

    have = tuple(int(d) for d in array.shape[1:])
    want = tuple(spec.shape[1:])
    if len(want) == len(have) and all(w is None or w == h for w, h in zip(want, have)):
        return array
    if None not in want and math.prod(have) == math.prod(want):
        squeezed = lambda dims: tuple(d for d in dims if d != 1)  # noqa: E731
        # Flat rows (Kaggle's pixels) or the same dims up to size-one axes; never a transposition.
        if len(have) == 1 or squeezed(have) == squeezed(want):
            return array.reshape((array.shape[0],) + want)
    raise PredictError(
        f"{name} has samples of shape {have}, but the model's input '{label}' takes "
        f"samples of shape {tuple(want)}"
    )
