"""MemFit: `model.fit(..., callbacks=[MemFit()])` survives out-of-memory mid-training.

How it works (TensorFlow backend). Keras's `fit` looks `model.train_function`
up at every step, so MemFit installs its own for the length of the call (and
`test_function` for validation, `predict_function` when passed to
`predict`), and puts Keras's back when the call ends or raises. Because the
batch is pulled inside that function, MemFit's version pulls the batch itself
first and so holds it when a step runs out of memory. Then:

- `mode="accumulate"` (default): the same batch is run as micro-batches
  whose gradients, weighted by `rows / batch_rows`, are summed and applied
  once. The optimizer takes one step per batch, as without the OOM: the same
  update (for the default `sum_over_batch_size` loss reduction, with sample
  and class weights), the same `optimizer.iterations`, learning-rate schedule
  and metrics, up to float rounding.
- `mode="shrink"`: the batch is run as smaller batches, one optimizer step
  each: Keras's native behaviour with a smaller `batch_size`, for custom
  `train_step`s and for users who prefer it. The number of optimizer steps
  then grows with the split.

A step that failed leaves no trace: weights and optimizer slots are updated
only after every gradient exists (so an OOM in the forward or backward pass
has not touched them), and the small state a failed step may have updated
(iteration counters, metric and loss-tracker variables, BatchNorm moving
statistics, RNG seed states) is snapshotted before every step and restored.

Not exact, by nature: layers that compute batch statistics (BatchNormalization
in training) see each micro-batch on its own, and their moving statistics are
updated once per micro-batch; dropout masks are drawn per micro-batch. An OOM
inside the optimizer update itself (whose memory does not depend on the
batch size) cannot be split and raises `OutOfMemoryError`.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Dict, List, Optional, Union

import keras
import numpy as np

from keras_memfit import _cache, _model_state
from keras_memfit import backend as _backend
from keras_memfit import data as _data
from keras_memfit.evaluate import test_step_and_guard
from keras_memfit.oom import OutOfMemoryError, is_oom_error
from keras_memfit.planner import BatchPlanner, Event
from keras_memfit.predict import predict_step
from keras_memfit.runner import run_in_pieces

logger = logging.getLogger("keras_memfit")

_MODES = ("accumulate", "shrink")
# MemFit reaches into Keras's training loop; CI tests both ends of this range.
TESTED_KERAS = ((3, 12), (3, 15))
_warned_version = False
# Details for the `OutOfMemoryError` MemFit raises: no size fits, or the
# optimizer update (which splitting cannot shrink) ran out of memory.
_STATE_KEPT = (
    "The training state is as it was before this step: save it, then resume with "
    "`initial_epoch`."
)
_UPDATE_OOM = (
    "The optimizer update itself ran out of memory; its memory does not depend on the "
    "batch size, so splitting the batch cannot help, and the weights and optimizer "
    "slots may be partly updated."
)


class MemFit(keras.callbacks.Callback):
    """Keeps `fit`, `evaluate` and `predict` running when a batch does not fit.

    Add it to `callbacks=[...]`; nothing else changes. With the TensorFlow
    backend, a training step that runs out of memory is re-run on the same
    batch as accumulated micro-batches (or, with `mode="shrink"`, as smaller
    batches), validation and `evaluate` batches are split as in
    `safe_evaluate`, and `predict` batches as in `safe_predict`. The split is
    estimated from memory statistics, remembered per model and input
    signature, and made coarser again after a run of successful steps.

    Args:
        mode: "accumulate" (default) keeps the training identical: one
            optimizer update per batch from the summed micro-batch gradients.
            "shrink" runs the pieces as separate optimizer steps, like a
            smaller `batch_size`.
        place: Also call `keras_memfit.place` on the model at the start of
            `fit`, for models whose weights do not fit the device at any
            batch size (an oversized embedding table). None or False
            (default): do not place. True: `place(model)` with its defaults.
            A dict: keyword arguments for `place` (`budget`, `cpu_layers`,
            `accelerator`). The model is placed once per MemFit and model;
            the plan is kept in `plan`.

    Attributes:
        events: One dict per adaptation during the last call: `epoch`, `step`,
            `phase` ("train", "evaluate", "predict"), `kind` ("oom",
            "estimate", "grow"), `batch_size`, `old_size`, `new_size`,
            `old_split`, `new_split` (micro-batches per batch) and `reason`.
            Epoch logs also get `memfit_ooms` (OOMs caught that epoch, in
            training and validation) and `memfit_split` (the most pieces one
            training batch was run as that epoch; 1 when none was split).
        plan: The `PlacementPlan` of the last placement made for `place=`,
            or None.

    Raises:
        ValueError: If `place` is not None, a bool or a dict of `place`'s
            keyword arguments. At the start of `fit`, if `mode="accumulate"` cannot be
            exact for this model (a custom `train_step`, or a loss reduction
            other than "sum_over_batch_size"); use `mode="shrink"` there.
        NotImplementedError: At the start of `fit`, for a backend other than
            TensorFlow or a model under a `tf.distribute` strategy.
        keras_memfit.OutOfMemoryError: From `fit`, when even one sample does
            not fit; the training state is as it was before that step.

    Example:
        >>> memfit = MemFit()
        >>> model.fit(x, y, batch_size=512, epochs=10, callbacks=[memfit])
        >>> memfit.events[:1]
        [{'epoch': 0, 'step': 0, 'phase': 'train', 'kind': 'oom', ...}]
    """

    def __init__(
        self, mode: str = "accumulate", place: Union[None, bool, Dict[str, Any]] = None
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f'mode must be "accumulate" or "shrink"; received mode={mode!r}')
        self.mode = mode
        self.place = place
        self._place_options = _place_options(place)
        self.plan = None
        self._placed: "weakref.WeakSet[keras.Model]" = weakref.WeakSet()
        self.events: List[Dict[str, Any]] = []
        self._originals: Dict[str, Any] = {}
        self._wrappers: Dict[str, Any] = {}
        self._reset()

    # ------------------------------------------------------------ lifecycle
    def _reset(self) -> None:
        self._in_fit = False
        self._epoch = 0
        self._step = 0
        self._epoch_ooms = 0
        self._epoch_split = 1
        self._planner_events: List[Event] = []
        self._planners: Dict[Any, BatchPlanner] = {}
        self._train_parts: Optional[Dict[str, Any]] = None
        self._test_parts: Optional[Dict[str, Any]] = None
        self._predict_step = None

    # Keras looks the step functions up right after the `on_*_batch_begin`
    # calls, so MemFit installs its own there and removes them as soon as they
    # return or raise: whatever else fails during fit, Keras's own functions
    # are back in place.
    def on_train_begin(self, logs=None):
        self._check_supported()
        self._place_model()
        self._uninstall_all()
        self._reset()
        self.events = []
        self._in_fit = True

    def on_train_end(self, logs=None):
        self._uninstall_all()
        self._in_fit = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_ooms = 0
        self._epoch_split = 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["memfit_ooms"] = self._epoch_ooms
            logs["memfit_split"] = self._epoch_split

    def on_train_batch_begin(self, batch, logs=None):
        self._step = batch
        self._install("train_function", self._train_function)

    def on_test_begin(self, logs=None):
        if not self._in_fit:
            self._start_standalone()

    def on_test_batch_begin(self, batch, logs=None):
        self._install("test_function", self._test_function)

    def on_test_end(self, logs=None):
        self._uninstall("test_function")

    def on_predict_begin(self, logs=None):
        if not self._in_fit:
            self._start_standalone()

    def on_predict_batch_begin(self, batch, logs=None):
        self._install("predict_function", self._predict_function)

    def on_predict_end(self, logs=None):
        self._uninstall("predict_function")

    def _start_standalone(self) -> None:
        _backend.get()  # raises NotImplementedError for unsupported backends
        self._uninstall_all()
        self._reset()
        self.events = []

    def _check_supported(self) -> None:
        backend = _backend.get()
        model = self.model
        _warn_if_untested_keras()
        if backend.uses_distribution(model):
            raise NotImplementedError(
                "MemFit does not support tf.distribute strategies yet; received model "
                f"'{model.name}' built under a distribution strategy. Train without "
                "the strategy, or without MemFit."
            )
        if self.mode != "accumulate":
            return
        if not backend.has_default_train_step(model):
            raise ValueError(
                f"MemFit(mode='accumulate') cannot split the custom train_step of "
                f"{type(model).__name__} into accumulated micro-batches. Use "
                "MemFit(mode='shrink'), which runs your train_step on smaller batches "
                "(one optimizer step each)."
            )
        reductions = sorted(set(_model_state.loss_reductions(model)) - {"sum_over_batch_size"})
        if reductions:
            raise ValueError(
                "MemFit(mode='accumulate') keeps the update exact for losses reduced with "
                f"'sum_over_batch_size' (Keras's default); model '{model.name}' has "
                f"losses reduced with {reductions}. Use MemFit(mode='shrink') or the "
                "default reduction."
            )

    def _place_model(self) -> None:
        model = self.model
        if self._place_options is None or model in self._placed:
            return
        from keras_memfit.placement import place

        self.plan = place(model, **self._place_options)
        self._placed.add(model)
        logger.info("MemFit(place=...): %s", self.plan.reason)
        # Keras made the train function before on_train_begin and looks it up
        # at every step; place() dropped it so that it is traced with the new
        # devices.
        if getattr(model, "train_function", None) is None:
            model.make_train_function()

    # ------------------------------------------------- installing functions
    def _install(self, name: str, wrapper) -> None:
        if name in self._originals:
            return
        self._originals[name] = getattr(self.model, name, None)
        self._wrappers[name] = wrapper
        setattr(self.model, name, wrapper)

    def _uninstall(self, name: str) -> None:
        if name not in self._originals:
            return
        original = self._originals.pop(name)
        wrapper = self._wrappers.pop(name)
        if getattr(self.model, name, None) is wrapper:
            setattr(self.model, name, original)

    def _uninstall_all(self) -> None:
        for name in list(self._originals):
            self._uninstall(name)

    def _run_installed(self, name: str, function, *args):
        """Run `function` (MemFit's `name`), then give Keras its own back."""
        try:
            return function(*args)
        except (StopIteration, _end_of_data()):
            raise  # the end of an epoch, not an error
        except BaseException:
            self._in_fit = False
            raise
        finally:
            self._uninstall(name)

    # ---------------------------------------------------------------- train
    def _train_function(self, iterator):
        return self._run_installed("train_function", self._train_batches, iterator)

    def _train_batches(self, iterator):
        backend = _backend.get()
        logs = None
        for batch in backend.next_batches(iterator, self.model.steps_per_execution):
            logs = self._train_batch(batch)
        return logs

    def _train_parts_for(self, batch) -> Dict[str, Any]:
        if self._train_parts is None:
            backend = _backend.get()
            model = self.model
            # Builds the model, its metrics and loss, and the optimizer too.
            backend.prepare_test(model, _data.rows(_as_chunk(batch), 0, 1))
            custom = not backend.has_default_train_step(model)
            key = (
                "train",
                custom,
                id(model.optimizer),
                tuple(id(v) for v in model.trainable_variables),
                tuple(id(v) for v in model.metrics_variables),
                bool(getattr(model, "run_eagerly", False)),
                model.jit_compile,
            )

            def build():
                make = backend.make_custom_train_step if custom else backend.make_train_step
                return {
                    "step": make(model),
                    "guard": backend.guard_variables(_model_state.train_state_variables(model)),
                    "accumulator": None,
                }

            self._train_parts = _cache.per_model(model, key, build)
        return self._train_parts

    def _planner(self, phase: str, signature, requested=None, probe="first") -> BatchPlanner:
        key = (phase, signature)
        planner = self._planners.get(key)
        if planner is None:
            planner = self._planners[key] = BatchPlanner(
                self.model, phase, signature, requested, self._planner_events, probe=probe
            )
        return planner

    def _train_batch(self, batch):
        parts = self._train_parts_for(batch)
        x = keras.utils.unpack_x_y_sample_weight(batch)[0]
        n = _data.num_rows(x)
        planner = self._planner("train", _data.signature(x), probe="after_oom")
        guard = parts["guard"]
        step = parts["step"]
        if planner.next_size() >= n:
            # Keras's default step snapshots its own small state inside the
            # compiled call; a custom one needs a separate snapshot first.
            fused = _snapshots_itself(step)
            if not fused:
                guard.snapshot()
            try:
                logs = step(batch)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                if not fused:
                    guard.restore()
                elif _update_began(step):
                    raise self._oom_error(batch, planner, _UPDATE_OOM) from exc
                if not planner.failed(n):
                    raise self._oom_error(batch, planner, _STATE_KEPT) from exc
                del exc
                self._note_events(n)
            else:
                planner.succeeded(n, full=True)
                self._note_events(n)
                return logs
        if self.mode == "shrink":
            return self._shrink(batch, n, planner, parts)
        return self._accumulate(batch, n, planner, parts)

    def _shrink(self, batch, n, planner, parts):
        logs = {}

        def on_piece(size, piece, result):
            logs["value"] = result
            self._epoch_split = max(self._epoch_split, math.ceil(n / max(size, 1)))
            return False

        chunk = _as_chunk(batch)

        def step(piece):
            piece = _as_batch(piece)
            try:
                return parts["step"](piece)
            except Exception as exc:
                if is_oom_error(exc) and _update_began(parts["step"]):
                    raise self._oom_error(piece, planner, _UPDATE_OOM) from exc
                raise

        try:
            run_in_pieces(
                self.model, "train", [chunk], step,
                on_piece, requested=None, planner=planner,
                guard=None if _snapshots_itself(parts["step"]) else parts["guard"],
            )
        finally:
            self._note_events(n)
        return logs["value"]

    def _accumulate(self, batch, n, planner, parts):
        backend = _backend.get()
        model = self.model
        guard = parts["guard"]
        chunk = _as_chunk(batch)
        accumulator = parts["accumulator"]
        if accumulator is None:
            accumulator = parts["accumulator"] = backend.make_accumulator(model)
        guard.snapshot()
        while True:
            size = 1
            try:
                accumulator.reset()
                offset, pieces = 0, 0
                while offset < n:
                    planned = planner.next_size()
                    size = int(min(planned, n - offset))
                    piece = _data.rows(chunk, offset, offset + size)
                    planner.started(size)
                    accumulator.add(_as_batch(piece), size / n)
                    planner.succeeded(size, full=size >= planned)
                    offset += size
                    pieces += 1
            except Exception as exc:
                if not is_oom_error(exc):
                    guard.restore()
                    raise
                guard.restore()
                if not planner.failed(size):
                    self._note_events(n)
                    raise self._oom_error(
                        _as_batch(_data.rows(chunk, 0, 1)), planner, _STATE_KEPT
                    ) from exc
                del exc
                self._note_events(n)
                continue
            except BaseException:  # KeyboardInterrupt: leave the batch undone
                guard.restore()
                raise
            break
        try:
            accumulator.apply()
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            raise self._oom_error(_as_batch(chunk), planner, _UPDATE_OOM) from exc
        self._epoch_split = max(self._epoch_split, pieces)
        self._note_events(n)
        return model.get_metrics_result()

    def _oom_error(self, batch, planner, detail: str) -> OutOfMemoryError:
        x = keras.utils.unpack_x_y_sample_weight(batch)[0]
        return OutOfMemoryError(
            self.model.name, "train", _data.shapes(_data.rows(x, 0, 1)), planner.device,
            detail=detail,
        )

    def _note_events(self, batch_rows: Optional[int]) -> None:
        for event in self._planner_events:
            if event.kind == "oom":
                self._epoch_ooms += 1

            def split(size):
                if size is None or batch_rows is None or math.isinf(size):
                    return None
                return math.ceil(batch_rows / max(int(size), 1))

            self.events.append({
                "epoch": self._epoch,
                "step": self._step,
                "phase": event.phase,
                "kind": event.kind,
                "batch_size": batch_rows,
                "old_size": event.old_size,
                "new_size": event.new_size,
                "old_split": split(event.old_size),
                "new_split": split(event.new_size),
                "reason": event.reason,
            })
        self._planner_events.clear()

    # ----------------------------------------------------------- evaluate
    def _test_function(self, iterator):
        return self._run_installed("test_function", self._test_batches, iterator)

    def _test_batches(self, iterator):
        backend = _backend.get()
        model = self.model
        logs = {}
        for batch in backend.next_batches(iterator, model.steps_per_execution):
            if self._test_parts is None:
                step, guard = test_step_and_guard(model, _as_chunk(batch))
                self._test_parts = {"step": step, "guard": guard}
            chunk = _as_chunk(batch)

            def on_piece(size, piece, result):
                logs["value"] = result
                return False

            run_in_pieces(
                model, "evaluate", [chunk],
                lambda piece: self._test_parts["step"](_as_batch(piece)),
                on_piece, requested=None, guard=self._test_parts["guard"],
                planner=self._planner("evaluate", _data.signature(chunk[0])),
            )
            self._note_events(_data.num_rows(chunk))
        return logs.get("value", {})

    # ------------------------------------------------------------ predict
    def _predict_function(self, data):
        return self._run_installed("predict_function", self._predict_batches, data)

    def _predict_batches(self, data):
        backend = _backend.get()
        if self._predict_step is None:
            self._predict_step = predict_step(self.model)
        per_batch = []
        for batch in data:
            x = keras.utils.unpack_x_y_sample_weight(batch)[0]
            pieces = []

            def on_piece(size, piece, result):
                pieces.append(result)
                return False

            run_in_pieces(
                self.model, "predict", [(x,)],
                lambda piece: keras.tree.map_structure(
                    keras.ops.convert_to_numpy, self._predict_step(piece[0])
                ),
                on_piece, requested=None, planner=self._planner("predict", _data.signature(x)),
            )
            self._note_events(_data.num_rows(x))
            per_batch.extend(pieces)
        return _concatenate(per_batch)


_PLACE_KEYS = ("budget", "cpu_layers", "accelerator")


def _place_options(place: Any) -> Optional[Dict[str, Any]]:
    """`MemFit(place=...)` as keyword arguments for `place`, or None."""
    if place is None or place is False:
        return None
    if place is True:
        return {}
    if isinstance(place, dict) and set(place) <= set(_PLACE_KEYS):
        return dict(place)
    raise ValueError(
        "place must be None, True, False or a dict of keras_memfit.place keyword "
        f"arguments {list(_PLACE_KEYS)}; received place={place!r}"
    )


def _warn_if_untested_keras() -> None:
    global _warned_version
    if _warned_version:
        return
    try:
        version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    except ValueError:
        return
    low, high = TESTED_KERAS
    if not low <= version <= high:
        _warned_version = True
        logger.warning(
            "keras_memfit: MemFit was tested with Keras %d.%d to %d.%d and reaches into "
            "Keras's training loop; Keras %s is outside that range.",
            *low, *high, keras.__version__,
        )


def _snapshots_itself(step) -> bool:
    """Whether `step` (Keras's default one) snapshots and restores its small state itself."""
    return hasattr(step, "last_outcome")


def _update_began(step) -> bool:
    """Whether a failed train step had begun its optimizer update (custom steps: unknown)."""
    outcome = getattr(step, "last_outcome", None)
    return outcome is not None and outcome == step.UPDATE_BEGAN


def _as_chunk(batch) -> tuple:
    """A Keras batch as an `(x, y, sample_weight)` chunk of rows."""
    return tuple(keras.utils.unpack_x_y_sample_weight(batch))


def _as_batch(chunk) -> tuple:
    """An `(x, y, sample_weight)` chunk back as a Keras batch."""
    x, y, sample_weight = chunk
    if sample_weight is not None:
        return (x, y, sample_weight)
    if y is not None:
        return (x, y)
    return (x,)


def _concatenate(parts: List[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    leaves = [keras.tree.flatten(p) for p in parts]
    joined = [np.concatenate(column, axis=0) for column in zip(*leaves)]
    return keras.tree.pack_sequence_as(parts[0], joined)


def _end_of_data():
    import tensorflow as tf  # the only backend MemFit runs on so far

    return tf.errors.OutOfRangeError
