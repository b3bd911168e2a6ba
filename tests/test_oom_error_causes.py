"""`OutOfMemoryError` states its cause: its first sentence, its figures, its advice.

Each cause (one sample does not fit; the optimizer update of an accumulated
batch; a step whose update had begun; a batch MemFit cannot split) is raised
on its real path where one exists on the active backend (fault injection,
`inject_oom`), else constructed directly. The advice names
`keras_memfit.place` only where `place` works: on TensorFlow, outside a
distribution strategy; on JAX and torch `place` raises NotImplementedError.
"""

from __future__ import annotations

import pickle
import re

import keras
import numpy as np
import pytest

import keras_memfit
from keras_memfit import MemFit, OutOfMemoryError
from keras_memfit import oom as oom_module
from memfit_support import BATCH, FEATURES, THRESHOLD, _classifier, _data
from support import BACKEND, backend_module, oom_error, oom_error_class, requires_tensorflow

PLACE = "keras_memfit.place(model)"


def first_sentence(err: BaseException) -> str:
    """The message up to its first full stop that ends a sentence."""
    return re.split(r"(?<=\.) (?=[A-Z])", str(err), maxsplit=1)[0]


def assert_advice_fits_backend(err: BaseException) -> None:
    message = str(err)
    assert "What to do next:" in message
    if BACKEND == "tensorflow":
        assert PLACE in message
    else:
        assert "place(" not in message


def make(cause, **overrides):
    kwargs = dict(model_name="net", phase="train", batch_shape=[(1, FEATURES)],
                  device="GPU:0", cause=cause, rows=BATCH)
    kwargs.update(overrides)
    return OutOfMemoryError(**kwargs)


# ---------------------------------------------------------------------------
# Where place is advised: where the backend has the placement capability
# ---------------------------------------------------------------------------
def test_placement_is_a_capability_of_tensorflow_only():
    backend = backend_module()
    if backend.placement is not None:
        with backend.placement.device_scope(backend.host_device()):
            pass
    assert (backend.placement is not None) is (BACKEND == "tensorflow")


def test_no_place_advice_where_place_is_refused():
    err = make(oom_module.ONE_SAMPLE, phase="predict", can_place=False)
    assert "place(" not in str(err)
    assert "mixed_float16" in str(err)  # the rest of the advice stays


