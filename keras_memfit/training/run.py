"""MemFit's work during one call, backend-neutral: what it does with each batch.

`Run` is what `MemFit` (the public callback, `keras_memfit.callbacks`) hands
the batches to. Every batch goes through the one loop of
`keras_memfit.planning.runner.run_in_pieces`, with a strategy per phase
(a training batch the planner runs whole is tried by `runner.run_whole`,
that loop's first try without the loop, and goes on to the loop only when
it is split or ran out of memory):

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
(`StepOutcome.UPDATE_BEGAN`) is not retried; an `OrderedTrainStep` gets the
model's training peak estimate (`analysis.training_peak`). The accumulator's
sums are made when a batch is first split, freed when the fit ends.

Every phase runs the whole batch first and splits only after an OOM, so a
call that never runs out of memory computes what Keras computes; `predict`
then returns the step's own tensors, as Keras's `predict_function` does.
Batches MemFit cannot split (sparse or ragged tensors, optional inputs that
arrive as `tf.experimental.Optional`, anything but arrays and dense tensors)
go to Keras's own step function (`Run.keras_function`), untouched; only when
one of those runs out of memory does MemFit raise, naming what it received.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal.batches import (
    as_batch, as_chunk, concatenate, first_unsplittable, form_of, splittable_rows,
)
from keras_memfit.analysis import training_peak
from keras_memfit.backend.base import Accumulator, Guard, OrderedTrainStep, StepOutcome, TrainStep
from keras_memfit.inference.output_losses import CountedOnce, SplitBatches
from keras_memfit.inference.steps import predict_step, test_step_and_guard
from keras_memfit.oom import CANNOT_SPLIT, UPDATE, UPDATE_BEGAN, OutOfMemoryError, is_oom_error
from keras_memfit.planning import data as _data
from keras_memfit.planning.planner import BatchPlanner, Event
from keras_memfit.planning.runner import SPLIT, Accumulation, Pieces, run_in_pieces, run_whole
from keras_memfit.training.batch_dependence import SplitWarnings
from keras_memfit.training.replicas import ReplicaRun, replicas_of

logger = logging.getLogger("keras_memfit")

MODES = ("accumulate", "shrink")
_PHASE_OF_KIND = {"test": "evaluate"}  # Keras's function kinds, as OutOfMemoryError.phase


@dataclasses.dataclass
class TrainParts:
    """What training one model needs, built once and cached per model.

    Attributes:
        step: The compiled train step.
        guard: Guards the small state a step updates (steps not snapshotting it).
        counted: Counts an accumulated batch once for the per-output loss
            trackers, as Keras's step counts a batch.
        accumulator: The gradient accumulator (the size of the weights),
            made when a batch is first split, dropped by `Run.release`.
    """

    step: TrainStep
    guard: Guard
    counted: CountedOnce
    accumulator: Optional[Accumulator] = None


class Run:
    """MemFit's state during one `fit`, or one standalone `evaluate` or `predict`.

    Args:
        model: The model being run.
        mode: "accumulate" or "shrink" (see `MemFit`).
        keras_function: `keras_function(kind, batches)` runs Keras's own
            `model.<kind>_function` on the batches already pulled (for the
            batches MemFit cannot split).
        fallback: Why `mode="accumulate"` was asked for but "shrink" is used,
            logged as a warning when that first matters (the first OOM in
            training); None when the mode is the one asked for.

    Attributes:
        events: One `Event` per adaptation, located at `epoch` and `step`.
        epoch: The current epoch of `fit` (0 outside `fit`).
        step: The index of the current training batch in its epoch.
        epoch_ooms: OOMs caught in this epoch (training and validation).
        epoch_split: The most pieces one training batch was run as in this
            epoch (1 when none was split).
        most_pieces: Per phase that split a batch, the most pieces one batch
            was run as during the call, and that batch's rows.
    """

    def __init__(
        self,
        model: keras.Model,
        mode: str,
        keras_function: Callable[[str, List[Any]], Any],
        fallback: Optional[str] = None,
    ) -> None:
        self.model = model
        self.mode = mode
        self.keras_function = keras_function
        self.fallback = fallback
        self._split_warnings = SplitWarnings(model)  # once per run, at the first split
        self.events: List[Event] = []
        self.epoch = 0
        self.step = 0
        self.epoch_ooms = 0
        self.epoch_split = 1
        self._unlocated: List[Event] = []  # the planners' events, not yet located
        self._planners: Dict[Tuple[str, Hashable], BatchPlanner] = {}
        self._train_parts: Optional[TrainParts] = None
        self._test_parts: Optional[Tuple[Tuple[Any, Guard], SplitBatches]] = None
        self._predict_step: Any = None
        # phase -> (the most pieces one batch was run as, that batch's rows)
        self.most_pieces: Dict[str, Tuple[int, int]] = {}
        # Under a tf.distribute strategy, batches are split per replica.
        replicas = replicas_of(model)
        self._replicas = (
            None if replicas is None else ReplicaRun(self, replicas)
        )

    def start_epoch(self, epoch: int) -> None:
        """Start counting the OOMs and the split of `epoch`."""
        self.epoch = epoch
        self.epoch_ooms = 0
        self.epoch_split = 1

    # ---------------------------------------------------------------- train
    def train(self, batches: List[Any]) -> Any:
        """Train on each Keras batch; returns the last one's logs."""
        if self._replicas is not None:
            return self._replicas.train(batches)
        if len(batches) == 1:  # steps_per_execution=1: the check below, once per step
            chunk = as_chunk(batches[0])
            n = splittable_rows(chunk)
            if n is None:
                return self.keras_call("train", batches, first_unsplittable([chunk]))
            return self._train_batch(chunk, n, form_of(batches[0]))
        chunks = [as_chunk(batch) for batch in batches]
        rows = [splittable_rows(chunk) for chunk in chunks]  # None: cannot be split
        if None in rows:
            return self.keras_call("train", batches, first_unsplittable(chunks))
        logs = None
        for batch, chunk, n in zip(batches, chunks, rows):
            logs = self._train_batch(chunk, n, form_of(batch))
        return logs

    def _train_batch(self, chunk: tuple, n: int, form: int) -> Any:
        """Train on one Keras batch of `n` rows (packed as `form`): whole while it fits, else in pieces."""
        parts = self._train_parts_for(chunk, form)
        planner = self.planner_for("train", _data.signature(chunk[0]), n)
        run = self._step_runner(parts.step, planner, form)
        guard = None if parts.step.snapshots_itself else parts.guard
        try:
            # The whole batch first, without the loop's bookkeeping (once per Keras step).
            logs = run_whole(self.model, "train", chunk, run, planner, guard=guard,
                             rows=n)
            if logs is SPLIT:
                logs = self._train_pieces(parts, chunk, n, form, planner, run, guard)
            planner.finish_batch()
        finally:
            if self._unlocated:
                self.note_events(n)
        return logs

    def _train_pieces(self, parts: TrainParts, chunk: tuple, n: int, form: int,
                      planner: BatchPlanner, run: Callable[[tuple], Any],
                      guard: Optional[Guard]) -> Any:
        """The batch as pieces (train steps, or accumulated micro-batches); the last logs."""
        pieces = Pieces()
        accumulation = None
        if self.mode == "accumulate":
            accumulation = self._accumulation(parts, chunk, form, planner, pieces)
        run_in_pieces(
            self.model, "train", [chunk], run, pieces, requested=None, planner=planner,
            guard=guard, accumulation=accumulation,
        )
        self.epoch_split = max(self.epoch_split, pieces.count)
        self.note_pieces("train", pieces.count, n)
        if pieces.count > 1:
            self._split_warnings.split(chunk[0])
        return pieces.result

    def _step_runner(
        self, step: TrainStep, planner: BatchPlanner, form: int
    ) -> Callable[[tuple], Any]:
        """`step` on a piece, packed as Keras packed its batch; an OOM after its update began is final."""

        def run(piece: tuple) -> Any:
            try:
                return step(as_batch(piece, form))
            except Exception as exc:
                if is_oom_error(exc) and step.last_outcome is StepOutcome.UPDATE_BEGAN:
                    raise self._oom_error(piece, planner, UPDATE_BEGAN) from exc
                raise

        return run

    def _accumulation(
        self, parts: TrainParts, chunk: tuple, form: int, planner: BatchPlanner, pieces: Pieces
    ) -> Accumulation:
        """`chunk` as micro-batches whose summed gradients make one update.

        `pieces.count` ends as the micro-batches (`on_piece` adds the apply).
        """
        model = self.model

        def begin() -> None:
            if parts.accumulator is None:
                parts.accumulator = _backend.get().make_accumulator(model)
            self._split_warnings.accumulated()
            parts.accumulator.reset()
            parts.counted.begin()
            pieces.count = -1  # on_piece counts the chunk once more

        def add(piece: tuple, share: float) -> None:
            parts.accumulator.add(as_batch(piece, form), share)
            pieces.count += 1

        def finish() -> Any:
            try:
                parts.accumulator.apply()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise self._oom_error(
                    chunk, planner, UPDATE, held=parts.accumulator.held()) from exc
            parts.counted.settle()
            return model.get_metrics_result()

        return Accumulation(begin=begin, add=add, finish=finish, guard=parts.guard)

    def release(self) -> None:
        """Free the accumulators' sums (the weights' size; made again when next needed)."""
        if self._train_parts is not None:
            self._train_parts.accumulator = None
        if self._replicas is not None:
            self._replicas.release()

    def _train_parts_for(self, chunk: tuple, form: int) -> TrainParts:
        if self._train_parts is None:
            backend = _backend.get()
            model = self.model
            custom = not backend.has_default_train_step(model)
            if not custom:  # builds the model, its metrics and loss, and the optimizer too
                backend.prepare_test(model, _data.rows(chunk, 0, 1))
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
                if custom:  # built as Keras builds it: by the step itself, on Keras's batch
                    step = backend.make_custom_train_step(model, as_batch(chunk, form))
                else:
                    step = backend.make_train_step(model)
                if isinstance(step, OrderedTrainStep):  # when its update may begin
                    step.use_peak_estimate(training_peak(model))
                return TrainParts(
                    step=step,
                    guard=backend.guard_variables(_model_state.train_state_variables(model)),
                    counted=CountedOnce(model),
                )

            self._train_parts = _cache.per_model(model, key, build)
        return self._train_parts

    def _oom_error(
        self, chunk: tuple, planner: BatchPlanner, cause: str, held: Optional[str] = None
    ) -> OutOfMemoryError:
        """The error for an OOM once the optimizer update of `chunk`'s rows began (`cause`)."""
        return OutOfMemoryError(
            self.model.name, "train", _data.shapes(_data.rows(chunk[0], 0, 1)),
            planner.device, cause=cause, rows=_data.num_rows(chunk), held=held,
        )

    # ------------------------------------------------------------- evaluate
    def test(self, batches: List[Any]) -> Any:
        """Evaluate each Keras batch; returns the last one's logs."""
        if self._replicas is not None:
            return self._replicas.test(batches)
        reason = first_unsplittable(as_chunk(batch) for batch in batches)
        if reason is not None:
            return self.keras_call("test", batches, reason)
        model = self.model
        pieces = Pieces()

        def on_piece(size: int, piece: tuple, result: Any) -> bool:
            split.finished(size)
            return pieces(size, piece, result)

        for batch in batches:
            chunk = as_chunk(batch)
            form = form_of(batch)
            if self._test_parts is None:
                self._test_parts = (  # traced as Keras's evaluate traces its step
                    test_step_and_guard(model, chunk, exact=False), SplitBatches(model, False))
            (step, guard), split = self._test_parts
            n = _data.num_rows(chunk)
            split.begin_batch(n)
            run = split.step(  # a split batch counts once for the per-output losses
                lambda piece: step(as_batch(piece, form)),
                lambda piece: _exact_test_step(model, piece, form),
            )
            planner = self.planner_for("evaluate", _data.signature(chunk[0]), n)
            pieces.count = 0
            try:
                run_in_pieces(
                    model, "evaluate", [chunk], run, on_piece,
                    requested=None, guard=guard, planner=planner,
                )
                planner.finish_batch()
                self.note_pieces("evaluate", pieces.count, n)
                if pieces.count > 1:
                    self._split_warnings.split(chunk[0])
            finally:
                self.note_events(n)
        return pieces.result if pieces.ran else {}

    # -------------------------------------------------------------- predict
    def predict(self, batches: List[Any]) -> Any:
        """Predict each Keras batch; returns the outputs, concatenated.

        A batch run whole gives the step's own tensors, as Keras's
        `predict_function` does; pieces are gathered on the host.
        """
        if self._replicas is not None:
            return self._replicas.predict(batches)
        reason = first_unsplittable(as_chunk(batch) for batch in batches)
        if reason is not None:
            return self.keras_call("predict", batches, reason)
        if self._predict_step is None:
            self._predict_step = predict_step(self.model)
        step = self._predict_step
        outputs: List[Any] = []

        def on_piece(size: int, piece: Any, result: Any) -> bool:
            outputs.append(result)
            return False

        for batch in batches:
            x = keras.utils.unpack_x_y_sample_weight(batch)[0]
            n = _data.num_rows(x)
            planner = self.planner_for("predict", _data.signature(x), n)
            before = len(outputs)
            try:
                run_in_pieces(
                    self.model, "predict", [(x,)], lambda piece: step(piece[0]),
                    on_piece, requested=None, planner=planner,
                )
                planner.finish_batch()
                self.note_pieces("predict", len(outputs) - before, n)
                if len(outputs) - before > 1:
                    self._split_warnings.split(x)
            finally:
                self.note_events(n)
        return concatenate(outputs)

    # ------------------------------------------------- batches MemFit passes on
    def keras_call(self, kind: str, batches: List[Any], reason: Optional[str]) -> Any:
        """Keras's own `<kind>_function` on `batches`, which MemFit cannot split.

        Args:
            kind: "train", "test" or "predict".
            batches: The batches already pulled from Keras's iterator.
            reason: What cannot be split (see `batches.unsplittable`), named
                by the error if Keras's function runs out of memory.
        """
        try:
            return self.keras_function(kind, batches)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            raise _cannot_split_error(self.model, kind, reason) from exc

    # --------------------------------------------------------------- shared
    def planner_for(self, phase: str, signature: Hashable, rows: int) -> BatchPlanner:
        """The planner of `phase` at `signature`, told that a batch of `rows` begins.

        Every phase tries the whole batch first (`probe="after_oom"`): a
        batch that fits runs as Keras would run it.
        """
        key = (phase, signature)
        planner = self._planners.get(key)
        if planner is None:
            planner = self._planners[key] = BatchPlanner(
                self.model, phase, signature, None, self._unlocated, probe="after_oom"
            )
        planner.start_batch(rows)
        return planner

    @property
    def adapted(self) -> bool:
        """Whether anything was adapted: an event, or a batch run as pieces."""
        return bool(self.events or self.most_pieces)

    def note_pieces(self, phase: str, pieces: int, rows: int) -> None:
        """Record that a batch of `rows` of `phase` ran as `pieces` pieces."""
        if pieces > 1 and pieces >= self.most_pieces.get(phase, (0, 0))[0]:
            self.most_pieces[phase] = (pieces, rows)

    def note_events(self, batch_rows: Optional[int]) -> None:
        """Locate the planners' new events at the current epoch and step (a batch of `batch_rows`)."""
        for event in self._unlocated:
            if event.kind == "oom":
                self.epoch_ooms += 1
                if event.phase == "train" and self.fallback:
                    logger.warning("%s", self.fallback)
                    self.fallback = None
            self.events.append(event.located(self.epoch, self.step, batch_rows))
        self._unlocated.clear()


def _exact_test_step(model: keras.Model, piece: tuple, form: int) -> Callable[[tuple], Any]:
    """The test step whose per-output loss trackers weight a piece by its rows, packed as `form`."""
    step = test_step_and_guard(model, piece, exact=True)[0]
    return lambda piece: step(as_batch(piece, form))


def _cannot_split_error(
    model: keras.Model, kind: str, received: Optional[str]
) -> OutOfMemoryError:
    """The error for an OOM in Keras's own `kind` function on a batch MemFit cannot split."""
    return OutOfMemoryError(
        model.name, _PHASE_OF_KIND.get(kind, kind), cause=CANNOT_SPLIT, received=received)
