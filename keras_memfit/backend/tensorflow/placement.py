"""Keeping layers on another device for `keras_memfit.place`: variables, calls, gradients, slots."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from keras_memfit.backend.tensorflow.devices import canonical_device, variable_device


def device_scope(device: str):
    return tf.device(device)


def move_variable(variable: Any, device: str) -> bool:
    """Recreate a built `keras.Variable`'s `tf.Variable` on `device` (old traces keep the old one).

    Returns:
        Whether it moved (not when already there or not created yet).
    """
    old = getattr(variable, "_value", None)
    if old is None or canonical_device(old.device) == device:
        return False
    with tf.init_scope(), tf.device(device):
        new = tf.Variable(
            old.read_value(),
            dtype=old.dtype,
            trainable=old.trainable,
            name=old.name.split(":")[0],
            aggregation=old.aggregation,
            synchronization=old.synchronization,
        )
    variable._value = new
    return True


def follow_variable_devices(optimizer: Any) -> None:
    """Make `optimizer` create each slot, and run each update, on its variable's device.

    Keras would create slots on the default device, wherever their variable lives.
    """
    if optimizer is None or getattr(optimizer, "_memfit_follows_devices", False):
        return
    add_from_reference = optimizer.add_variable_from_reference
    update_step = optimizer.update_step

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        device = variable_device(reference_variable)
        if device is None:
            return add_from_reference(reference_variable, *args, **kwargs)
        with tf.init_scope(), tf.device(device):
            slot = add_from_reference(reference_variable, *args, **kwargs)
            if isinstance(slot, keras.Variable):
                move_variable(slot, device)  # in case the scope was lost
        return slot

    def update_step_on_device(gradient, variable, *args, **kwargs):
        device = variable_device(variable)
        with contextlib.nullcontext() if device is None else tf.device(device):
            return update_step(gradient, variable, *args, **kwargs)

    # Bypass Keras's attribute tracking.
    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    object.__setattr__(optimizer, "update_step", update_step_on_device)
    object.__setattr__(optimizer, "_memfit_follows_devices", True)


def creating_on(device: str, add_weight: Callable) -> Callable:
    """`add_weight` creating its variable on `device`, even while a function is traced."""

    def add_weight_on_device(*args, **kwargs):
        with tf.init_scope(), tf.device(device):
            variable = add_weight(*args, **kwargs)
        if not isinstance(variable, keras.Variable):
            return variable
        if variable._value is None:  # deferred (symbolic build): created later
            initialize = variable._deferred_initialize

            def deferred_initialize():
                with tf.init_scope(), tf.device(device):
                    initialize()

            object.__setattr__(variable, "_deferred_initialize", deferred_initialize)
        else:  # created, not read yet: safe to move
            move_variable(variable, device)
        return variable

    add_weight_on_device.__wrapped__ = add_weight
    return add_weight_on_device


@contextlib.contextmanager
def _pinning_new_ops(device: str) -> Iterator[None]:
    """Give the graph ops created inside with no device (`colocate_with` drops the scope) one.

    Each gets the device of the op it is colocated with, else `device`.
    """
    if tf.executing_eagerly():  # no graph op is made: nothing to list
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    before = {id(op) for op in graph.get_operations()}
    yield
    for op in graph.get_operations():
        if id(op) in before or op.device:
            continue
        target = tf.DeviceSpec.from_string(device).to_string()  # as tf.device writes it
        for group in op.colocation_groups():
            name = group.decode().split("@", 1)[-1]
            try:
                colocated = graph.get_operation_by_name(name)
            except (KeyError, ValueError):
                continue
            if colocated.device:
                target = colocated.device
                break
        op._set_device(target)  # what a tf.device scope does to new ops


def call_on_device(device: str, call: Callable) -> Callable:
    """`call` whose ops run on `device`, its gradients included (a `tf.custom_gradient`).

    A `tf.device` scope does not reach the gradient ops `GradientTape` creates later.
    """

    def call_here(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        inputs = [i for i, t in enumerate(flat)
                  if tf.is_tensor(t) and not isinstance(t, tf.SparseTensor)
                  and t.dtype.is_floating]

        @tf.custom_gradient
        def forward(*xs):
            leaves = list(flat)
            for i, x in zip(inputs, xs):
                leaves[i] = x
            a, k = tf.nest.pack_sequence_as((args, kwargs), leaves)
            with tf.device(device), tf.GradientTape() as tape:
                tape.watch(xs)
                out = call(*a, **k)

            def backward(*upstream, variables=None):
                variables = list(variables or [])
                with tf.device(device), _pinning_new_ops(device):
                    grads = tape.gradient(
                        out, list(xs) + variables,
                        output_gradients=tf.nest.pack_sequence_as(out, list(upstream)),
                    )
                return grads[: len(xs)], grads[len(xs):]

            return out, backward

        return forward(*[flat[i] for i in inputs])

    return call_here
