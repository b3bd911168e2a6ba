"""Turning what `model.predict`/`evaluate` accept into chunks of rows.

A *chunk* is a structure (array, list, dict, or an `(x, y, sample_weight)`
tuple of those) whose leaves share a leading dimension. Array-like input is a
single chunk holding every sample, sliced into pieces of any size without a
copy; tf.data datasets, `keras.utils.PyDataset` objects and generators yield
one chunk per batch they produce, and each can still be split into smaller
pieces. Either way samples come out in input order, and every sample is in
exactly one piece.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Optional, Tuple

import keras
import numpy as np

from keras_memfit import _keras_compat

DEFAULT_BATCH_SIZE = 32  # what model.predict / model.evaluate use


class Chunks:
    """The input as chunks of rows.

    Attributes:
        chunks: Iterator over chunk structures.
        num_samples: Total number of samples when known in advance (arrays).
        from_arrays: Whether the input was array-like (a single chunk).
    """

    def __init__(self, chunks: Iterator[Any], num_samples: Optional[int], from_arrays: bool):
        self.chunks = chunks
        self.num_samples = num_samples
        self.from_arrays = from_arrays


def _is_array_leaf(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, np.ndarray) or keras.ops.is_tensor(value):
        return True
    return hasattr(value, "to_numpy") and hasattr(value, "shape")  # pandas


def is_array_like(x: Any) -> bool:
    """Whether `x` is an array, a tensor or a (nested) list/tuple/dict of them."""
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(_is_array_leaf(leaf) for leaf in leaves) and any(
        leaf is not None for leaf in leaves
    )


def _to_array(value: Any) -> Any:
    if value is None or isinstance(value, np.ndarray) or keras.ops.is_tensor(value):
        return value
    return value.to_numpy()


def num_rows(chunk: Any) -> int:
    """The leading dimension shared by the leaves of `chunk`."""
    for leaf in keras.tree.flatten(chunk):
        if leaf is not None:
            shape = getattr(leaf, "shape", None)
            if not shape:
                raise ValueError(
                    "every input must have a batch dimension; received a leaf of "
                    f"shape {shape!r} ({type(leaf).__name__})"
                )
            return int(shape[0])
    return 0


def rows(chunk: Any, start: int, stop: int) -> Any:
    """Rows `start:stop` of every leaf of `chunk` (views for numpy arrays)."""
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else leaf[start:stop], chunk
    )


def signature(x: Any) -> Tuple:
    """Shapes (without the batch dimension) and dtypes of the leaves of `x`."""
    return tuple(
        (tuple(leaf.shape[1:]), keras.backend.standardize_dtype(leaf.dtype))
        for leaf in keras.tree.flatten(x)
        if leaf is not None
    )


def shapes(x: Any) -> Tuple[Tuple[int, ...], ...]:
    """Shapes of the non-None leaves of `x`."""
    return tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x) if leaf is not None)


def _check_cardinality(structure: Any) -> int:
    sizes = {
        int(leaf.shape[0])
        for leaf in keras.tree.flatten(structure)
        if leaf is not None and getattr(leaf, "shape", None)
    }
    if len(sizes) > 1:
        raise ValueError(
            "all inputs, targets and sample weights must have the same number of "
            f"samples; received leading dimensions {sorted(sizes)}"
        )
    return num_rows(structure)


def from_input(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: Optional[int],
    steps: Optional[int],
    with_targets: bool,
) -> Chunks:
    """Chunks of `(x,)` (predict) or `(x, y, sample_weight)` (evaluate) rows.

    Args:
        x: Arrays/tensors (or nested lists/dicts of them), a `tf.data.Dataset`,
            a `keras.utils.PyDataset`, or a generator yielding batches.
        y: Targets, for array-like `x` only.
        sample_weight: Sample weights, for array-like `x` only.
        batch_size: The batch size asked for (arrays only); with `steps` it
            bounds the number of samples used, as in Keras.
        steps: Number of batches to use, as in Keras; None for all.
        with_targets: Whether to keep targets and weights (evaluate).

    Returns:
        A `Chunks` whose chunks are `(x,)` or `(x, y, sample_weight)` tuples.
    """
    if is_array_like(x):
        x = keras.tree.map_structure(_to_array, x)
        y = keras.tree.map_structure(_to_array, y) if y is not None else None
        sample_weight = (
            keras.tree.map_structure(_to_array, sample_weight)
            if sample_weight is not None else None
        )
        chunk = (x, y, sample_weight) if with_targets else (x,)
        n = _check_cardinality(chunk)
        if steps is not None:
            n = min(n, steps * (batch_size or DEFAULT_BATCH_SIZE))
            chunk = rows(chunk, 0, n)
        return Chunks(iter([chunk]), n, True)

    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise ValueError(
                f"`{name}` is only accepted with array inputs; received {name} with "
                f"x of type {type(x).__name__}. Include it in the batches that x yields."
            )
    iterator = _iterate_batches(x)
    if steps is not None:
        iterator = itertools.islice(iterator, steps)

    def unpack(batch: Any) -> Tuple:
        bx, by, bw = keras.utils.unpack_x_y_sample_weight(batch)
        return (bx, by, bw) if with_targets else (bx,)

    return Chunks((unpack(b) for b in iterator), None, False)


def _iterate_batches(x: Any) -> Iterable[Any]:
    # Keras's own data adapters know every input kind predict/evaluate take
    # (tf.data, PyDataset with its workers, generators, torch DataLoader, ...).
    try:
        adapter = _keras_compat.data_adapter(x)
    except ValueError as err:
        raise TypeError(
            "x must be an array, a tensor, a list/dict of them, a tf.data.Dataset, "
            f"a keras.utils.PyDataset or a generator; received {type(x).__name__}: {err}"
        ) from err
    on_begin = getattr(adapter, "on_epoch_begin", None)
    if on_begin:
        on_begin()
    try:
        yield from adapter.get_numpy_iterator()
    finally:
        on_end = getattr(adapter, "on_epoch_end", None)
        if on_end:
            on_end()
