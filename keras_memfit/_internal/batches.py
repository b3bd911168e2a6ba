"""Keras's batches as MemFit receives them: chunks of rows, what cannot be split.

A batch (`x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`) is split as an `(x, y,
sample_weight)` chunk and each piece handed back in Keras's form. Only numpy arrays, dense
tensors and None split by rows: sparse, ragged or `tf.experimental.Optional` inputs do not.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import keras
import numpy as np

from keras_memfit._internal.kinds import is_sparse

# Attributes that mark a tensor as not dense: sparse (TensorFlow, JAX BCOO,
# scipy) and ragged (TensorFlow) tensors.
_NOT_DENSE = ("indices", "row_splits", "nnz")

# Classes every instance of which is a dense array and a leaf for `keras.tree`
# (numpy's, and each dense tensor class met so far; never torch.Tensor, whose sparse
# tensors share its class), so the per-batch checks skip `keras.tree` (see `leaves`).
_DENSE_CLASSES: Set[type] = {np.ndarray}
# Classes whose instances are dense leaves exactly when their `layout` is the
# one recorded here (torch.Tensor: `torch.strided`), met so far: one attribute
# read instead of `keras.tree` per batch.
_DENSE_LAYOUTS: Dict[type, Any] = {}


def _note_dense_class(leaf: Any) -> None:
    if keras.tree.is_nested(leaf):
        return
    if not hasattr(leaf, "is_sparse"):
        _DENSE_CLASSES.add(type(leaf))
    elif getattr(leaf, "layout", None) is not None:  # a torch.Tensor: dense by its layout
        _DENSE_LAYOUTS[type(leaf)] = leaf.layout


def _known_dense(leaf: Any) -> bool:
    """Whether `leaf`'s class was met before as a dense leaf (cheap, no false yes)."""
    cls = type(leaf)
    if cls in _DENSE_CLASSES:
        return True
    layout = _DENSE_LAYOUTS.get(cls)
    return layout is not None and leaf.layout is layout


def leaves(structure: Any) -> List[Any]:
    """`keras.tree.flatten(structure)`, without `keras.tree` for a Keras batch of arrays.

    A tuple of known dense arrays and None, or one such array, is its own list of leaves.
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

    A model's own `train_step` may read its `data` as that bare `x`.
    """
    return len(batch) if isinstance(batch, (tuple, list)) else 0


def as_batch(chunk: tuple, form: int) -> Any:
    """An `(x, y, sample_weight)` chunk (or a piece of it) back as a Keras batch of `form`."""
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

    For example `"x['tokens']=SparseTensor(shape=(32, 100), dtype=float32)"`.
    """
    for path, leaf in keras.tree.flatten_with_path(chunk):
        if not _splittable(leaf):
            return f"{_name(tuple(path))}={_describe(leaf)}"
    return None


def first_unsplittable(chunks: Iterable[tuple]) -> Optional[str]:
    """`unsplittable` of the first of `chunks` that has such an input, else None."""
    for chunk in chunks:
        found = unsplittable(chunk)
        if found is not None:
            return found
    return None


def splittable_rows(chunk: tuple) -> Optional[int]:
    """The rows of `chunk` if every leaf can be split by rows, else None.

    `unsplittable` and `data.num_rows` in one pass, for the checks made on every batch.
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

    One part is returned as it is; several are joined on the host and converted back to tensors.
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

    As Keras's multi-step functions pull them: a batch is held only while it runs. Fewer than
    `count` at the end of the epoch; the end-of-data error itself where no batch was left.
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


def num_rows(chunk: Any) -> int:
    """The leading dimension shared by the leaves of `chunk`."""
    for leaf in leaves(chunk):
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
    """Rows `start:stop` of every leaf of `chunk` (numpy views); all its rows are `chunk` itself.

    Raises:
        TypeError: If `start:stop` is a proper part of a chunk holding a sparse leaf.
    """
    n = num_rows(chunk)
    if start <= 0 and stop >= n:
        return chunk
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else _leaf_rows(leaf, start, stop, n), chunk
    )


def splittable(chunk: Any) -> bool:
    """Whether rows of `chunk` can be taken (it holds no sparse leaf)."""
    return not any(is_sparse(leaf) for leaf in keras.tree.flatten(chunk))


def _leaf_rows(leaf: Any, start: int, stop: int, n: int) -> Any:
    if is_sparse(leaf):
        raise TypeError(
            f"keras_memfit must run a batch of {n} samples in smaller pieces (it ran out "
            f"of memory, or the memory statistics say it would), but cannot split "
            f"sparse input; received a {type(leaf).__name__} of shape "
            f"{tuple(leaf.shape)}. Pass a smaller batch_size (or batch the dataset "
            "smaller), or densify the input."
        )
    return leaf[start:stop]


_DTYPE_NAMES: Dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Keras's name of `dtype` (numpy object arrays are "string"), cached per dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = "string" if dtype == np.dtype(object) else keras.backend.standardize_dtype(dtype)
    try:
        _DTYPE_NAMES[dtype] = name
    except TypeError:  # an unhashable dtype object
        pass
    return name


def signature(x: Any) -> Tuple:
    """Shapes (without the batch dimension) and dtypes of the leaves of `x`."""
    return tuple([
        (tuple(leaf.shape[1:]), dtype_name(leaf.dtype))
        for leaf in leaves(x)
        if leaf is not None
    ])


def shapes(x: Any) -> Tuple[Tuple[int, ...], ...]:
    """Shapes of the non-None leaves of `x`."""
    return tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x) if leaf is not None)
