"""Keras's default TensorFlow train step, in the parts MemFit's steps are made of."""

from __future__ import annotations

from typing import Any, Callable, List

import keras
import tensorflow as tf
from keras.src.losses.loss import unscale_loss_for_distribution

from keras_memfit._internal import keras_compat as _keras_compat


def _rows(x: Any) -> Any:
    return tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]


def forward_loss(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> tuple:
    """`(y_pred, loss)`: the forward pass in training mode and the compiled loss."""
    if _keras_compat.call_has_training_arg(model):
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    return y_pred, _keras_compat.compute_loss(model, x, y, y_pred, sample_weight)


def track_loss(model: keras.Model, loss: Any, x: Any) -> None:
    """Update the loss tracker as Keras's train step does (the loss unscaled by the strategy)."""
    _keras_compat.loss_tracker(model).update_state(
        unscale_loss_for_distribution(loss), sample_weight=_rows(x)
    )


def loss_and_gradients(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> tuple:
    """`(y_pred, loss, gradients)`: the forward pass and the (scaled) loss's gradients."""
    with tf.GradientTape() as tape:
        y_pred, loss = forward_loss(model, x, y, sample_weight)
        scaled = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
    weights = model.trainable_weights
    gradients = tape.gradient(scaled, weights) if weights else []
    return y_pred, loss, gradients


def ordered_after(op: Any, data: Any) -> Any:
    """`data`, read only once `op` ran."""
    with tf.control_dependencies([op]):
        return keras.tree.map_structure(lambda t: None if t is None else tf.identity(t), data)


def _tensors(gradient: Any) -> List[Any]:
    """The dense tensors of a gradient (a `tf.IndexedSlices`'s values and indices)."""
    if isinstance(gradient, tf.IndexedSlices):
        return [gradient.values, gradient.indices]
    return [gradient]


def flagged_train_step(
    model: keras.Model, data: Any, flag: Callable[[], Any], *, strict: bool = True
) -> Any:
    """Keras's default train step on `data`, `flag()` run before any op of the optimizer update.

    `strict`: the flag waits for every gradient; else only for the first computed one.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred, loss, gradients = loss_and_gradients(model, x, y, sample_weight)
    weights = model.trainable_weights
    if weights:
        present = [g for g in gradients if g is not None]
        waited = present if strict else present[-1:]
        with tf.control_dependencies([t for g in waited for t in _tensors(g)]):
            began = flag()
        with tf.control_dependencies([began]):
            model.optimizer.apply_gradients(zip(gradients, weights))
    track_loss(model, loss, x)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
