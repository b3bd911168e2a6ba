"""`safe_evaluate`: `model.evaluate` that adapts its batch instead of dying of OOM."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import _cache, _loop, _validate
from keras_memfit import backend as _backend
from keras_memfit import data as _data
from keras_memfit.runner import prepend


def safe_evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    batch_size: Optional[int] = None,
    *,
    sample_weight: Any = None,
    return_dict: bool = False,
    verbose: Union[str, int] = "auto",
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
) -> Union[float, List[float], Dict[str, float]]:
    """Drop-in for `model.evaluate` that never dies of out-of-memory.

    Returns what `model.evaluate` returns, with the same values up to float
    rounding. A batch that runs out of memory is retried in smaller pieces
    from the same offset; the metric and loss state the failed attempt may
    have touched is rolled back first, so no sample is counted twice in any
    metric (loss trackers weight each piece by its size, so the mean loss is
    the same whatever the split). The batch size is planned as in
    `safe_predict`.

    Args:
        model: A compiled Keras model.
        x: Input: arrays/tensors (or lists/dicts of them), a `tf.data.Dataset`
            yielding `(x, y)` or `(x, y, sample_weight)`, a
            `keras.utils.PyDataset`, or a generator.
        y: Targets, for array input.
        batch_size: Samples per batch for array input (default 32, as in
            `model.evaluate`); an upper bound lowered when it does not fit.
        sample_weight: Per-sample weights, for array input.
        return_dict: Return `{metric name: value}` instead of a list.
        verbose: "auto" (same as 1), 0, 1 (progress bar) or 2.
        steps: Number of batches to evaluate, as in `model.evaluate`.
        callbacks: Keras callbacks; they receive the `on_test_*` calls, one
            batch per piece actually run.

    Returns:
        The scalar loss (no metrics), a list of loss and metric values in
        `model.metrics_names` order, or a dict when `return_dict=True`.

    Raises:
        ValueError: If the model is not compiled, or an argument is invalid.
        TypeError: If `model` is not a Keras model or `x` of an unsupported type.
        keras_memfit.OutOfMemoryError: If even one sample does not fit.

    Example:
        >>> loss, accuracy = safe_evaluate(model, x_test, y_test, batch_size=4096)
    """
    _validate.model(model)
    batch_size = _validate.positive_int("batch_size", batch_size)
    steps = _validate.positive_int("steps", steps)
    verbose = _validate.verbosity(verbose)
    if not getattr(model, "compiled", False):
        raise ValueError(
            "model must be compiled before safe_evaluate (call model.compile(loss=..., "
            f"metrics=[...])); received the uncompiled model '{model.name}'"
        )
    if x is None:
        raise ValueError("x must be given; received x=None")
    _validate.batch_size_for(x, batch_size)

    source = _data.from_input(
        x, y, sample_weight, batch_size=batch_size, steps=steps, with_targets=True
    )
    requested = _loop.requested_size(source, batch_size)

    first = next(source.chunks, None)
    if first is None:
        raise ValueError("x yielded no batches; there is nothing to evaluate")
    step, guard = test_step_and_guard(model, first)

    loop = _loop.BatchLoop(
        model, "evaluate", callbacks=callbacks, verbose=verbose,
        num_samples=source.num_samples,
    )
    loop.begin()
    model.reset_metrics()
    last_logs: Any = {}

    def on_result(size, logs):
        nonlocal last_logs
        if loop.shows_logs:
            logs = _pythonify(logs)
        last_logs = logs
        return logs, _bar_values(logs)

    loop.run(prepend(first, source.chunks), step, on_result, requested=requested, guard=guard)
    logs = _pythonify(_metrics_result(model, last_logs))
    loop.end(logs, values=_bar_values(logs))
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def test_step_and_guard(model: keras.Model, batch: Any) -> Tuple[Any, Any]:
    """The compiled test step for `model` and a guard over its metric state.

    Builds the model's metrics from `batch` (an `(x, y, sample_weight)`
    chunk) first; both are cached per model, so repeated calls (and MemFit's
    validation) trace once.
    """
    backend = _backend.get()
    backend.prepare_test(model, _data.rows(batch, 0, 1))
    key = (
        "evaluate",
        tuple(id(v) for v in model.metrics_variables),  # a recompile makes new ones
        bool(getattr(model, "run_eagerly", False)),
        model.jit_compile,
    )
    return _cache.per_model(
        model, key,
        lambda: (backend.make_test_step(model), backend.guard_variables(model.metrics_variables)),
    )


def _metrics_result(model: keras.Model, logs: Any) -> Any:
    """The model's metric results, or the last step's logs for custom steps (as Keras)."""
    metric_logs = model.get_metrics_result()
    if isinstance(logs, dict) and set(logs) == set(metric_logs):
        return metric_logs
    return logs


def _bar_values(logs: Any) -> Optional[List[Tuple[str, Any]]]:
    """The progress bar's (name, value) pairs: the logs' items when they are a dict."""
    return list(logs.items()) if isinstance(logs, dict) else None


def _pythonify(logs: Any) -> Any:
    if not isinstance(logs, dict):
        return logs
    result = {}
    for key, value in logs.items():
        value = keras.ops.convert_to_numpy(value) if not isinstance(value, (int, float)) else value
        result[key] = value.item() if getattr(value, "size", 0) == 1 else value
    return result
