"""A model's own `train_step` under MemFit, as third-party code writes it.

The models are written the way keras-io writes them: an autoencoder whose
`train_step` reads its batch as `x` itself (no targets), on each backend in
that backend's own form (a `tf.GradientTape`, `loss.backward()`, JAX's
functional step), and the keras-io VAE (`examples/generative/vae.py`: an
encoder and a decoder as attributes, no `call()`, its losses computed by its
`train_step`). The reference is always plain Keras on the same data, from
the same initial weights: with no memory pressure MemFit must train exactly
as Keras does; under pressure a custom step trains as Keras would with the
smaller batch size (docs/training.md, "A model's own `train_step`").
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from keras_memfit import MemFit
from support import BACKEND

RTOL = 1e-5
ATOL = 1e-6
SEED = 11
DIM = 6


class AutoEncoder(keras.Model):
    """Reconstructs `x`; its `train_step` takes the batch as `x`, as Keras hands it.

    `seen` records the type of every batch the step received (at each trace
    on TensorFlow and JAX, at each call on torch).
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(3, activation="tanh")
        self.out = keras.layers.Dense(DIM)
        self.tracker = keras.metrics.Mean(name="loss")
        self.seen = []

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.tracker]

    if BACKEND == "jax":
        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_variables, metrics_variables = state
            self.seen.append(type(data).__name__)
            x = data

            def loss_fn(trainable, non_trainable):
                y, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                       training=True)
                return ops.mean(ops.square(y - x)), non_trainable

            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable)
            metrics_variables = self.tracker.stateless_update_state(metrics_variables, loss)
            logs = {"loss": self.tracker.stateless_result(metrics_variables)}
            return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)
    elif BACKEND == "torch":
        def train_step(self, data):
            import torch

            self.seen.append(type(data).__name__)
            x = data
            self.zero_grad()
            loss = ops.mean(ops.square(self(x, training=True) - x))
            loss.backward()
            weights = self.trainable_weights
            with torch.no_grad():
                self.optimizer.apply([w.value.grad for w in weights], weights)
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}
    else:
        def train_step(self, data):
            import tensorflow as tf

            self.seen.append(type(data).__name__)
            x = data
            with tf.GradientTape() as tape:
                loss = ops.mean(ops.square(self(x, training=True) - x))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}


def _autoencoder():
    keras.utils.set_random_seed(SEED)
    model = AutoEncoder()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def _x(n=40):
    return np.random.default_rng(0).normal(size=(n, DIM)).astype("float32")


def _assert_same(model, history, reference, ref_history):
    assert history.history.keys() >= ref_history.history.keys()
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=RTOL, atol=ATOL,
                                   err_msg=key)
    for a, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)


def test_a_train_step_without_targets_gets_the_batch_keras_gives_it_and_trains_as_keras():
    reference = _autoencoder()
    ref_history = reference.fit(_x(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _autoencoder()
    history = model.fit(_x(), batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[MemFit()])
    assert set(model.seen) == set(reference.seen), "the batch is not packed as Keras packs it"
    _assert_same(model, history, reference, ref_history)


def test_a_train_step_without_targets_trains_as_keras_at_the_smaller_batch_under_pressure(
        inject_oom):
    # Batches of 16 run out of memory, 8 fits: a custom step cannot be
    # accumulated, so it trains as Keras does with batch_size=8 (docs/training.md's
    # promise for custom steps), and every piece is still a bare `x`.
    reference = _autoencoder()
    ref_history = reference.fit(_x(), batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _autoencoder()
    inject_oom(8)
    history = model.fit(_x(), batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[MemFit(mode="shrink")])
    assert inject_oom.ooms("train")
    assert set(inject_oom.ok_rows("train")) == {8}
    assert set(model.seen) == set(reference.seen)
    _assert_same(model, history, reference, ref_history)


# --------------------------------------------------------------------------
# keras-io's VAE: no call(), its own train_step (TensorFlow: tf.GradientTape)
# --------------------------------------------------------------------------
class _Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras-io's VAE (examples/generative/vae.py), smaller: no call()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(inputs)
        x = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(x))
        z_mean, z_log_var = keras.layers.Dense(2)(x), keras.layers.Dense(2)(x)
        self.encoder = keras.Model(inputs, [z_mean, z_log_var, _Sampling()([z_mean, z_log_var])])
        latent = keras.Input((2,))
        x = keras.layers.Reshape((4, 4, 4))(keras.layers.Dense(64, activation="relu")(latent))
        outputs = keras.layers.Conv2DTranspose(1, 3, strides=2, padding="same",
                                               activation="sigmoid")(x)
        self.decoder = keras.Model(latent, outputs)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def _vae():
    keras.utils.set_random_seed(SEED)
    model = VAE()
    model.compile(optimizer=keras.optimizers.Adam())
    return model


@pytest.mark.tensorflow(reason="keras-io's VAE computes its gradients with tf.GradientTape")
def test_kerasio_vae_without_call_trains_under_memfit_as_keras_trains_it():
    x = np.random.default_rng(1).uniform(size=(40, 8, 8, 1)).astype("float32")
    reference = _vae()
    ref_history = reference.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _vae()
    history = model.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[MemFit()])
    _assert_same(model, history, reference, ref_history)
