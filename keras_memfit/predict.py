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

    Takes `model.predict`'s arguments in the same positions and returns what it returns. On
    an OOM it splits the batch and carries on from the failed offset: no sample is lost,
    duplicated or reordered (docs/inference.md).

    Args:
        batch_size: Samples per batch for array input (default 32), lowered when it does not
            fit; ignored for batched input, as in `model.predict`.
        callbacks: Called as `model.predict` calls them; after an OOM each piece is one batch.
        postprocess: Applied to the outputs inside the compiled step, on the device (e.g.
            `lambda y: keras.ops.argmax(y, axis=-1)`); it must keep the batch dimension.
        out: Numpy array or `np.memmap` (or a structure of them) to write into, for results
            larger than host RAM; returned.
        max_batch_size: Upper bound on any piece run, dataset batches included.

    Returns:
        What `model.predict` returns (ragged outputs as `tf.RaggedTensor`), or `out` when it
        was given.

    Raises:
        ValueError: If an argument is invalid, or `postprocess` drops the batch dimension.
        TypeError: If `model` is not a Keras model, `x` or `out` is of an unsupported type,
            `postprocess` returns something other than tensors, or a sparse batch (never
            split) runs out of memory.
        keras_memfit.OutOfMemoryError: If even one sample does not fit, or a batch of a
            model with stateful layers (never split) does not.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> safe_predict(model, np.ones((10, 4)), batch_size=4, verbose=0).shape
        (10, 2)
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

    step = _steps.predict_step(model, postprocess)
    writer = _outputs.OutputWriter(source.num_samples, out)

    first = next(source.chunks, None)
    # A stateful layer cannot be traced at a batch of unknown size.
    if first is not None and not _model_state.stateful_layers(model):
        spec = _backend.get().output_spec(step, first[0])
        if spec is not _backend.NO_SPEC:
            writer.check_spec(spec, postprocess)
    chunks = source.chunks if first is None else prepend(first, source.chunks)

    def run(piece):
        return to_host(step(piece[0]))

    def to_host(outputs):
        if writer.structure is None:  # first piece: eager steps were not traced
            origin = "postprocess" if postprocess is not None else "the model's predict_step"
            for leaf in keras.tree.flatten(outputs):
                if not (keras.ops.is_tensor(leaf) or isinstance(leaf, np.ndarray)):
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
