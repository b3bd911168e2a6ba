"""Keeping layers on another device for `keras_memfit.place`: moving variables,
pinning calls (and their gradients) and optimizer slots to a device."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from keras_memfit.backend.tensorflow.devices import canonical_device, variable_device


def device_scope(device: str):
    return tf.device(device)


def move_variable(variable: Any, device: str) -> bool:
    """Recreate a built `keras.Variable`'s storage on `device`, keeping its value.

    The Keras variable object stays the same (layers, the optimizer and
    trackers hold it); only the `tf.Variable` inside is replaced. Functions
    traced before the move still hold the old one: reset them.

    Returns:
        Whether the variable was moved (False when it was already there or
        is not created yet).
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

    Keras creates slots on the current default device (on a GPU machine, the
    GPU) whatever device their variable lives on; this wraps the optimizer's
    `add_variable_from_reference` and `update_step` (instance attributes, once).
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
        if device is None:
            return update_step(gradient, variable, *args, **kwargs)
        with tf.device(device):
            return update_step(gradient, variable, *args, **kwargs)

    # Bypass Keras's attribute tracking: these are plain functions.
    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    object.__setattr__(optimizer, "update_step", update_step_on_device)
    object.__setattr__(optimizer, "_memfit_follows_devices", True)


def creating_on(device: str, add_weight: Callable) -> Callable:
    """`add_weight` creating its variable on `device`, even while a function is traced.

    A variable created while tracing is lifted out of the graph into eager
    mode, where the surrounding `tf.device` scope is lost, so the scope is
    re-entered inside `tf.init_scope`.
    """

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
            with tf.init_scope():
                move_variable(variable, device)
        return variable

    add_weight_on_device.__wrapped__ = add_weight
    return add_weight_on_device


@contextlib.contextmanager


def _pinning_new_ops(device: str) -> Iterator[None]:
    """Give the graph ops created inside, that no device scope reached, a device.

    Some gradient functions build part of their ops under
    `ops.colocate_with(...)`, which sets the `tf.device` scope aside: the
    gather gradient of TensorFlow 2.18 casts the table's shape there (a `Cast`
    with no device, left to the placer). Each such op gets the device of the
    op it is colocated with, when that one has a device, else `device`. In
    eager mode nothing is built, and nothing is done.
    """
    if tf.executing_eagerly():
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
    """`call` whose ops run on `device`, its gradients included.

    A `tf.device` scope around the forward pass does not reach its gradient
    ops, which `GradientTape` creates later under whatever scope is active
    (on a GPU machine, the GPU): the kernel gradient of a pinned Dense would
    be computed there and cross back. The call is therefore wrapped in a
    `tf.custom_gradient` whose backward pass runs under the same scope; an
    embedding keeps its sparse (IndexedSlices) gradient.
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
