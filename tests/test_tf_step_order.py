"""When MemFit's TensorFlow train step lets the optimizer update begin (its order).

`keras_memfit/backend/tensorflow/training.py`: in the *strict* order the
update waits for every gradient (any OOM before it is retriable); in the
*free* order it waits for the gradient computed first, so a weight's update
runs, and frees its gradient, while earlier layers' gradients are computed, as
in Keras's own step. Checked here against independent references:

- which order a call gets (gradient bytes counted by hand from the shapes);
- the compiled graphs: every write to a weight or slot depends on the flag
  that says the update began (also with weight decay, which reads no
  gradient), the free flag waits for fewer gradients than the strict one;
- both orders train what plain `model.fit` trains, for the optimizer variants
  (weight decay, clipping, gradient accumulation, EMA, mixed precision, a
  sparse Embedding gradient that must reach the optimizer as IndexedSlices);
- real OOMs (capped allocator): one before the update teaches the step the
  strict order and is retried (same weights as plain fit); one in the
  backward pass after a free update began is `UPDATE_BEGAN`, not retried;
- the accumulator's sums are released when the fit ends.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from support import BACKEND  # noqa: E402

pytestmark = [
    pytest.mark.tensorflow(reason="the TensorFlow train step's update order"),
    pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's train step"),
]

import keras_memfit  # noqa: E402
from keras_memfit import MemFit  # noqa: E402
from keras_memfit._internal import cache as _cache
from keras_memfit.training import layout as _training  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-7)
FREE, STRICT = (lambda model: (lambda rows: 0)), (lambda model: (lambda rows: None))


def _train_parts(model):
    return next(v for v in _cache._PER_MODEL[model].values() if hasattr(v, "step"))


def _step(model):
    return _train_parts(model).step


def _mlp(width=64, optimizer="adam", seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,))
    h = keras.layers.Dense(width, activation="relu")(inp)
    out = keras.layers.Dense(4)(keras.layers.Dense(width, activation="relu")(h))
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(n=64, dim=16, out=4):
    rng = np.random.default_rng(1)
    return rng.standard_normal((n, dim)).astype("float32"), rng.standard_normal(
        (n, out)
    ).astype("float32")


# ----------------------------------------------------------- which order
def test_wide_model_at_small_batch_runs_free_a_cnn_at_large_batch_strict():
    keras.utils.set_random_seed(0)
    inp = keras.Input((256,))
    wide = keras.Model(inp, keras.layers.Dense(256)(keras.layers.Dense(1024, activation="relu")(inp)))
    wide.compile(optimizer="adam", loss="mse")
    x = np.ones((16, 256), "float32")
    wide.fit(x, x, batch_size=8, verbose=0, callbacks=[MemFit()])
    step = _step(wide)
    # Gradient bytes beyond the largest (one 256x1024 kernel), by hand.
    assert step.strict_extra_bytes == (1024 + 1024 * 256 + 256) * 4
    assert list(step._steps) == [False]  # free only

    cnn = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
    cnn.compile(optimizer="adam", loss="mse")
    images, labels = np.ones((256, 28, 28, 1), "float32"), np.ones((256, 10), "float32")
    cnn.fit(images, labels, batch_size=256, verbose=0, callbacks=[MemFit()])
    assert list(_step(cnn)._steps) == [True]  # strict only: activations dominate


def test_a_failed_estimate_means_strict(monkeypatch):
    def broken(rows):
        raise RuntimeError("no trace")

    monkeypatch.setattr(_training, "training_peak", lambda model: broken)
    model = _mlp()
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[MemFit()])
    assert list(_step(model)._steps) == [True]


@pytest.mark.parametrize("row_share", [2.0, 0.5])
def test_one_row_runs_strict_where_its_activations_outweigh_the_gradients(monkeypatch, row_share):
    """An OOM at one row is met by recomputing layers, which frees at most one row's activations:
    strict (an OOM retriable) where they weigh more than what strict holds, else free."""
    model = _mlp()
    extra = (16 * 64 + 64 + 64 + 64 * 4 + 4) * 4  # the gradients beyond the 64 x 64 kernel's
    row = int(row_share * extra)  # estimated: one row's activations, nothing else
    monkeypatch.setattr(_training, "training_peak", lambda model: (lambda rows: rows * row))
    x, y = _data(n=16)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[MemFit()])
    step = _step(model)
    assert step.strict_extra_bytes == extra
    assert list(step._steps) == [False]  # 8 rows: the 2% rule
    model.fit(x[:2], y[:2], batch_size=1, verbose=0, callbacks=[MemFit()])
    assert list(step._steps) == ([False, True] if row_share > 1 else [False])


# ------------------------------------------------------- compiled graphs
def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        for parent in [t.op for t in o.inputs] + list(o.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "If", "StatelessIf")


@pytest.mark.parametrize("strict", [False, True], ids=["free", "strict"])
@pytest.mark.parametrize("optimizer", [
    "adam",
    lambda: keras.optimizers.AdamW(weight_decay=0.1),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0),
    lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
    lambda: keras.optimizers.Adam(use_ema=True),
], ids=["adam", "adamw", "global-clipnorm", "accumulation", "ema"])
def test_every_write_to_a_weight_or_slot_waits_for_the_flag(monkeypatch, strict, optimizer):
    monkeypatch.setattr(_training, "training_peak", STRICT if strict else FREE)
    model = _mlp(optimizer=optimizer if isinstance(optimizer, str) else optimizer())
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[MemFit()])
    step = _step(model)
    assert list(step._steps) == [strict]
    graph = step._steps[strict].get_concrete_function((x[:16], y[:16])).graph
    handles = {id(external): internal for external, internal in graph.captures}
    flag_handle = handles[id(step.update_began.handle)]
    big = [v for v in model.trainable_variables + model.optimizer.variables
           if int(np.prod(v.shape)) > 1]
    guarded = {handles[id(v.value.handle)].ref() for v in big if id(v.value.handle) in handles}
    flags = [op for op in graph.get_operations()
             if op.type == "AssignVariableOp" and op.inputs[0] is flag_handle]
    assert len(flags) == 1
    writes = [op for op in graph.get_operations()
              if op.type in _WRITES and any(t.ref() in guarded for t in op.inputs)]
    assert writes  # one per variable, or the cond of gradient accumulation
    for op in writes:
        assert flags[0] in _ancestors(op), op.name
    # Gradient ops feeding the update: the strict flag waits for all, the free one not.
    flag_before = _ancestors(flags[0])
    feeding = {o for w in writes for o in _ancestors(w) if o.name.startswith("gradient_tape")}
    waited = feeding & flag_before
    if strict:
        assert waited == feeding
    else:
        assert waited < feeding


def test_an_oom_while_the_sums_are_made_is_retried_as_plain_fit_trains(inject_oom, monkeypatch):
    """The first micro-batch makes the sums; an OOM after some of them leaves those (ResNet50
    at 160 x 160, batch 4 under 250 MiB); the retry makes the rest and trains as plain fit."""
    import tensorflow as tf

    from keras_memfit.backend.tensorflow import accumulation
    from support import oom_error

    x, y = _data()
    expected = _mlp()
    expected.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    made = []

    class TensorFlow:  # the module's `tf`, whose Variable raises once, at the third sum
        def __getattr__(self, name):
            return getattr(tf, name)

        def Variable(self, *args, **kwargs):
            made.append(1)
            if len(made) == 3:
                raise oom_error()
            return tf.Variable(*args, **kwargs)

    monkeypatch.setattr(accumulation, "tf", TensorFlow())
    inject_oom(16)
    model = _mlp()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[MemFit()])
    assert len(made) > 3  # the sums' making ran out of memory once, then went on
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------- same training as plain fit
class _Recorded(keras.optimizers.Adam):
    """Adam that notes the type of each gradient it is handed (at trace time)."""

    kinds = []

    def update_step(self, gradient, variable, learning_rate):
        _Recorded.kinds.append(type(gradient).__name__)
        return super().update_step(gradient, variable, learning_rate)


def _embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inp))
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=_Recorded(name="recorded_adam"), loss="mse")
    return model


VARIANTS = {
    "adamw": lambda: _mlp(optimizer=keras.optimizers.AdamW(weight_decay=0.1)),
    "clipnorm": lambda: _mlp(optimizer=keras.optimizers.Adam(clipnorm=0.1)),
    "global-clipnorm": lambda: _mlp(optimizer=keras.optimizers.Adam(global_clipnorm=0.1)),
    "accumulation": lambda: _mlp(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2)),
    "ema": lambda: _mlp(optimizer=keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=2)),
    "mixed-float16": "mixed_float16",
    "embedding": _embedding_model,
}


def variant_model(variant):
    """`(make, dtype_policy)` for `VARIANTS[variant]`."""
    make = VARIANTS[variant]
    if make == "mixed_float16":
        return _mlp, "mixed_float16"
    return make, "float32"


def variant_data(variant):
    """`(x, y)` for `VARIANTS[variant]`: token ids for the Embedding model."""
    if variant == "embedding":
        return np.random.default_rng(1).integers(0, 50, (64, 5)).astype("int32"), _data()[1]
    return _data()


@pytest.mark.parametrize("strict", [False, True], ids=["free", "strict"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_both_orders_train_what_plain_fit_trains(monkeypatch, variant, strict):
    make, policy = variant_model(variant)
    keras.config.set_dtype_policy(policy)
    try:
        x, y = variant_data(variant)
        expected = make()
        expected.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        _Recorded.kinds = []
        monkeypatch.setattr(_training, "training_peak", STRICT if strict else FREE)
        model = make()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[MemFit()])
    finally:
        keras.config.set_dtype_policy("float32")
    assert list(_step(model)._steps) == [strict]
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, **TOL)
    assert int(model.optimizer.iterations) == int(expected.optimizer.iterations) > 0
    if variant == "embedding":  # Keras hands Adam the sparse gradient; so does MemFit
        assert _Recorded.kinds[0] == "IndexedSlices", _Recorded.kinds


# ----------------------------------------------- accumulator's lifetime
def test_the_accumulator_is_made_when_a_batch_is_split_and_freed_when_fit_ends(inject_oom):
    model = _mlp()
    x, y = _data()
    model.fit(x, y, batch_size=32, verbose=0, callbacks=[MemFit()])
    assert _train_parts(model).accumulator is None  # nothing split: never made
    made = []
    inject_oom(16)

    class Watching(MemFit):
        def on_train_batch_end(self, batch, logs=None):
            accumulator = _train_parts(self.model).accumulator
            if accumulator is not None and not made:
                made.append(weakref.ref(accumulator))
                made.append(accumulator.steps)
                sizes.append([s.numpy().size for s in accumulator.steps.sums if s is not None])

    sizes = []
    model.fit(x, y, batch_size=32, verbose=0, callbacks=[Watching()])
    assert inject_oom.ooms("train") and made  # a batch was split: it was made
    assert _train_parts(model).accumulator is None
    gc.collect()
    assert made[0]() is None  # the accumulator is gone
    steps = made[1]
    weights = [int(np.prod(w.shape)) for w in model.trainable_weights]
    assert sizes == [weights]  # while it ran: one sum the size of each weight
    assert [s.numpy().size for s in steps.sums] == [0] * len(weights)  # now: their memory freed
    # The next fit's accumulator, on a piece of a size seen before: the same
    # compiled steps, nothing traced again (with jit_compile: nothing compiled).
    piece = max(r for r in inject_oom.ok_rows("train") if r <= 16)  # a micro-batch
    traces = steps.add.experimental_get_tracing_count()
    again = keras_memfit.backend.get().make_accumulator(model)
    assert again.steps is steps
    again.reset()
    again.add((x[:piece], y[:piece]), 1.0, 1.0)
    again.apply()
    assert steps.add.experimental_get_tracing_count() == traces
    assert [s.numpy().size for s in steps.sums] == weights
    del again
    assert [s.numpy().size for s in steps.sums] == [0] * len(weights)


# ------------------------------------------------------------ real OOMs
ROW_FLOATS = 2**21  # 8 MiB per row of the heavy op; 32 rows: 256 MiB > the cap
CAP_MB = 200


class _Heavy(keras.layers.Layer):
    """Identity whose forward (or backward) also makes a [rows, ROW_FLOATS] tensor."""

    def __init__(self, where="", **kwargs):
        super().__init__(**kwargs)
        self.where = where

    def call(self, x):
        import tensorflow as tf

        def heavy(t):
            big = tf.tile(t[:, :1], [1, ROW_FLOATS])
            return 0.0 * tf.reduce_sum(big, axis=1, keepdims=True)

        if self.where == "forward":
            return x + tf.stop_gradient(heavy(x))
        if self.where != "backward":
            return x

        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), lambda dy: dy + heavy(dy)

        return identity(x)


def _heavy_model(where):
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = _Heavy(where)(keras.layers.Dense(16, activation="relu")(inp))
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(h)))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.memory_cap(CAP_MB)
def test_an_oom_before_the_update_teaches_strict_and_is_retried(monkeypatch):
    x, y = _data()
    expected = _heavy_model("")  # the same computation without the heavy tensor
    expected.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    monkeypatch.setattr(_training, "training_peak", FREE)
    model = _heavy_model("forward")
    memfit = MemFit()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[memfit])
    assert any(e["kind"] == "oom" for e in memfit.events), memfit.events
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The batch ran again as accumulated micro-batches; the step itself learnt
    # that the batch drives memory: its next call runs strict.
    step = _step(model)
    assert step.always_strict and list(step._steps) == [False]
    step((x[:8], y[:8]))
    assert set(step._steps) == {False, True}


@pytest.mark.memory_cap(CAP_MB)
def test_an_oom_after_a_free_update_began_is_update_began_and_not_retried(monkeypatch):
    from keras_memfit.backend.base import StepOutcome

    x, y = _data()
    monkeypatch.setattr(_training, "training_peak", FREE)
    model = _heavy_model("backward")
    with pytest.raises(keras_memfit.OutOfMemoryError, match="once the optimizer update of a step on"):
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[MemFit()])
    step = _step(model)
    assert step.last_outcome is StepOutcome.UPDATE_BEGAN
    assert list(step._steps) == [False]  # not run again (a retry would be strict)
