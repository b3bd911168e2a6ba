"""The torch backend behind the seam: MemFit's exact accumulation, what a failed
step leaves, the refusals (`place`, `torch.distributed`), `jit_compile=True`
and `memory_report`'s trace.

Each test runs in a child process with Keras on torch (`tests/torch_support.py`).
OOMs are the CPU allocator's real error object (a failed allocation), raised
where a real one strikes: in the backward pass of a batch over a threshold,
after the forward pass updated the loss tracker. The references are plain
Keras's fit on the unsplit batches and Keras's own layer shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch_support import (
    assert_same_state,
    requires_torch,
    run_in_torch,
    small_data,
    small_model,
    state,
)
from tests.support import assert_same_training

pytestmark = requires_torch


def _real_cpu_oom():
    import torch

    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("a petabyte was allocated")


class _BackwardOOM:
    """Makes `backward()` raise the CPU allocator's real error when the forward
    pass just before it had more than `threshold` rows (as a real OOM of the
    backward pass: the loss tracker was already updated)."""

    def __init__(self, threshold):
        import torch

        from keras_memfit.backend.torch import training

        self.threshold, self.rows, self.raised = threshold, 0, 0
        forward, backward = training._forward_loss, torch.Tensor.backward

        def recording_forward(model, x, y, sample_weight, *args):
            self.rows = training._rows(x)
            return forward(model, x, y, sample_weight, *args)

        def failing_backward(tensor, *args, **kwargs):
            if self.threshold is not None and self.rows > self.threshold:
                self.raised += 1
                raise _real_cpu_oom()
            return backward(tensor, *args, **kwargs)

        training._forward_loss = recording_forward
        torch.Tensor.backward = failing_backward


# ------------------------------------------------------------------ children
def child_import_and_errors():
    import keras
    import torch

    import keras_memfit
    from keras_memfit import OutOfMemoryError, backend

    assert keras.backend.backend() == "torch"
    assert backend.get().__name__ == "keras_memfit.backend.torch"
    err = OutOfMemoryError("m", "predict", [(1, 12)])
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, RuntimeError)
    assert keras_memfit.is_oom_error(err) and not keras_memfit.oom.is_retryable_oom(err)
    # The CPU allocator's error inside a layer, as Keras re-raises it.
    layer = keras.layers.Dense(4)
    layer.build((None, 3))
    original = layer.call

    def call(inputs):
        torch.empty(1 << 50, dtype=torch.uint8)
        return original(inputs)

    layer.call = call
    try:
        layer(np.ones((2, 3), "float32"))
    except RuntimeError as wrapped:
        assert "Exception encountered when calling" in str(wrapped), str(wrapped)[:200]
        assert keras_memfit.is_oom_error(wrapped)
    else:
        raise AssertionError("the layer did not raise")
    assert not keras_memfit.is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _fit_pair(threshold, batch_size=64, epochs=2, **fit_kwargs):
    """(MemFit fit under injected backward OOMs, plain Keras fit): models and Histories."""
    import keras_memfit

    x, y = small_data(160)
    reference = small_model()
    expected = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                             verbose=0, **fit_kwargs).history
    model = small_model()
    injector = _BackwardOOM(threshold)
    memfit = keras_memfit.MemFit()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[memfit], **fit_kwargs).history
    injector.threshold = None
    assert injector.raised >= 1, "no OOM was injected: the test proves nothing"
    assert any(e["kind"] == "oom" for e in memfit.events)
    return model, history, reference, expected


def child_memfit_accumulates_exactly():
    model, history, reference, expected = _fit_pair(20)
    assert max(history["memfit_split"]) > 1
    assert_same_training(model, history, reference, expected, iterations=6)
    # Weights and class weights.
    sample_weight = np.linspace(0.2, 2.0, 160).astype("float32")
    model, history, reference, expected = _fit_pair(20, sample_weight=sample_weight)
    assert_same_training(model, history, reference, expected, iterations=6)
    model, history, reference, expected = _fit_pair(20, class_weight={0: 0.5, 1: 2.0, 2: 1.0})
    assert_same_training(model, history, reference, expected, iterations=6)


def child_memfit_without_pressure_is_plain_keras():
    import keras_memfit

    x, y = small_data(160)
    reference, model = small_model(), small_model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, validation_split=0.25,
                             shuffle=False, verbose=0).history
    history = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, shuffle=False,
                        verbose=0, callbacks=[keras_memfit.MemFit()]).history
    assert set(history) == set(expected)
    assert_same_training(model, history, reference, expected, iterations=8)
    # Keras's own functions are back.
    assert model.train_function.__name__ == "one_step_on_data"
    np.testing.assert_allclose(
        keras_memfit.safe_predict(model, x, batch_size=64, verbose=0),
        reference.predict(x, batch_size=16, verbose=0), rtol=1e-5, atol=1e-6)


def child_failed_step_leaves_model_metrics_and_gradients():
    """The backward pass runs out of memory after the loss tracker was updated:
    the step restores it (and every variable), drops its gradients and says
    RESTORED; the same step then trains as Keras's."""
    from keras_memfit import backend
    from keras_memfit.backend.base import StepOutcome

    x, y = small_data(64)
    model, reference = small_model(), small_model()
    for m in (model, reference):
        m.train_on_batch(x[:8], y[:8])
    before = state(model)
    step = backend.get().make_train_step(model)
    injector = _BackwardOOM(16)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        step((x, y))
    assert injector.raised == 1
    assert step.last_outcome is StepOutcome.RESTORED
    assert_same_state(before, model)  # the loss tracker too
    assert all(w.value.grad is None for w in model.trainable_weights)
    logs = step((x[:16], y[:16]))
    expected = reference.train_on_batch(x[:16], y[:16], return_dict=True)
    # train_on_batch resets the metrics first: the loss tracker holds this batch only
    # for the reference; the step's accumulates (the first batch and this one).
    assert set(logs) >= {"loss", "accuracy"}
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert expected["loss"] > 0


