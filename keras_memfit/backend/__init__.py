"""The backend seam: everything that depends on Keras's backend lives behind it.

keras_memfit's core (planning batch sizes, splitting and stitching batches,
retrying) is backend-neutral. What differs per backend is small and lives in
one module per backend, each offering the same functions:

- OOM detection: `is_oom_error(exc)`, `oom_error_bases()`, `init_oom_error()`;
- memory statistics: `compute_device()`, `memory_stats(device)`,
  `memory_limit(device)`;
- compiled steps: `make_predict_step(model, postprocess)`,
  `make_test_step(model)`, `output_spec(step, batch)`, `to_numpy(tensor)`,
  `prepare_test(model, batch)`;
- undoing a failed step: `guard_variables(variables)` (snapshot/restore);
- memory report: `trace_layer_calls(model)` (every layer/operation call of
  one symbolic forward pass, with tensor shapes and dtypes; nothing runs),
  and `variable_device(variable)` from the placement functions below;
- placement (`keras_memfit.place`): `host_device()`, `list_accelerators()`,
  `canonical_device(name)`, `device_exists(name)`, `device_scope(device)`,
  `variable_device(variable)`, `move_variable(variable, device)`,
  `creating_on(device, add_weight)` (new variables created on a device, even
  while tracing), `call_on_device(device, call)` (forward and gradient ops on
  a device), `slot_variables(optimizer, variable)`,
  `follow_variable_devices(optimizer)` (slots and updates on their
  variable's device), `probe_inputs(model)` (one zero sample in the
  structure the model is called with: a tensor, a list or a dict).

Only TensorFlow is implemented; `get()` names the backend in its error for the
others, so adding JAX or PyTorch means adding one module here.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional, Tuple

import keras
import numpy as np

_SUPPORTED = ("tensorflow",)


NO_SPEC = object()  # output_spec's answer for a step that cannot be traced


@dataclasses.dataclass(frozen=True)
class Spec:
    """Shape (None for unknown dimensions) and dtype of a traced output."""

    shape: Optional[Tuple[Optional[int], ...]]
    dtype: np.dtype


def name() -> str:
    """The name of Keras's active backend ("tensorflow", "jax", ...)."""
    return keras.backend.backend()


def get() -> types.ModuleType:
    """The keras_memfit backend module for Keras's active backend.

    Returns:
        The module implementing the seam for the active backend.

    Raises:
        NotImplementedError: If the active Keras backend is not supported yet.
    """
    active = name()
    if active == "tensorflow":
        from keras_memfit.backend import tensorflow

        return tensorflow
    raise NotImplementedError(
        f"keras_memfit supports the Keras backends {list(_SUPPORTED)}; the "
        f"active backend is {active!r}. Set KERAS_BACKEND=tensorflow before "
        "importing keras (JAX and PyTorch support are planned)."
    )
