"""Symbolic traces of a model on torch's "meta" device (for real where an op has no meta kernel)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Dict, List, Optional

import keras
import torch
from keras.src.backend.torch.core import device_scope

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend._layer_calls import CallRecorder, Info, trace_at_two_batches
from keras_memfit.backend.base import Trace
from keras_memfit.backend.torch.steps import meta_variables, torch_dtype

logger = logging.getLogger("keras_memfit")


def _record_forward(model: keras.Model, batch: int, meta: bool) -> CallRecorder:
    """One forward pass at `batch` rows (on "meta", or for real): its calls, inputs, outputs."""
    struct, positional = _keras_compat.input_structure(model)
    keys: Dict[int, str] = {}
    alive: List[Any] = []  # keeps ids unique

    def describe(value: Any) -> Optional[Info]:
        if not isinstance(value, torch.Tensor):
            return None
        key = keys.get(id(value))
        if key is None:
            key = keys[id(value)] = f"t{len(keys)}"
            alive.append(value)
        dtype = keras.backend.standardize_dtype(value.dtype)
        return key, tuple(int(d) for d in value.shape), dtype

    recorder = CallRecorder(describe)

    def on_device() -> ContextManager[Any]:
        return device_scope("meta") if meta else contextlib.nullcontext()

    def tensor(t: Any) -> Any:
        zeros = torch.zeros((batch,) + tuple(t.shape[1:]), dtype=torch_dtype(t.dtype),
                            device="meta" if meta else None)
        return zeros if meta else keras.ops.convert_to_tensor(zeros.numpy())

    mapping = meta_variables(model) if meta else []
    with torch.no_grad():
        with on_device():
            inputs = keras.tree.map_structure(tensor, struct)
        recorder.inputs = recorder.infos(inputs)
        # Keras reads variables from the innermost StatelessScope only: the meta mapping must be it.
        with recorder.patched(), keras.StatelessScope(state_mapping=mapping), on_device():
            outputs = model(inputs, training=False) if positional else model(
                **inputs, training=False)
        recorder.outputs = [info[0] for info in recorder.infos(outputs)]
    return recorder


def _record(model: keras.Model, batch: int) -> CallRecorder:
    try:
        return _record_forward(model, batch, meta=True)
    except Exception as exc:  # an op without a meta kernel
        logger.debug("memory_report: the meta-device trace of %r failed (%s); tracing "
                     "at batch %d on Keras's device", model.name, exc, batch)
        return _record_forward(model, batch, meta=False)


def trace_layer_calls(model: keras.Model) -> Trace:
    return trace_at_two_batches(model, lambda batch: _record(model, batch))
