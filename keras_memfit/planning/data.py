"""Turning what `model.predict`/`evaluate` accept into chunks of rows.

Array-like input is one chunk of every sample, sliced without a copy; datasets, PyDatasets
and generators yield one chunk per batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Iterable, Iterator, Optional, Tuple

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal.kinds import is_foreign_tf_tensor, is_sparse
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal.batches import num_rows, rows, splittable

DEFAULT_BATCH_SIZE = 32  # what model.predict / model.evaluate use


@dataclasses.dataclass(eq=False)
class Chunks:
    """The input as chunks of rows."""

    chunks: Iterator[Any]
    num_samples: Optional[int]
    from_arrays: bool
    num_batches: Optional[int] = None  # Keras's count, once iteration began


def _is_array_leaf(value: Any) -> bool:
    if value is None or isinstance(value, np.ndarray) or keras.ops.is_tensor(value):
        return True
    if is_sparse(value) or is_foreign_tf_tensor(value):
        return True
    return hasattr(value, "to_numpy") and hasattr(value, "shape")  # pandas


def is_array_like(x: Any) -> bool:
    """Whether `x` is an array, a tensor or a (nested) list/tuple/dict of them."""
    leaves = keras.tree.flatten(x)
    return all(_is_array_leaf(leaf) for leaf in leaves) and any(leaf is not None for leaf in leaves)


def _to_array(value: Any) -> Any:
    if value is None or isinstance(value, np.ndarray) or keras.ops.is_tensor(value):
        return value
    if is_foreign_tf_tensor(value):
        return value.numpy()  # no copy for a tensor in host memory
    if is_sparse(value):
        return value
    return value.to_numpy()


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
    """Chunks of `(x,)` (predict) or `(x, y, sample_weight)` (evaluate) rows."""
    if is_array_like(x):
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        x, y, sample_weight = keras.tree.map_structure(_to_array, (x, y, sample_weight))
        chunk = (x, y, sample_weight) if with_targets else (x,)
        n = _check_cardinality(chunk)
        if steps is not None:
            n = min(n, steps * batch_size)
        if not splittable(chunk):
            # Sparse rows cannot be sliced here: Keras batches it; each batch runs whole.
            adapter = _keras_compat.data_adapter(x, y, sample_weight, batch_size=batch_size)
            batches = itertools.islice(_iterate_adapter(adapter), steps)  # steps=None: all
            return Chunks((_unpack(b, with_targets) for b in batches), n, False,
                          adapter.num_batches)
        chunk = rows(chunk, 0, n)  # all of it, without `steps`
        return Chunks(iter([chunk]), n, True)

    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise ValueError(
                f"`{name}` is only accepted with array inputs; received {name} with "
                f"x of type {type(x).__name__}. Include it in the batches that x yields."
            )
    source = Chunks(iter(()), None, False)
    batches = itertools.islice(_iterate_batches(x, source), steps)  # nothing read until used
    source.chunks = (_unpack(b, with_targets) for b in batches)
    return source


def _unpack(batch: Any, with_targets: bool) -> Tuple:
    bx, by, bw = keras.utils.unpack_x_y_sample_weight(batch)
    return (bx, by, bw) if with_targets else (bx,)


def _iterate_batches(x: Any, source: Chunks) -> Iterable[Any]:
    try:
        adapter = _keras_compat.data_adapter(x)
    except ValueError as err:
        raise TypeError(
            "x must be an array, a tensor, a list/dict of them, a tf.data.Dataset, "
            f"a keras.utils.PyDataset or a generator; received {type(x).__name__}: {err}"
        ) from err
    source.num_batches = getattr(adapter, "num_batches", None)
    yield from _iterate_adapter(adapter)


def _iterate_adapter(adapter: Any) -> Iterator[Any]:
    """The adapter's batches as the backend's own loops give them, for one epoch."""
    on_begin = getattr(adapter, "on_epoch_begin", None)
    if on_begin:
        on_begin()
    try:
        yield from _backend.get().adapter_batches(adapter)
    finally:
        on_end = getattr(adapter, "on_epoch_end", None)
        if on_end:
            on_end()


def batch_size_for(x: Any, batch_size: Optional[int], advice: str = "") -> Optional[int]:
    """`batch_size` for array input; None (logged at INFO) for input that comes batched."""
    if batch_size is None or is_array_like(x):
        return batch_size
    logging.getLogger("keras_memfit").info(
        "batch_size=%d is ignored: x of type %s is already batched, as in Keras%s",
        batch_size, type(x).__name__, f"; {advice}" if advice else "",
    )
    return None
