"""`safe_generate`'s pieces: prompts as rows, few batch shapes, outputs in order."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, Hashable, Iterator, List, Set, Tuple

import keras
import numpy as np

from keras_memfit._internal import batches as _batches

logger = logging.getLogger("keras_memfit")

# A piece is padded to a known shape only if that at most doubles its rows.
MAX_PADDING_FACTOR = 2


def _as_rows(name: str, value: Any) -> np.ndarray:
    """`value` (a list of strings, an array, a tensor) as a numpy array of rows."""
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (str, bytes)) for v in value):
            array = np.empty(len(value), dtype=object)
            array[:] = list(value)
            return array
        array = np.asarray(value)
    elif isinstance(value, np.ndarray) or keras.ops.is_tensor(value) or hasattr(value, "numpy"):
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    else:
        raise TypeError(
            f"{name} must be a string, a list or array of strings, a dict of arrays "
            "(token_ids and padding_mask for a model without a preprocessor) or a "
            f"batched tf.data.Dataset; received {type(value).__name__}: {value!r:.80}"
        )
    if array.dtype.kind in "US":  # fixed-width numpy strings: generate takes objects
        array = array.astype(object)
    if array.ndim == 0:
        raise ValueError(
            f"{name} must have a batch dimension (one row per prompt); received a "
            f"scalar {type(value).__name__}: {value!r:.80}"
        )
    return array


def prompt_chunks(inputs: Any) -> Tuple[Iterator[Any], bool]:
    """(chunks of `(x, None, None)`, whether `inputs` is one string)."""
    if type(inputs).__name__.endswith("Dataset") and hasattr(inputs, "as_numpy_iterator"):
        return ((_rows_of(batch), None, None) for batch in inputs.as_numpy_iterator()), False
    if isinstance(inputs, (str, bytes)):
        return iter([(_as_rows("inputs", [inputs]), None, None)]), True
    x = _rows_of(inputs)
    if _batches.num_rows((x,)) == 0:
        raise ValueError(f"inputs must hold at least one prompt; received {inputs!r:.80}")
    return iter([(x, None, None)]), False


def _rows_of(inputs: Any) -> Any:
    if isinstance(inputs, dict):
        x = {key: _as_rows(f"inputs[{key!r}]", value) for key, value in inputs.items()}
        counts = {key: len(value) for key, value in x.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                "every input of a dict must have one row per prompt; received rows "
                f"{counts}"
            )
        return x
    return _as_rows("inputs", inputs)


def to_generate_input(x: Any) -> Any:
    """A piece as `generate` takes it: object arrays as lists of `str` (bytes decoded)."""
    def convert(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray) and leaf.dtype == object and leaf.ndim == 1:
            return [v.decode("utf-8") if isinstance(v, bytes) else v for v in leaf]
        return leaf

    return keras.tree.map_structure(convert, x)


# model -> {signature: batch sizes run}, held weakly.
_SHAPES: "weakref.WeakKeyDictionary[Any, Dict[Hashable, Set[int]]]" = weakref.WeakKeyDictionary()


class ShapeKeeper:
    """Pads a piece with copies of its last prompt up to a batch shape already run."""

    def __init__(self, model: Any, signature: Hashable) -> None:
        self.sizes: Set[int] = _SHAPES.setdefault(model, {}).setdefault(signature, set())
        self.padding = True

    def target(self, rows: int) -> int:
        """The rows a piece of `rows` prompts is run as."""
        if rows in self.sizes or not self.padding:
            return rows
        return min((s for s in self.sizes if rows < s <= rows * MAX_PADDING_FACTOR), default=rows)

    def run(self, x: Any, generate: Callable[[Any], Any]) -> Any:
        """`generate` on `x` padded to `target` rows with copies of its last row; `x`'s outputs."""
        rows = _batches.num_rows((x,))
        target = self.target(rows)
        if target > rows:
            logger.debug("generate: %d prompts padded to %d (a batch shape already compiled)",
                         rows, target)

            def grow(leaf: np.ndarray) -> np.ndarray:
                return np.concatenate([leaf, np.repeat(leaf[-1:], target - rows, axis=0)], axis=0)

            x = keras.tree.map_structure(grow, x)
        try:
            result = generate(x)
        except Exception:
            if target > rows:  # pad no more: smaller pieces padded up would fail too
                self.padding = False
            raise
        self.sizes.add(target)
        return take_rows(result, rows)


def take_rows(outputs: Any, rows: int) -> Any:
    """The first `rows` rows of `generate`'s outputs (strings in a list, or arrays)."""
    if isinstance(outputs, dict):
        return {key: take_rows(value, rows) for key, value in outputs.items()}
    return outputs[:rows]


def joined_outputs(parts: List[Any], scalar: bool) -> Any:
    """Every piece's outputs in order, joined as `generate` joins its batches; `scalar`: one."""
    if not parts:
        raise ValueError("generate ran on no prompt: the input dataset was empty")
    joined = _join(parts)
    if scalar:
        return keras.tree.map_structure(lambda v: v[0], joined) if isinstance(
            joined, dict) else joined[0]
    return joined


def _join(parts: List[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict):
        return {key: _join([p[key] for p in parts]) for key in first}
    if isinstance(first, list):
        return [item for part in parts for item in part]
    return np.concatenate([np.asarray(p) for p in parts], axis=0)
