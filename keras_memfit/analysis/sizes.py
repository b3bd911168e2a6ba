"""The one byte counter (`ByteCounter`) and the one optimizer-slot counter (`slot_bytes`)."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Dict, Optional, Sequence

import keras

logger = logging.getLogger("keras_memfit")


def size(shape: Sequence[Optional[int]]) -> int:
    """Number of elements of `shape`; unknown (None) dimensions count as 1."""
    return math.prod(1 if d is None else int(d) for d in shape)


def dtype_name(dtype: Any) -> str:
    """The name of a dtype given as a string, a numpy, Keras or backend dtype."""
    return getattr(dtype, "name", None) or str(dtype)


def itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype` ("bool" 1, "float16" 2, "int64" 8; 4 if unknown)."""
    name = dtype_name(dtype)
    if name == "bool":
        return 1
    bits = re.findall(r"\d+", name)
    return max(1, int(bits[-1]) // 8) if bits else 4


def dtype_policy(value: Any) -> Any:
    """`value` as a `keras.DTypePolicy` (None stays None); `ValueError` if it names none."""
    if value is None:
        return None
    try:
        return keras.dtype_policies.get(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            "dtype_policy must be None, a dtype policy name such as 'mixed_float16' "
            f"or a keras.DTypePolicy; received dtype_policy={value!r} ({exc})"
        ) from None


class ByteCounter:
    """Bytes of tensors and variables; floating ones at a `policy`'s compute or variable dtype."""

    def __init__(self, policy: Any = None) -> None:
        self._compute = None if policy is None else itemsize(policy.compute_dtype)
        self._variable = None if policy is None else itemsize(policy.variable_dtype)

    def tensor(self, shape: Sequence[Optional[int]], dtype: Any) -> int:
        """Bytes per sample of a tensor whose `shape` includes the batch dimension."""
        return _bytes(tuple(shape)[1:], dtype, self._compute)

    def variable(self, variable: Any) -> int:
        """Bytes of a variable (anything with `shape` and `dtype`)."""
        return _bytes(variable.shape, variable.dtype, self._variable)


def _bytes(shape: Sequence[Optional[int]], dtype: Any, floating_item: Optional[int]) -> int:
    """Bytes of `shape` elements, a floating one `floating_item` bytes where given."""
    use_policy = floating_item is not None and "float" in dtype_name(dtype)
    return size(shape) * (floating_item if use_policy else itemsize(dtype))


class _SlotStandIn:
    """What the recording optimizer copy gets instead of a slot variable."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


def slot_bytes(model: keras.Model, counter: ByteCounter) -> Dict[int, int]:
    """Optimizer slot bytes per trainable variable `id`, counted on a copy that allocates none."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return {}
    # A LossScaleOptimizer's own variables are scalars: its inner optimizer's slots count.
    optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer
    trainable = list(model.trainable_variables)
    if not trainable:
        return {}
    by_ref: Dict[int, int] = {}
    pooled = 0
    try:
        clone = type(optimizer).from_config(optimizer.get_config())

        def from_reference(reference_variable, name=None, initializer="zeros"):
            key = id(reference_variable)  # its slot: a variable of its shape and dtype
            by_ref[key] = by_ref.get(key, 0) + counter.variable(reference_variable)
            return _SlotStandIn(reference_variable.shape, reference_variable.dtype)

        def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                         layout=None, name=None, **kwargs):
            nonlocal pooled
            stand_in = _SlotStandIn(shape, dtype or "float32")
            pooled += counter.variable(stand_in)
            return stand_in

        object.__setattr__(clone, "add_variable_from_reference", from_reference)
        object.__setattr__(clone, "add_variable", add_variable)
        clone.build(trainable)
    except Exception as exc:  # a custom optimizer that cannot be copied this way
        by_ref.clear()
        if not getattr(optimizer, "built", False):
            logger.warning(
                "could not count the slots of %s (%s: %s); they are "
                "counted as 0 until the optimizer is built", type(optimizer).__name__,
                type(exc).__name__, exc)
            return {}
        pooled = sum(
            counter.variable(v) for v in optimizer.variables if size(v.shape) > 1
        )
    if pooled:  # slots not tied to one variable: shared in proportion to size
        total = sum(counter.variable(v) for v in trainable) or 1
        for v in trainable:
            by_ref[id(v)] = by_ref.get(id(v), 0) + round(pooled * counter.variable(v) / total)
    return by_ref
