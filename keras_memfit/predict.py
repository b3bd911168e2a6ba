"""`safe_predict`: `model.predict` that adapts its batch instead of dying of OOM."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import keras
import numpy as np

from keras_memfit import _cache, _keras_compat, _loop, _validate
from keras_memfit import backend as _backend
from keras_memfit import data as _data
from keras_memfit.backend import Spec
from keras_memfit.runner import Then, prepend


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
    and grown back after a run of successes (see `keras_memfit.planner`).

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
            `keras_memfit._loop`).
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
        keras_memfit.OutOfMemoryError: If even one sample does not fit.

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
        _check_out_types(out)
    batch_size = _validate.batch_size_for(
        x, batch_size, advice="use max_batch_size to bound the pieces run"
    )

    source = _data.from_input(
        x, batch_size=batch_size, steps=steps, with_targets=False
    )
    requested = _loop.requested_size(source, batch_size, max_batch_size)

    backend = _backend.get()
    step = predict_step(model, postprocess)
    writer = _OutputWriter(source.num_samples, out)

    first = next(source.chunks, None)
    if first is not None:
        spec = backend.output_spec(step, first[0])
        if spec is not _backend.NO_SPEC:
            writer.check_spec(spec, postprocess)
        chunks = prepend(first, source.chunks)
    else:
        chunks = iter(())

    loop = _loop.BatchLoop(
        model, "predict", callbacks=callbacks, verbose=verbose,
        num_samples=source.num_samples,
    )
    loop.begin()

    def run(piece):
        return to_host(step(piece[0]))

    def to_host(outputs):
        if writer.structure is not None:
            return keras.tree.map_structure(_to_host, outputs)
        for leaf in keras.tree.flatten(outputs):  # first piece: eager steps were not traced
            if not (keras.ops.is_tensor(leaf) or isinstance(leaf, np.ndarray)):
                origin = "postprocess" if postprocess is not None else "the model's predict_step"
                raise TypeError(
                    f"{origin} must return a tensor or a structure of tensors; "
                    f"received {type(leaf).__name__}: {leaf!r:.80}"
                )
        return keras.tree.map_structure(_to_host, outputs)

    def on_result(size, result):
        writer.write(result, size, postprocess)
        return {"outputs": result}, None

    def start(piece):  # the backend's steps can start without waiting (JAX)
        return Then(step.start(piece[0]), to_host)

    loop.run(
        chunks, run, on_result, requested=requested,
        merge_logs=_merge_outputs if callbacks else None,
        start=start if isinstance(step, _backend.StartableStep) else None,
    )
    loop.data_ended(source, steps)
    loop.end()
    if first is None or loop.done == 0:
        return writer.empty(step, first)
    return writer.result()


def _is_native(leaf: Any) -> bool:
    """Whether an output is ragged or sparse: `model.predict` returns those as they are."""
    return type(leaf).__name__ == "RaggedTensor" or _data.is_sparse(leaf)


def _to_host(leaf: Any) -> Any:
    return leaf if _is_native(leaf) else keras.ops.convert_to_numpy(leaf)


def _concatenate(parts: List[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if _is_native(parts[0]):
        return keras.ops.concatenate(parts, axis=0)
    return np.concatenate(parts, axis=0)


def _merge_outputs(logs: List[Any]) -> Any:
    """One execution's `{"outputs": ...}`: its batches' outputs concatenated, as Keras's."""
    outputs = [entry["outputs"] for entry in logs]
    return {"outputs": keras.tree.map_structure(lambda *parts: _concatenate(list(parts)),
                                                *outputs)}


def predict_step(model: keras.Model, postprocess: Optional[Callable] = None) -> Callable:
    """The compiled predict step (then `postprocess`) for `model`, cached per model.

    One per set of replica devices: a model used inside a strategy's scope
    and outside it gets a step for each.
    """
    key = (
        "predict", postprocess, bool(getattr(model, "run_eagerly", False)), model.jit_compile,
        _backend.get().replica_devices(model),
    )
    return _cache.per_model(
        model, key, lambda: _backend.get().make_predict_step(model, postprocess)
    )


def _check_out_types(out: Any) -> None:
    for leaf in keras.tree.flatten(out):
        if not isinstance(leaf, np.ndarray):
            raise TypeError(
                "out must be a numpy array or np.memmap (or a list/dict of them "
                f"matching the model's outputs); received {type(leaf).__name__}"
            )
        if not leaf.flags.writeable:
            raise ValueError("out must be writeable; received a read-only array")


