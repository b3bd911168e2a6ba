"""`safe_predict`: `model.predict` that adapts its batch instead of dying of OOM."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal import validate as _validate
from keras_memfit.inference import loop as _loop
from keras_memfit.inference import outputs as _outputs
from keras_memfit.inference import steps as _steps
from keras_memfit.inference.loop import Then, prepend
from keras_memfit.planning import data as _data


def safe_predict(
    model: keras.Model,
    x: Any,
    batch_size: Optional[int] = None,
    verbose: Union[str, int] = "auto",
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    *,
    postprocess: Optional[Callable[[Any], Any]] = None,
    out: Any = None,
    max_batch_size: Optional[int] = None,
) -> Any:
    """Drop-in for `model.predict` that never dies of out-of-memory.

    Accepts what `model.predict` accepts, with the same positional
    parameters (`safe_predict(model, x, 4, 0)` is `model.predict(x, 4, 0)`),
    and returns the same structure, dtypes and row order, with values equal
    up to float rounding; ragged outputs come back as a `tf.RaggedTensor`, as
    from `model.predict`. Inputs of any dtype Keras takes pass through
    (strings from `tf.data`, bool, int64, ragged tensors). Sparse inputs
    (`tf.SparseTensor`, scipy sparse matrices) are batched by Keras and each
    batch runs whole: if one runs out of memory, a `TypeError` says that
    sparse input cannot be split (use a smaller batch size). On an OOM
    it splits the batch it holds and carries on from the failed offset, so no
    sample is lost, duplicated or reordered, whatever the input kind (a
    pre-batched dataset's batches are split too). Each finished batch's
    outputs are copied to host memory at once, so the device never
    accumulates outputs. The batch size is estimated from memory statistics
    before a large batch is tried, remembered per model and input signature,
    and grown back after a run of successes (see `keras_memfit.planning.planner`).

    Under a `tf.distribute.MirroredStrategy` (a model built in its scope, or
    a call inside one) every piece runs on all the replicas, each on its
    share of the rows, as `model.predict` runs its batches there; the
    outputs come back in input order, and the planner sizes each piece for
    the replica with the least free memory.

    Args:
        model: A Keras model (compiled or not).
        x: Input: a numpy array or tensor, a list/dict of them for
            multi-input models, a batched `tf.data.Dataset`, a
            `keras.utils.PyDataset`, or a generator yielding batches.
        batch_size: Samples per batch for array input (default 32, as in
            `model.predict`); an upper bound that is lowered when it does not
            fit. Ignored for datasets, PyDatasets and generators, which are
            batched already, as `model.predict` ignores it (logged at INFO;
            use `max_batch_size` to bound their pieces).
        postprocess: Function applied to the model's outputs inside the
            compiled predict step, on the device, e.g.
            `lambda y: keras.ops.argmax(y, axis=-1)`; only its (smaller)
            result crosses to the host. It must return tensors that keep the
            batch dimension.
        out: Optional preallocated numpy array (or `np.memmap`), or a
            structure of them matching the outputs, to write results into
            (for results larger than host RAM). Its dtype and trailing shape
            must match the outputs; its length must equal the number of
            samples for array input.
        verbose: "auto" (same as 1), 0 (silent), 1 (progress bar) or 2 (one
            line at the end), as in `model.predict`.
        steps: Number of batches to predict, as in `model.predict`.
        callbacks: Keras callbacks; they receive the `on_predict_*` calls as
            from `model.predict` (with `steps_per_execution`, one
            begin/end pair per execution) while nothing runs out of memory;
            after an OOM, each piece actually run is one batch (see
            `keras_memfit.inference.loop`).
        max_batch_size: Upper bound on any batch run, including pieces of a
            dataset's batches.

    Returns:
        A numpy array, or a list/dict of them for multi-output models (the
        structure `model.predict` returns; ragged outputs as
        `tf.RaggedTensor`); `out` when it was given.

    Raises:
        ValueError: If `batch_size`, `max_batch_size`, `steps`, `verbose` or
            `out` are invalid, or `postprocess` drops the batch dimension.
        TypeError: If `model` is not a Keras model, `x` is of an unsupported
            type, `out` is not a numpy array, or `postprocess` returns
            something other than tensors.
        keras_memfit.OutOfMemoryError: If even one sample does not fit, or
            a batch of a model with stateful layers does not (such a batch
            runs whole, never split).

    Example:
        >>> probs = safe_predict(model, x_test, batch_size=28000)
        >>> labels = safe_predict(
        ...     model, x_test, batch_size=28000,
        ...     postprocess=lambda y: keras.ops.argmax(y, axis=-1))
    """
    _validate.model(model)
    batch_size = _validate.positive_int("batch_size", batch_size)
    max_batch_size = _validate.positive_int("max_batch_size", max_batch_size)
    steps = _validate.positive_int("steps", steps)
    verbose = _validate.verbosity(verbose)
    if postprocess is not None and not callable(postprocess):
        raise TypeError(
            "postprocess must be a callable taking the model's outputs; received "
            f"{type(postprocess).__name__}: {postprocess!r:.80}"
        )
    if out is not None:
        _outputs.check_out_types(out)
    batch_size = _data.batch_size_for(
        x, batch_size, advice="use max_batch_size to bound the pieces run"
    )

    source = _data.from_input(
        x, batch_size=batch_size, steps=steps, with_targets=False
    )
    requested = _loop.requested_size(source, batch_size, max_batch_size)

    backend = _backend.get()
    step = _steps.predict_step(model, postprocess)
    writer = _outputs.OutputWriter(source.num_samples, out)

    first = next(source.chunks, None)
    if first is not None:
        spec = _backend.NO_SPEC  # a stateful layer cannot be traced at a batch of unknown size
        if not _model_state.stateful_layers(model):
            spec = backend.output_spec(step, first[0])
        if spec is not _backend.NO_SPEC:
            writer.check_spec(spec, postprocess)
        chunks = prepend(first, source.chunks)
    else:
        chunks = iter(())

    def run(piece):
        return to_host(step(piece[0]))

    def to_host(outputs):
        if writer.structure is not None:
            return keras.tree.map_structure(_outputs.to_host, outputs)
        for leaf in keras.tree.flatten(outputs):  # first piece: eager steps were not traced
            if not (keras.ops.is_tensor(leaf) or isinstance(leaf, np.ndarray)):
                origin = "postprocess" if postprocess is not None else "the model's predict_step"
                raise TypeError(
                    f"{origin} must return a tensor or a structure of tensors; "
                    f"received {type(leaf).__name__}: {leaf!r:.80}"
                )
        return keras.tree.map_structure(_outputs.to_host, outputs)

    def start(piece):  # the backend's steps can start without waiting (JAX)
        return Then(step.start(piece[0]), to_host)

    loop = _loop.BatchLoop(
        model, "predict", callbacks=callbacks, verbose=verbose,
        num_samples=source.num_samples,
        merge_logs=_outputs.merge_outputs if callbacks else None,
    )
    loop.begin()
    for piece in loop.pieces(
        chunks, run, requested=requested,
        start=start if isinstance(step, _backend.StartableStep) else None,
    ):
        writer.write(piece.result, piece.rows, postprocess)
        if loop.batch_ended(piece.rows, {"outputs": piece.result}):
            break  # a callback stopped the run
    loop.data_ended(source, steps)
    loop.end()
    if first is None or loop.done == 0:
        return writer.empty(step, first)
    return writer.result()
