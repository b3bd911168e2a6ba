"""MemFit's work during one call, backend-neutral: what it does with each batch.

`Run` is what `MemFit` (the public callback, `keras_memfit.callbacks`) hands
the batches to. Every batch goes through the one loop of
`keras_memfit.runner.run_in_pieces`, with a strategy per phase:

- training, `mode="shrink"`: the batch as pieces, one train step each (the
  full batch first, while the planner says it fits);
- training, `mode="accumulate"`: the full batch as one train step while it
  fits, else its pieces all or nothing (`runner.Accumulation`): micro-batch
  gradients summed by the backend's `Accumulator` and applied once;
- validation and `evaluate`: the batch as pieces of the test step, its
  metric state guarded;
- `predict`: the batch as pieces of the predict step, outputs concatenated.

A train step that snapshots its own small state (`TrainStep.snapshots_itself`)
runs unguarded; one that does not (a custom `train_step`) runs inside a
`Guard`. A step whose optimizer update had begun when it ran out of memory
(`StepOutcome.UPDATE_BEGAN`) is not retried.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import keras
import numpy as np

from keras_memfit import _cache, _model_state
from keras_memfit import backend as _backend
from keras_memfit import data as _data
from keras_memfit.backend.base import Accumulator, Guard, StepOutcome, TrainStep
from keras_memfit.evaluate import test_step_and_guard
from keras_memfit.oom import OutOfMemoryError, is_oom_error
from keras_memfit.planner import BatchPlanner, Event
from keras_memfit.predict import predict_step
from keras_memfit.runner import Accumulation, run_in_pieces

MODES = ("accumulate", "shrink")
# Details for the `OutOfMemoryError` MemFit raises: no size fits, or the
# optimizer update (which splitting cannot shrink) ran out of memory.
STATE_KEPT = (
    "The training state is as it was before this step: save it, then resume with "
    "`initial_epoch`."
)
UPDATE_OOM = (
    "The optimizer update itself ran out of memory; its memory does not depend on the "
    "batch size, so splitting the batch cannot help, and the weights and optimizer "
    "slots may be partly updated."
)


@dataclasses.dataclass
class TrainParts:
    """What training one model needs, built once and cached per model.

    Attributes:
        step: The compiled train step.
        guard: A guard over the small state a train step updates, for steps
            that do not snapshot it themselves and for accumulation.
        accumulator: The gradient accumulator, made when a batch is first
            split in `mode="accumulate"` (it costs the size of the weights).
    """

    step: TrainStep
    guard: Guard
    accumulator: Optional[Accumulator] = None


class Run:
    """MemFit's state during one `fit`, or one standalone `evaluate` or `predict`.

    Args:
        model: The model being run.
        mode: "accumulate" or "shrink" (see `MemFit`).

    Attributes:
        events: One `Event` per adaptation, located at `epoch` and `step`.
        epoch: The current epoch of `fit` (0 outside `fit`).
        step: The index of the current training batch in its epoch.
        epoch_ooms: OOMs caught in this epoch (training and validation).
        epoch_split: The most pieces one training batch was run as in this
            epoch (1 when none was split).
    """

    def __init__(self, model: keras.Model, mode: str) -> None:
        self.model = model
        self.mode = mode
        self.events: List[Event] = []
        self.epoch = 0
        self.step = 0
        self.epoch_ooms = 0
        self.epoch_split = 1
        self._pending: List[Event] = []  # the planners' events, not yet located
        self._planners: Dict[Tuple[str, Hashable], BatchPlanner] = {}
        self._train_parts: Optional[TrainParts] = None
        self._test_parts: Optional[Tuple[Any, Guard]] = None
        self._predict_step: Any = None

    def start_epoch(self, epoch: int) -> None:
        """Start counting the OOMs and the split of `epoch`."""
        self.epoch = epoch
        self.epoch_ooms = 0
        self.epoch_split = 1

    # ---------------------------------------------------------------- train
    def train(self, batches: List[Any]) -> Any:
        """Train on each Keras batch; returns the last one's logs."""
        logs = None
        for batch in batches:
            logs = self._train_batch(_as_chunk(batch))
        return logs

    def _train_batch(self, chunk: tuple) -> Any:
        parts = self._train_parts_for(chunk)
        n = _data.num_rows(chunk)
        planner = self._planner("train", _data.signature(chunk[0]), probe="after_oom")
        logs: Dict[str, Any] = {}

        def on_piece(size: int, piece: Any, result: Any) -> bool:
            logs["value"] = result
            if self.mode == "shrink":
                self.epoch_split = max(self.epoch_split, math.ceil(n / max(size, 1)))
            return False

        accumulation = None
        if self.mode == "accumulate":
            accumulation = self._accumulation(parts, chunk, planner)
        try:
            run_in_pieces(
                self.model, "train", [chunk], self._step_runner(parts.step, planner), on_piece,
                requested=None, planner=planner,
                guard=None if parts.step.snapshots_itself else parts.guard,
                accumulation=accumulation, detail=STATE_KEPT,
            )
        finally:
            self._note_events(n)
        return logs["value"]

    def _step_runner(self, step: TrainStep, planner: BatchPlanner) -> Callable[[tuple], Any]:
        """`step` on a piece; an OOM after its optimizer update began is final."""

        def run(piece: tuple) -> Any:
            try:
                return step(_as_batch(piece))
            except Exception as exc:
                if is_oom_error(exc) and step.last_outcome is StepOutcome.UPDATE_BEGAN:
                    raise self._oom_error(piece, planner, UPDATE_OOM) from exc
                raise

        return run

    def _accumulation(
        self, parts: TrainParts, chunk: tuple, planner: BatchPlanner
    ) -> Accumulation:
        """The batch `chunk` as micro-batches whose summed gradients make one update."""
        model = self.model
        pieces = [0]

        def begin() -> None:
            if parts.accumulator is None:
                parts.accumulator = _backend.get().make_accumulator(model)
            parts.accumulator.reset()
            pieces[0] = 0

        def add(piece: tuple, share: float) -> None:
            parts.accumulator.add(_as_batch(piece), share)
            pieces[0] += 1

        def finish() -> Any:
            try:
                parts.accumulator.apply()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise self._oom_error(chunk, planner, UPDATE_OOM) from exc
            self.epoch_split = max(self.epoch_split, pieces[0])
            return model.get_metrics_result()

        return Accumulation(begin=begin, add=add, finish=finish, guard=parts.guard)

    def _train_parts_for(self, chunk: tuple) -> TrainParts:
        if self._train_parts is None:
            backend = _backend.get()
            model = self.model
            # Builds the model, its metrics and loss, and the optimizer too.
            backend.prepare_test(model, _data.rows(chunk, 0, 1))
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

            def build() -> TrainParts:
                make = backend.make_custom_train_step if custom else backend.make_train_step
                return TrainParts(
                    step=make(model),
                    guard=backend.guard_variables(_model_state.train_state_variables(model)),
                )

            self._train_parts = _cache.per_model(model, key, build)
        return self._train_parts

    def _oom_error(self, chunk: tuple, planner: BatchPlanner, detail: str) -> OutOfMemoryError:
        return OutOfMemoryError(
            self.model.name, "train", _data.shapes(_data.rows(chunk[0], 0, 1)),
            planner.device, detail=detail,
        )

    # ------------------------------------------------------------- evaluate
    def test(self, batches: List[Any]) -> Any:
        """Evaluate each Keras batch; returns the last one's logs."""
        model = self.model
        logs: Dict[str, Any] = {}

        def on_piece(size: int, piece: Any, result: Any) -> bool:
            logs["value"] = result
            return False

        for batch in batches:
            chunk = _as_chunk(batch)
            if self._test_parts is None:
                self._test_parts = test_step_and_guard(model, chunk)
            step, guard = self._test_parts
            try:
                run_in_pieces(
                    model, "evaluate", [chunk], lambda piece: step(_as_batch(piece)),
                    on_piece, requested=None, guard=guard,
                    planner=self._planner("evaluate", _data.signature(chunk[0])),
                )
            finally:
                self._note_events(_data.num_rows(chunk))
        return logs.get("value", {})

    # -------------------------------------------------------------- predict
    def predict(self, batches: List[Any]) -> Any:
        """Predict each Keras batch; returns the outputs, concatenated."""
        if self._predict_step is None:
            self._predict_step = predict_step(self.model)
        step = self._predict_step
        outputs: List[Any] = []

        def on_piece(size: int, piece: Any, result: Any) -> bool:
            outputs.append(result)
            return False

        for batch in batches:
            x = keras.utils.unpack_x_y_sample_weight(batch)[0]
            try:
                run_in_pieces(
                    self.model, "predict", [(x,)],
                    lambda piece: keras.tree.map_structure(
                        keras.ops.convert_to_numpy, step(piece[0])
                    ),
                    on_piece, requested=None,
                    planner=self._planner("predict", _data.signature(x)),
                )
            finally:
                self._note_events(_data.num_rows(x))
        return _concatenate(outputs)

    # --------------------------------------------------------------- shared
    def _planner(self, phase: str, signature: Hashable, probe: str = "first") -> BatchPlanner:
        key = (phase, signature)
        planner = self._planners.get(key)
        if planner is None:
            planner = self._planners[key] = BatchPlanner(
                self.model, phase, signature, None, self._pending, probe=probe
            )
        return planner

    def _note_events(self, batch_rows: Optional[int]) -> None:
        for event in self._pending:
            if event.kind == "oom":
                self.epoch_ooms += 1
            self.events.append(event.located(self.epoch, self.step, batch_rows))
        self._pending.clear()


def _as_chunk(batch: Any) -> tuple:
    """A Keras batch as an `(x, y, sample_weight)` chunk of rows."""
    return tuple(keras.utils.unpack_x_y_sample_weight(batch))


def _as_batch(chunk: tuple) -> tuple:
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
