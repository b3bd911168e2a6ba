"""Keras batches as `(x, y, sample_weight)` chunks of rows, and what cannot split by rows.

Only numpy arrays, dense tensors and None split (not sparse, ragged, `tf.experimental.Optional`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import keras
import numpy as np

from keras_memfit._internal.kinds import is_sparse

# Attributes of sparse (TensorFlow, JAX BCOO, scipy) and ragged (TensorFlow) tensors.
_NOT_DENSE = ("indices", "row_splits", "nnz")

# Classes met whose every instance is a dense leaf, so per-batch checks skip `keras.tree`
# (never torch.Tensor: its sparse tensors share its class).
_DENSE_CLASSES: Set[type] = {np.ndarray}
# Classes dense exactly when `layout` is the one recorded (torch.Tensor: `torch.strided`).
_DENSE_LAYOUTS: Dict[type, Any] = {}


def _known_dense(leaf: Any) -> bool:
    """Whether `leaf`'s class was met before as a dense leaf (cheap, no false yes)."""
    cls = type(leaf)
    if cls in _DENSE_CLASSES:
        return True
    layout = _DENSE_LAYOUTS.get(cls)
    return layout is not None and leaf.layout is layout


def leaves(structure: Any) -> List[Any]:
    """`keras.tree.flatten(structure)`, skipping `keras.tree` for known dense arrays and None."""
    if type(structure) is tuple and all(p is None or _known_dense(p) for p in structure):
        return list(structure)
    if _known_dense(structure):
        return [structure]
    return keras.tree.flatten(structure)


def as_chunk(batch: Any) -> tuple:
    """A Keras batch as an `(x, y, sample_weight)` chunk of rows."""
    return tuple(keras.utils.unpack_x_y_sample_weight(batch))


def form_of(batch: Any) -> int:
    """How Keras packed `batch`: 0 for a bare `x` (as `train_step` may read it), else its length."""
    return len(batch) if isinstance(batch, (tuple, list)) else 0


def as_batch(chunk: tuple, form: int) -> Any:
    """An `(x, y, sample_weight)` chunk (or a piece of it) back as a Keras batch of `form`."""
    return chunk[0] if form == 0 else tuple(chunk[:form])


def _splittable(leaf: Any) -> bool:
    if leaf is None:
        return True
    if isinstance(leaf, np.ndarray):
        return leaf.ndim >= 1
    if not _known_dense(leaf):
        if not keras.ops.is_tensor(leaf) or not _dense(leaf):
            return False
        if not hasattr(leaf, "is_sparse"):  # its class is dense from now on
            _DENSE_CLASSES.add(type(leaf))
        elif getattr(leaf, "layout", None) is not None:  # a torch.Tensor: dense by its layout
            _DENSE_LAYOUTS[type(leaf)] = leaf.layout
    try:
        rank = len(leaf.shape)
    except (TypeError, ValueError, AttributeError):  # unknown rank, no shape
        return False
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
    """What in `chunk` cannot split by rows, e.g. "x['t']=SparseTensor(...)", or None."""
    for path, leaf in keras.tree.flatten_with_path(chunk):
        if not _splittable(leaf):
            return f"{_name(tuple(path))}={_describe(leaf)}"
    return None


def first_unsplittable(chunks: Iterable[tuple]) -> Optional[str]:
    """`unsplittable` of the first of `chunks` that has such an input, else None."""
    return next((found for found in map(unsplittable, chunks) if found is not None), None)


def splittable_rows(chunk: tuple) -> Optional[int]:
    """The rows of `chunk` if every leaf splits by rows, else None (one pass, for every batch)."""
    rows = None
    for leaf in leaves(chunk):
        if not _splittable(leaf):
            return None
        if rows is None and leaf is not None:
            rows = int(leaf.shape[0])
    return 0 if rows is None else rows


def concatenate(parts: List[Any]) -> Any:
    """The outputs of consecutive pieces joined on the host, as tensors in the step's form."""
    if len(parts) == 1:
        return parts[0]
    return keras.tree.map_structure(
        lambda *column: keras.ops.convert_to_tensor(
            np.concatenate([keras.ops.convert_to_numpy(piece) for piece in column], axis=0)
        ),
        *parts,
    )


def pull_batches(
    iterator: Iterator[Any], count: int, is_end_of_data: Callable[[BaseException], bool]
) -> Iterator[Any]:
    """Up to `count` batches of an epoch iterator, each pulled once the one before has run."""
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
    """Rows `start:stop` of `chunk`'s leaves (`chunk` itself for all); TypeError for sparse."""
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
    return tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x) if leaf is not None)