def child_an_oom_in_the_update_is_final():
    import torch

    import keras_memfit
    from keras_memfit import OutOfMemoryError

    x, y = small_data(64)
    model = small_model()
    model.train_on_batch(x[:8], y[:8])
    apply = model.optimizer.apply
    calls = []

    def failing_apply(grads, variables=None):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")

    model.optimizer.apply = failing_apply
    with pytest.raises(OutOfMemoryError, match="partly updated"):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[keras_memfit.MemFit()])
    assert len(calls) == 1, "an update that began was retried"
    model.optimizer.apply = apply


def child_jit_compile_runs_eagerly_with_the_same_results():
    import keras

    import keras_memfit

    x, y = small_data(160)
    reference, model = small_model(), small_model()
    model.compile(model.optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=True)
    reference.compile(reference.optimizer, "sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    np.testing.assert_allclose(
        keras_memfit.safe_predict(model, x, batch_size=64, verbose=0),
        reference.predict(x, batch_size=64, verbose=0), rtol=1e-5, atol=1e-6)
    expected = reference.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    injector = _BackwardOOM(20)
    history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0,
                        callbacks=[keras_memfit.MemFit()]).history
    assert injector.raised >= 1
    injector.threshold = None
    assert_same_training(model, history, reference, expected, iterations=3)
    assert keras_memfit.backend.get().compiles_per_shape(model) is False
    assert model.jit_compile is True and keras.backend.backend() == "torch"


def child_refusals():
    import os
    import tempfile

    import torch.distributed as dist

    import keras_memfit

    import torch

    from keras_memfit import backend

    x, y = small_data(32)
    model = small_model()
    assert backend.get().placement is None
    if torch.cuda.is_available():  # place() needs placement only with an accelerator
        with pytest.raises(NotImplementedError, match="torch backend"):
            keras_memfit.place(model, cpu_layers=[model.layers[0].name])
    else:
        plan = keras_memfit.place(model, cpu_layers=[model.layers[0].name])
        assert "no accelerator" in plan.reason
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match="torch.distributed"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[keras_memfit.MemFit()])
    finally:
        dist.destroy_process_group()


def child_memory_report_traces_keras_shapes():
    import keras

    import keras_memfit
    from keras_memfit import backend
    from keras_memfit.app.demo import build_cnn

    model = build_cnn()
    trace = backend.get().trace_layer_calls(model)
    layers = [c for c in trace.calls if c.parent is None]
    assert [c.op for c in layers] == model.layers
    for call, layer in zip(layers, model.layers):
        assert call.outputs[0].shape == tuple(layer.output.shape), layer.name
    assert trace.inputs[0].shape == (None, 28, 28, 1)
    report = keras_memfit.memory_report(model, 512)
    assert report.param_bytes == 4 * model.count_params()
    outputs = sum(int(np.prod(layer.output.shape[1:])) for layer in model.layers)
    assert report.activation_bytes == 512 * 4 * outputs
    text = str(report)
    for layer in model.layers:
        assert layer.name in text
    # The trace ran on the meta device: the variables are where they were.
    assert all(str(v.value.device) != "meta" for v in model.variables)
    assert keras.backend.backend() == "torch"


# --------------------------------------------------------------------- tests
def test_keras_memfit_imports_on_torch_and_its_oom_error_is_torchs():
    run_in_torch(__file__, "child_import_and_errors")


def test_memfit_accumulates_exactly_after_ooms_with_sample_and_class_weights():
    run_in_torch(__file__, "child_memfit_accumulates_exactly")


def test_memfit_without_memory_pressure_trains_as_plain_keras():
    run_in_torch(__file__, "child_memfit_without_pressure_is_plain_keras")


def test_a_failed_train_step_restores_metrics_and_drops_its_gradients():
    run_in_torch(__file__, "child_failed_step_leaves_model_metrics_and_gradients")


def test_an_oom_after_the_update_began_is_not_retried():
    run_in_torch(__file__, "child_an_oom_in_the_update_is_final")


def test_jit_compile_models_run_eagerly_with_the_same_results():
    run_in_torch(__file__, "child_jit_compile_runs_eagerly_with_the_same_results")


def test_place_and_torch_distributed_are_refused_clearly():
    run_in_torch(__file__, "child_refusals")


def test_memory_report_traces_the_layer_shapes_keras_gives():
    run_in_torch(__file__, "child_memory_report_traces_keras_shapes")
