"""Where `safe_predict` puts each piece's outputs: in order, on the host."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend import Spec
from keras_memfit._internal.kinds import is_ragged, is_sparse


def is_native(leaf: Any) -> bool:
    """Whether an output is ragged or sparse: `model.predict` returns those as they are."""
    return is_ragged(leaf) or is_sparse(leaf)


def to_host(leaf: Any) -> Any:
    return leaf if is_native(leaf) else keras.ops.convert_to_numpy(leaf)


def _concatenate(parts: List[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if is_native(parts[0]):
        return keras.ops.concatenate(parts, axis=0)
    return np.concatenate(parts, axis=0)


def merge_outputs(logs: List[Any]) -> Any:
    """One execution's `{"outputs": ...}`: its batches' outputs concatenated, as Keras's."""
    if len(logs) == 1:
        return logs[0]
    outputs = [entry["outputs"] for entry in logs]
    return {"outputs": keras.tree.map_structure(lambda *parts: _concatenate(list(parts)),
                                                *outputs)}


def check_out_types(out: Any) -> None:
    for leaf in keras.tree.flatten(out):
        if not isinstance(leaf, np.ndarray):
            raise TypeError(
                "out must be a numpy array or np.memmap (or a list/dict of them "
                f"matching the model's outputs); received {type(leaf).__name__}"
            )
        if not leaf.flags.writeable:
            raise ValueError("out must be writeable; received a read-only array")


class OutputWriter:
    """Collects each piece's host outputs in order, into `out` or new arrays."""

    def __init__(self, num_samples: Optional[int], out: Any) -> None:
        self.num_samples = num_samples
        self.out = out
        self.structure = None
        self.buffers: Optional[List[np.ndarray]] = None
        self.parts: Optional[List[List[np.ndarray]]] = None
        self.offset = 0
        if out is not None and num_samples is not None:
            for leaf in keras.tree.flatten(out):
                if leaf.ndim == 0 or leaf.shape[0] != num_samples:
                    raise ValueError(
                        f"out must have {num_samples} rows, one per input sample; "
                        f"received out of shape {leaf.shape}"
                    )

    def check_spec(self, spec: Any, postprocess: Optional[Callable]) -> None:
        """Validate traced outputs (see `backend.output_spec`) before any work."""
        source = "postprocess" if postprocess is not None else "the model's predict_step"
        for leaf in keras.tree.flatten(spec):
            if not isinstance(leaf, Spec):
                raise TypeError(
                    f"{source} must return a tensor or a structure of tensors; "
                    f"received {type(leaf).__name__}: {leaf!r:.80}"
                )
            if leaf.shape is not None and (len(leaf.shape) == 0 or leaf.shape[0] is not None):
                raise ValueError(
                    f"{source} must keep the batch dimension (one row per sample); "
                    f"it returned a tensor of shape {leaf.shape} for a batch of "
                    "unknown size"
                )
        if self.out is not None:
            self._check_out_against(
                spec, lambda s: (tuple(s.shape[1:]) if s.shape else None, s.dtype)
            )

    def _check_out_against(self, outputs: Any, describe: Callable) -> None:
        try:
            _keras_compat.assert_same_structure(self.out, outputs)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "out must have the structure of the model's outputs; received "
                f"{_describe(self.out)} for outputs {_describe(outputs)}"
            ) from err
        for target, output in zip(keras.tree.flatten(self.out), keras.tree.flatten(outputs)):
            trailing, dtype = describe(output)
            shape_ok = trailing is None or any(d is None for d in trailing) or (
                tuple(target.shape[1:]) == tuple(trailing)
            )
            if not shape_ok or target.dtype != dtype:
                raise ValueError(
                    f"out must have trailing shape {trailing} and dtype {dtype} to hold "
                    f"the outputs; received shape {target.shape} and dtype {target.dtype}"
                )

    def write(self, result: Any, size: int, postprocess: Optional[Callable]) -> None:
        leaves = keras.tree.flatten(result)
        if self.structure is None:
            self._start(result, leaves, size, postprocess)
        if self.buffers is not None:
            stop = self.offset + size
            for buffer, leaf in zip(self.buffers, leaves):
                if stop > buffer.shape[0]:
                    raise ValueError(
                        f"out has {buffer.shape[0]} rows but the input yielded more "
                        "samples; pass an out with one row per sample"
                    )
                buffer[self.offset:stop] = leaf
        else:
            for part, leaf in zip(self.parts, leaves):
                part.append(leaf)
        self.offset += size

    def _start(self, result, leaves, size, postprocess) -> None:
        self.structure = result
        native = any(is_native(leaf) for leaf in leaves)
        if native and self.out is not None:
            raise ValueError(
                "out cannot hold ragged or sparse outputs; received out="
                f"{_describe(self.out)} for outputs of types "
                f"{[type(leaf).__name__ for leaf in leaves]}; pass out=None"
            )
        for leaf in leaves:
            if len(leaf.shape) == 0 or leaf.shape[0] != size:
                source = "postprocess" if postprocess is not None else "the model"
                raise ValueError(
                    f"{source} must return one row per sample; a batch of {size} "
                    f"gave shape {leaf.shape}"
                )
        if self.out is not None:
            self._check_out_against(result, lambda a: (a.shape[1:], a.dtype))
            self.buffers = keras.tree.flatten(self.out)
        elif self.num_samples is not None and not native:
            self.buffers = [
                np.empty((self.num_samples,) + leaf.shape[1:], leaf.dtype) for leaf in leaves
            ]
        else:
            self.parts = [[] for _ in leaves]

    def result(self) -> Any:
        if self.out is not None:
            rows = keras.tree.flatten(self.out)[0].shape[0]
            if self.offset < rows:
                return keras.tree.map_structure(lambda a: a[: self.offset], self.out)
            return self.out
        if self.buffers is not None:
            leaves = [b[: self.offset] if self.offset < b.shape[0] else b for b in self.buffers]
        else:
            leaves = [_concatenate(p) for p in self.parts]
        return keras.tree.pack_sequence_as(self.structure, leaves)

    def empty(self, step: Callable, first: Any) -> Any:
        """The empty result for an input with no samples."""
        if self.out is not None:
            return keras.tree.map_structure(lambda a: a[:0], self.out)
        if first is None:
            raise ValueError(
                "x yielded no batches, so the output shapes are unknown; pass at "
                "least one batch"
            )
        spec = _backend.get().output_spec(step, first[0])
        if spec is _backend.NO_SPEC:
            return keras.tree.map_structure(keras.ops.convert_to_numpy, step(first[0]))
        return keras.tree.map_structure(
            lambda s: np.empty((0,) + tuple(d or 0 for d in (s.shape or (0,))[1:]), s.dtype),
            spec,
        )


def _describe(value: Any) -> str:
    return str(keras.tree.map_structure(lambda a: getattr(a, "shape", a), value))
