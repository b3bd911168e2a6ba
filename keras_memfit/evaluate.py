"""`safe_evaluate`: `model.evaluate` that adapts its batch instead of dying of OOM."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import validate as _validate
from keras_memfit.inference import loop as _loop
from keras_memfit.inference import output_losses as _output_losses
from keras_memfit.inference import steps as _steps
from keras_memfit.inference.loop import prepend
from keras_memfit.planning import data as _data


def safe_evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    batch_size: Optional[int] = None,
    verbose: Union[str, int] = "auto",
    sample_weight: Any = None,
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    return_dict: bool = False,
    *,
    exact_output_losses: bool = False,
    **kwargs: Any,
) -> Union[float, List[float], Dict[str, float]]:
    """Drop-in for `model.evaluate` that never dies of out-of-memory.

    Takes `model.evaluate`'s arguments in its order and returns what it returns. A batch that
    runs out of memory is retried in smaller pieces from the same offset, its metric state
    rolled back: no sample counts twice, and a split batch counts as one (docs/inference.md).

    Args:
        batch_size: Samples per batch for array input (default 32), lowered when it does not
            fit; ignored for batched input.
        callbacks: Called as `model.evaluate` calls them; after an OOM each piece is one batch.
        exact_output_losses: Per-output losses (`"<output>_loss"`) as means over samples
            instead of Keras's mean of batch means.

    Returns:
        The scalar loss (no metrics), a list of loss and metric values in
        `model.metrics_names` order, or a dict when `return_dict=True`.

    Raises:
        ValueError: If the model is not compiled, or an argument is invalid or unknown.
        TypeError: If `model` is not a Keras model or `x` of an unsupported type.
        keras_memfit.OutOfMemoryError: If even one sample does not fit, or a batch of a
            model with stateful layers (never split) does not.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(loss="mse", metrics=["mae"])
        >>> safe_evaluate(model, np.zeros((10, 4)), np.zeros((10, 2)), verbose=0)
        [0.0, 0.0]
    """
    _validate.model(model)
    _validate.unknown_kwargs("safe_evaluate", kwargs)
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
    batch_size = _data.batch_size_for(x, batch_size)

    source = _data.from_input(
        x, y, sample_weight, batch_size=batch_size, steps=steps, with_targets=True
    )
    requested = _loop.requested_size(source, batch_size)

    first = next(source.chunks, None)
    if first is None:
        raise ValueError("x yielded no batches; there is nothing to evaluate")
    first_batch = first if requested is None else _batches.rows(first, 0, requested)
    step, guard = _steps.test_step_and_guard(model, first_batch, exact=exact_output_losses)
    batches = _output_losses.SplitBatches(model, exact_output_losses)

    loop = _loop.BatchLoop(
        model, "evaluate", callbacks=callbacks, verbose=verbose,
        num_samples=source.num_samples,
    )
    loop.begin()
    model.reset_metrics()
    last_logs: Any = {}
    run = batches.step(step, lambda piece: _steps.test_step_and_guard(model, piece, exact=True)[0])
    with _backend.get().evaluation(model):  # several processes: one failure, one sum for all
        for piece in loop.pieces(
            batches.tag(prepend(first, source.chunks), requested if source.from_arrays else None),
            run, requested=requested, guard=guard,
            start=run.start if isinstance(run, _backend.StartableStep) else None,
        ):
            logs = piece.result
            if batches.finished(piece):  # a split batch was counted as one: current values
                logs = _metrics_result(model, logs)
            if loop.shows_logs:
                logs = _pythonify(logs)
            last_logs = logs
            if loop.batch_ended(piece.rows, logs, _bar_values(logs)):
                break  # a callback stopped the run
        loop.data_ended(source, steps)
    logs = _pythonify(_metrics_result(model, last_logs))
    loop.end(logs, values=_bar_values(logs))
    if return_dict:
        return logs
    return _keras_compat.flatten_metrics_in_order(model, logs)


def _metrics_result(model: keras.Model, logs: Any) -> Any:
    """The model's metric results, or the last step's logs for custom steps (as Keras)."""
    metric_logs = model.get_metrics_result()
    if isinstance(logs, dict) and set(logs) == set(metric_logs):
        return metric_logs
    return logs


def _bar_values(logs: Any) -> Optional[List[Tuple[str, Any]]]:
    return list(logs.items()) if isinstance(logs, dict) else None


def _pythonify(logs: Any) -> Any:
    """Python numbers, keys sorted: what Keras's `evaluate` returns and logs."""
    if not isinstance(logs, dict):
        return logs
    result = {}
    for key, value in sorted(logs.items()):
        value = keras.ops.convert_to_numpy(value) if not isinstance(value, (int, float)) else value
        result[key] = value.item() if getattr(value, "size", 0) == 1 else value
    return result
