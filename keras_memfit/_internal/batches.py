"""Keras's batches as MemFit receives them: chunks of rows, what cannot be split.

Keras's step functions receive each batch as `x`, `(x,)`, `(x, y)` or
`(x, y, sample_weight)`; MemFit splits it as an `(x, y, sample_weight)`
chunk of rows (`keras_memfit.planning.data`) and hands each piece back in Keras's
form. Only numpy arrays, dense tensors and `None` can be split by rows: a
sparse or ragged tensor, or an optional input that arrives as a
`tf.experimental.Optional`, cannot, and `unsplittable` names it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set

import keras
import numpy as np

# Attributes that mark a tensor as not dense: sparse (TensorFlow, JAX BCOO,
# scipy) and ragged (TensorFlow) tensors.
_NOT_DENSE = ("indices", "row_splits", "nnz")

# Classes every instance of which is a dense array and a leaf for `keras.tree`:
# numpy's, and each dense tensor class met so far (JAX's array, TensorFlow's
# EagerTensor), never torch.Tensor, whose sparse tensors share its class (see
# `_DENSE_LAYOUTS`). The
# checks made on every batch of Keras's loop then need neither `keras.tree`
# nor attribute probes for a batch of them (see `leaves`).
_DENSE_CLASSES: Set[type] = {np.ndarray}
# Classes whose instances are dense leaves exactly when their `layout` is the
# one recorded here (torch.Tensor: `torch.strided`), met so far: one attribute
# read instead of `keras.tree` per batch.
_DENSE_LAYOUTS: Dict[type, Any] = {}


def _note_dense_class(leaf: Any) -> None:
    """Remember the class of `leaf`, a tensor found dense (or, for torch, its dense layout)."""
    if keras.tree.is_nested(leaf):
        return
    if not hasattr(leaf, "is_sparse"):
        _DENSE_CLASSES.add(type(leaf))
    elif getattr(leaf, "layout", None) is not None:  # a torch.Tensor: dense by its layout
        _DENSE_LAYOUTS[type(leaf)] = leaf.layout


def _known_dense(leaf: Any) -> bool:
    """Whether `leaf` is of a class met before as a dense leaf (a cheap test, no false yes)."""
    cls = type(leaf)
    if cls in _DENSE_CLASSES:
        return True
    layout = _DENSE_LAYOUTS.get(cls)
    return layout is not None and leaf.layout is layout


def leaves(structure: Any) -> List[Any]:
    """`keras.tree.flatten(structure)`, without `keras.tree` for a Keras batch of arrays.

    A tuple of dense arrays (see `_DENSE_CLASSES`) and None, as Keras's loops
    hand a batch, or one such array, is its own list of leaves; anything else
    is flattened by `keras.tree`.

    Example:
        >>> leaves((np.zeros((4, 2)), None))
        [array(...), None]
    """
    if type(structure) is tuple:
        for part in structure:
            if part is not None and not _known_dense(part):
                return keras.tree.flatten(structure)
        return list(structure)
    if _known_dense(structure):
        return [structure]
    return keras.tree.flatten(structure)


def as_chunk(batch: Any) -> tuple:
    """A Keras batch as an `(x, y, sample_weight)` chunk of rows."""
    return tuple(keras.utils.unpack_x_y_sample_weight(batch))


def form_of(batch: Any) -> int:
    """How Keras packed `batch`: 0 for a bare `x`, else the tuple's length (1 to 3).

    Keras's loops hand a step `x` itself when there are no targets and `x` is
    not a tuple (`keras.utils.pack_x_y_sample_weight`); a model's own
    `train_step` may read its `data` as that `x`.
    """
    return len(batch) if isinstance(batch, (tuple, list)) else 0


def as_batch(chunk: tuple, form: int) -> Any:
    """An `(x, y, sample_weight)` chunk (or a piece of it) back as a Keras batch of `form`.

    Example:
        >>> as_batch((x, None, None), form_of(x)) is x
        True
    """
    if form == 0:
        return chunk[0]
    return tuple(chunk[:form])


def _rank(leaf: Any) -> Optional[int]:
    try:
        return len(leaf.shape)
    except (TypeError, ValueError, AttributeError):  # unknown rank, no shape
        return None


def _splittable(leaf: Any) -> bool:
    if leaf is None:
        return True
    if isinstance(leaf, np.ndarray):
        return leaf.ndim >= 1
    if not _known_dense(leaf):
        if not keras.ops.is_tensor(leaf) or not _dense(leaf):
            return False
        _note_dense_class(leaf)
    rank = _rank(leaf)
    return bool(rank) and leaf.shape[0] is not None


def _dense(leaf: Any) -> bool:
    """Whether a tensor is dense (torch's tensors all have `indices`: their layout says)."""
    layout = getattr(leaf, "layout", None)
    if layout is not None and hasattr(leaf, "is_sparse"):  # a torch.Tensor
        return str(layout) == "torch.strided"
    return not any(hasattr(leaf, a) for a in _NOT_DENSE)


def _describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    dtype = getattr(dtype, "name", dtype)
    details = ", ".join(
        f"{name}={value}" for name, value in (("shape", shape), ("dtype", dtype))
        if value is not None
    )
    return f"{type(leaf).__name__}({details})"


def _name(path: tuple) -> str:
    """`(0, 'a')` as `x['a']`: the path of a leaf in an `(x, y, sample_weight)` chunk."""
    if not path:
        return "x"
    head = ("x", "y", "sample_weight")[path[0]] if isinstance(path[0], int) else str(path[0])
    return head + "".join(f"[{p!r}]" for p in path[1:])


def unsplittable(chunk: tuple) -> Optional[str]:
    """What in `chunk` cannot be split by rows, in words, or None if all of it can.

    Args:
        chunk: An `(x, y, sample_weight)` chunk (see `as_chunk`).

    Returns:
        For example `"x['tokens']=SparseTensor(shape=(32, 100), dtype=float32)"`,
        or None when every leaf is an array, a dense tensor or None.

    Example:
        >>> unsplittable((np.zeros((4, 2)), None, None)) is None
        True
    """
    for path, leaf in keras.tree.flatten_with_path(chunk):
        if not _splittable(leaf):
            return f"{_name(tuple(path))}={_describe(leaf)}"
    return None


def first_unsplittable(chunks: Iterable[tuple]) -> Optional[str]:
    """What cannot be split (see `unsplittable`) in the first of `chunks` that has such an input, else None."""
    for chunk in chunks:
        found = unsplittable(chunk)
        if found is not None:
            return found
    return None


def splittable_rows(chunk: tuple) -> Optional[int]:
    """The rows of `chunk` if every leaf can be split by rows, else None.

    `unsplittable(chunk) is None` and `data.num_rows(chunk)` in one pass over
    the leaves, for the checks made on every batch of Keras's loop.

    Example:
        >>> splittable_rows((np.zeros((4, 2)), None, None))
        4
    """
    rows = None
    for leaf in leaves(chunk):
        if not _splittable(leaf):
            return None
        if rows is None and leaf is not None:
            rows = int(leaf.shape[0])
    return 0 if rows is None else rows


def concatenate(parts: List[Any]) -> Any:
    """The outputs of consecutive pieces as one structure, in the step's own form.

    One part is returned as it is (the step's own tensors, as Keras's
    `predict_function` returns them); several are joined on the host and
    converted back to the backend's tensors.
    """
    if len(parts) == 1:
        return parts[0]
    leaves = [keras.tree.flatten(p) for p in parts]
    joined = [
        keras.ops.convert_to_tensor(
            np.concatenate([keras.ops.convert_to_numpy(piece) for piece in column], axis=0)
        )
        for column in zip(*leaves)
    ]
    return keras.tree.pack_sequence_as(parts[0], joined)


def pull_batches(
    iterator: Iterator[Any], count: int, is_end_of_data: Callable[[BaseException], bool]
) -> Iterator[Any]:
    """Up to `count` batches from a Keras epoch iterator, each pulled when the one before is done.

    As Keras's multi-step functions pull them: a batch is held only while it
    runs, not the `count` of them at once.

    Args:
        iterator: The epoch's iterator of batches.
        count: The model's `steps_per_execution`.
        is_end_of_data: The backend's test for the iterator's end-of-data
            error (`StopIteration`, TensorFlow's `OutOfRangeError`).

    Returns:
        An iterator over the batches; fewer than `count` at the end of the epoch.

    Raises:
        The end-of-data error itself, at once, when no batch was left.
    """
    return _pulled(next(iterator), iterator, count, is_end_of_data)


def _pulled(batch: Any, iterator: Iterator[Any], count: int,
            is_end_of_data: Callable[[BaseException], bool]) -> Iterator[Any]:
    for pulled in range(1, count + 1):
        yield batch
        del batch  # not held while the next one is pulled
        if pulled == count:
            return
        try:
            batch = next(iterator)
        except Exception as exc:
            if not is_end_of_data(exc):
                raise
            return