class _OutputWriter:
    """Collects each piece's host outputs in order, into `out` or new arrays."""

    def __init__(self, num_samples: Optional[int], out: Any) -> None:
        self.num_samples = num_samples
        self.out = out
        self.structure = None
        self.buffers: Optional[List[np.ndarray]] = None
        self.parts: Optional[List[List[np.ndarray]]] = None
        self.offset = 0
        if out is not None and num_samples is not None:
            for leaf in keras.tree.flatten(out):
                if leaf.ndim == 0 or leaf.shape[0] != num_samples:
                    raise ValueError(
                        f"out must have {num_samples} rows, one per input sample; "
                        f"received out of shape {leaf.shape}"
                    )

    def check_spec(self, spec: Any, postprocess: Optional[Callable]) -> None:
        """Validate traced outputs (see `backend.output_spec`) before any work."""
        source = "postprocess" if postprocess is not None else "the model's predict_step"
        for leaf in keras.tree.flatten(spec):
            if not isinstance(leaf, Spec):
                raise TypeError(
                    f"{source} must return a tensor or a structure of tensors; "
                    f"received {type(leaf).__name__}: {leaf!r:.80}"
                )
            if leaf.shape is not None and (len(leaf.shape) == 0 or leaf.shape[0] is not None):
                raise ValueError(
                    f"{source} must keep the batch dimension (one row per sample); "
                    f"it returned a tensor of shape {leaf.shape} for a batch of "
                    "unknown size"
                )
        if self.out is not None:
            self._check_out_against(
                spec, lambda s: (tuple(s.shape[1:]) if s.shape else None, s.dtype)
            )

    def _check_out_against(self, outputs: Any, describe: Callable) -> None:
        try:
            _keras_compat.assert_same_structure(self.out, outputs)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "out must have the structure of the model's outputs; received "
                f"{_describe(self.out)} for outputs {_describe(outputs)}"
            ) from err
        for target, output in zip(keras.tree.flatten(self.out), keras.tree.flatten(outputs)):
            trailing, dtype = describe(output)
            shape_ok = trailing is None or any(d is None for d in trailing) or (
                tuple(target.shape[1:]) == tuple(trailing)
            )
            if not shape_ok or target.dtype != dtype:
                raise ValueError(
                    f"out must have trailing shape {trailing} and dtype {dtype} to hold "
                    f"the outputs; received shape {target.shape} and dtype {target.dtype}"
                )

    def write(self, result: Any, size: int, postprocess: Optional[Callable]) -> None:
        leaves = keras.tree.flatten(result)
        if self.structure is None:
            self._start(result, leaves, size, postprocess)
        if self.buffers is not None:
            stop = self.offset + size
            for buffer, leaf in zip(self.buffers, leaves):
                if stop > buffer.shape[0]:
                    raise ValueError(
                        f"out has {buffer.shape[0]} rows but the input yielded more "
                        "samples; pass an out with one row per sample"
                    )
                buffer[self.offset:stop] = leaf
        else:
            for part, leaf in zip(self.parts, leaves):
                part.append(leaf)
        self.offset += size

    def _start(self, result, leaves, size, postprocess) -> None:
        self.structure = result
        native = any(_is_native(leaf) for leaf in leaves)
        if native and self.out is not None:
            raise ValueError(
                "out cannot hold ragged or sparse outputs; received out="
                f"{_describe(self.out)} for outputs of types "
                f"{[type(leaf).__name__ for leaf in leaves]}; pass out=None"
            )
        for leaf in leaves:
            if len(leaf.shape) == 0 or leaf.shape[0] != size:
                source = "postprocess" if postprocess is not None else "the model"
                raise ValueError(
                    f"{source} must return one row per sample; a batch of {size} "
                    f"gave shape {leaf.shape}"
                )
        if self.out is not None:
            self._check_out_against(result, lambda a: (a.shape[1:], a.dtype))
            self.buffers = keras.tree.flatten(self.out)
        elif self.num_samples is not None and not native:
            self.buffers = [
                np.empty((self.num_samples,) + leaf.shape[1:], leaf.dtype) for leaf in leaves
            ]
        else:
            self.parts = [[] for _ in leaves]

    def result(self) -> Any:
        if self.out is not None:
            rows = keras.tree.flatten(self.out)[0].shape[0]
            if self.offset < rows:
                return keras.tree.map_structure(lambda a: a[: self.offset], self.out)
            return self.out
        if self.buffers is not None:
            leaves = [b[: self.offset] if self.offset < b.shape[0] else b for b in self.buffers]
        else:
            leaves = [_concatenate(p) for p in self.parts]
        return keras.tree.pack_sequence_as(self.structure, leaves)

    def empty(self, step: Callable, first: Any) -> Any:
        """The empty result for an input with no samples."""
        if self.out is not None:
            return keras.tree.map_structure(lambda a: a[:0], self.out)
        if first is None:
            raise ValueError(
                "x yielded no batches, so the output shapes are unknown; pass at "
                "least one batch"
            )
        backend = _backend.get()
        spec = backend.output_spec(step, first[0])
        if spec is _backend.NO_SPEC:
            return keras.tree.map_structure(keras.ops.convert_to_numpy, step(first[0]))
        return keras.tree.map_structure(
            lambda s: np.empty((0,) + tuple(d or 0 for d in (s.shape or (0,))[1:]), s.dtype),
            spec,
        )


def _describe(value: Any) -> str:
    return str(keras.tree.map_structure(lambda a: getattr(a, "shape", a), value))