# ---------------------------------------------------------------------------
# One sample does not fit (safe_predict, MemFit)
# ---------------------------------------------------------------------------
def test_one_sample_in_predict_names_the_sample_and_keeps_the_weights(inject_oom):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3)], name="wide")
    weights = [np.array(w) for w in model.get_weights()]
    inject_oom(0)
    with pytest.raises(OutOfMemoryError) as info:
        keras_memfit.safe_predict(model, np.ones((20, FEATURES), "float32"), batch_size=20,
                                  verbose=0)
    err = info.value
    assert err.cause == "one_sample"
    first = first_sentence(err)
    assert first.startswith("Model 'wide' ran out of memory in predict on ")
    assert f"even with a batch of a single sample (input shape (1, {FEATURES}))" in first
    assert "one sample does not fit" in first
    assert "The model's weights are unchanged." in str(err)
    assert_advice_fits_backend(err)
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_one_sample_in_fit_says_the_training_state_is_kept(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(0, phases=("train",))
    with pytest.raises(OutOfMemoryError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    err = info.value
    assert err.cause == "one_sample" and err.phase == "train"
    assert f"single sample (input shape (1, {FEATURES}))" in first_sentence(err)
    assert "The training state is as it was before this step" in str(err)
    assert "partly updated" not in str(err)
    assert_advice_fits_backend(err)
    assert int(np.array(model.optimizer.iterations)) == 0  # as the message says


# ---------------------------------------------------------------------------
# The optimizer update of an accumulated batch
# ---------------------------------------------------------------------------
def test_update_oom_names_the_batch_and_says_the_weights_may_be_updated(
    inject_oom, monkeypatch
):
    backend = backend_module()

    def out_of_memory(self):
        raise oom_error()

    monkeypatch.setattr(backend.training.GradientAccumulator, "apply", out_of_memory)
    x, y, _ = _data()
    model = _classifier()
    inject_oom(THRESHOLD, phases=("train",))  # the batch is split, then accumulated
    with pytest.raises(OutOfMemoryError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    err = info.value
    assert err.cause == "update" and err.rows == BATCH
    first = first_sentence(err)
    assert f"in the optimizer update of a batch of {BATCH} rows" in first
    assert f"(one sample's input shape (1, {FEATURES}))" in first
    assert "single sample" not in str(err)  # not the one-sample message
    assert "does not depend on the batch size" in str(err)
    lost = "may be lost" if BACKEND == "jax" else "may be partly updated"
    assert f"The weights and optimizer slots {lost}" in str(err)
    assert "use a smaller batch_size" not in str(err)  # it would not help
    assert_advice_fits_backend(err)
    assert isinstance(err, oom_error_class())


def test_sums_that_do_not_fit_name_the_batch_keep_the_weights_and_advise_shrink(
    inject_oom, monkeypatch
):
    # Measured for real on JAX (benchmarks.footprint, 3 GiB address space,
    # W=80,112 at batch 8): the batch did not fit, and then neither did the
    # sums of its micro-batches' gradients (the size of the weights).
    backend = backend_module()
    made = []

    def out_of_memory(self):
        made.append(self)
        raise oom_error()

    monkeypatch.setattr(backend.training.GradientAccumulator, "reset", out_of_memory)
    x, y, _ = _data()
    model = _classifier()
    before = [np.array(w) for w in model.get_weights()]
    inject_oom(THRESHOLD, phases=("train",))  # the batch is split: sums are needed
    with pytest.raises(OutOfMemoryError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    err = info.value
    assert made, "the sums were never made: the test did not reach them"
    assert err.cause == "accumulate" and err.rows == BATCH
    first = first_sentence(err)
    assert f"making room to accumulate a batch of {BATCH} rows" in first
    assert f"(one sample's input shape (1, {FEATURES}))" in first
    assert "The training state is as it was before this step" in str(err)
    assert "MemFit(mode='shrink')" in str(err)
    assert_advice_fits_backend(err)
    assert isinstance(err, oom_error_class())
    assert int(np.array(model.optimizer.iterations)) == 0  # as the message says
    for got, expected in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, expected)


def test_accumulate_where_shrink_is_refused_does_not_advise_it():
    """Several JAX processes refuse MemFit(mode="shrink"): the advice leaves it out."""
    err = make(oom_module.ACCUMULATE, rows=BATCH, can_shrink=False)
    assert "shrink" not in str(err) and "use a batch_size that fits whole" in str(err)


def test_update_oom_that_held_rows_says_they_grow_with_the_batch():
    held = "80 rows of 'emb/embeddings' (1.2 KiB)"
    err = make(oom_module.UPDATE, held=held)
    assert f"The update held {held}; these grow with the batch size" in str(err)
    assert "does not depend on the batch size" not in str(err)
    assert "use a smaller batch_size" in str(err)


# ---------------------------------------------------------------------------
# A step whose optimizer update had begun
# ---------------------------------------------------------------------------
@requires_tensorflow  # on JAX and torch an injected late OOM comes before the update
def test_update_began_names_the_step_and_is_not_retried(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(THRESHOLD, after=True, phases=("train",))
    with pytest.raises(OutOfMemoryError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[MemFit()])
    err = info.value
    assert err.cause == "update_began" and err.rows == BATCH
    assert (f"once the optimizer update of a step on {BATCH} rows had begun"
            in first_sentence(err))
    assert "so MemFit does not run the batch again" in str(err)
    assert "restore them (e.g. from a checkpoint)" in str(err)
    assert_advice_fits_backend(err)
    assert len(inject_oom.ooms("train")) == 1  # not retried


def test_update_began_on_this_backend_says_what_is_left_of_the_weights():
    message = str(make(oom_module.UPDATE_BEGAN, rows=12))
    assert "once the optimizer update of a step on 12 rows had begun" in message
    where = {"tensorflow": "in the backward pass while later layers' updates ran",
             "jax": "in the previous step's update"}.get(BACKEND, "applies to the weights in place")
    assert where in message
    expected = {"jax": "may be lost", "tensorflow": "may be partly updated (or lost under "
                "jit_compile"}.get(BACKEND, "may be partly updated, so")
    assert expected in message


# ---------------------------------------------------------------------------
# A batch MemFit cannot split
# ---------------------------------------------------------------------------
@requires_tensorflow  # tf.SparseTensor input through TensorFlow's train_function
def test_cannot_split_names_what_was_received_and_why():
    import tensorflow as tf

    inputs = keras.Input((4,), sparse=True)
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs), name="sparse_net")
    model.compile(optimizer="sgd", loss="mse")

    def out_of_memory(*args, **kwargs):
        raise oom_error()

    model.train_function = out_of_memory  # Keras's own step runs out of memory
    x = tf.sparse.from_dense(np.ones((8, 4), "float32"))
    with pytest.raises(tf.errors.ResourceExhaustedError) as info:
        model.fit(x, np.zeros((8, 3), "float32"), batch_size=8, verbose=0,
                  callbacks=[MemFit()])
    err = info.value
    assert isinstance(err, OutOfMemoryError) and err.cause == "cannot_split"
    assert err.phase == "train"
    assert first_sentence(err).startswith(
        "Model 'sparse_net' ran out of memory in train on a batch that MemFit cannot split")
    assert "Received: x=SparseTensor(shape=(8, 4), dtype=float32)" in str(err)
    assert "MemFit splits numpy arrays and dense tensors" in str(err)
    assert "may be partly updated" in str(err)
    assert "make the input dense" in str(err)
    assert "place(" not in str(err)  # the advice is about the batch


def test_cannot_split_in_evaluate_on_this_backend_says_what_is_left():
    err = make(oom_module.CANNOT_SPLIT, phase="evaluate", batch_shape=(), device=None,
               rows=None, received="x=SparseTensor(shape=(8, 4), dtype=float32)")
    if BACKEND == "jax":  # Keras's JAX steps donate the state
        assert "may have lost it" in str(err)
    else:
        assert "The model's weights are unchanged." in str(err)


# ---------------------------------------------------------------------------
# Every cause: catchable as the backend's OOM, picklable, one cause each
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("cause", oom_module.CAUSES)
def test_every_cause_is_the_backends_oom_and_round_trips(cause):
    err = make(cause, held="3 rows" if cause == oom_module.UPDATE else None,
               received="x=RaggedTensor" if cause == oom_module.CANNOT_SPLIT else None)
    with pytest.raises(oom_error_class()):
        raise err
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is OutOfMemoryError
    assert (back.cause, back.rows, str(back)) == (cause, err.rows, str(err))
    sentences = re.split(r"(?<=\.) (?=[A-Z])", str(err))
    assert len(sentences) == len(set(sentences))  # no sentence twice


def test_an_unknown_cause_is_refused():
    with pytest.raises(ValueError, match=r"cause must be one of .*received 'disk'"):
        make("disk")
