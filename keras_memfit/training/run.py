"""MemFit's work during one call, backend-neutral: what it does with each batch (`Run`).

Each batch runs whole first (`runner.run_whole`), after an OOM in pieces (`run_in_pieces`);
batches MemFit cannot split go to Keras's own step function (`Run.pass_on`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import concatenate
from keras_memfit.backend.base import (
    Accumulator, Cut, Guard, TrainStep,
)
from keras_memfit.inference.output_losses import CountedOnce, SplitBatches
from keras_memfit.oom import (
    ACCUMULATE,
    CANNOT_SPLIT,
    ONE_LAYER,
    ONE_SAMPLE,
    UPDATE,
    OutOfMemoryError,
    is_oom_error,
)
from keras_memfit.planning.planner import BatchPlanner, Event
from keras_memfit.planning.runner import (
    SPLIT,
    Accumulation,
    Piece,
    drop_frames,
    run_in_pieces,
    run_whole,
    update_error,
)
from keras_memfit.training.batch_dependence import SplitWarnings
from keras_memfit.training.layout import layout_of
from keras_memfit.training.remat import Rematerialization, Setting

logger = logging.getLogger("keras_memfit")

MODES = ("accumulate", "shrink")
_PHASE_OF_KIND = {"test": "evaluate"}  # Keras's function kinds, as OutOfMemoryError.phase


@dataclasses.dataclass
class TrainParts:
    """What training one model needs, cached per model and layout (`accumulator`: made at
    the first split, dropped by `Run.release`)."""

    step: TrainStep
    guard: Guard
    counted: CountedOnce
    accumulator: Optional[Accumulator] = None


class Run:
    """MemFit's state during one `fit`, or one standalone `evaluate` or `predict`.

    `keras_functions`: Keras's own step functions, for the batches MemFit cannot split;
    `fallback`: why "shrink" replaces "accumulate" (logged at the first training OOM), or None.
    `epoch_ooms`, `epoch_split`, `epoch_remat`: this epoch's values for the epoch logs.
    """

    def __init__(
        self,
        model: keras.Model,
        mode: str,
        keras_functions: Mapping[str, Callable[..., Any]],
        fallback: Optional[str] = None,
        remat: Setting = False,
    ) -> None:
        self.model = model
        self.mode = mode
        self.remat = Rematerialization(model, remat)
        self._remat_names: Tuple[str, ...] = ()  # the layers recomputed for the batch
        self._pieces_run = 0  # pieces of the batch applied (mode "shrink")
        self.keras_functions = keras_functions
        self.fallback = fallback
        self.layout = layout_of(model)
        self.stateful = _model_state.stateful_layers(model)  # its batches go to Keras's steps
        self._split_warnings = SplitWarnings(model)  # once per run, at the first split
        self.events: List[Event] = []
        self.step = 0
        self.start_epoch(0)
        self._unlocated: List[Event] = []  # the planners' events, not yet located
        self._planners: Dict[Tuple[str, Hashable], BatchPlanner] = {}
        self._train_parts: Optional[TrainParts] = None
        self._weighting: Optional[str] = None  # `reductions.weighting`, at the first split
        self._test_parts: Optional[Tuple[Callable, Guard, SplitBatches]] = None
        self._predict_step: Optional[Callable[[Any], Any]] = None
        # phase -> (the most pieces one batch was run as, that batch's rows)
        self.most_pieces: Dict[str, Tuple[int, int]] = {}

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epoch_ooms = 0
        self.epoch_split = 1
        self.epoch_remat = 0

    def _cut(self, batch: Any) -> Optional[Cut]:
        return None if self.stateful else self.layout.cut(batch)

    # ---------------------------------------------------------------- train
    def train(self, batches: Iterable[Any]) -> Any:
        """Train on each Keras batch, one at a time; returns the last one's logs."""
        logs = None
        for batch in batches:
            cut = self._cut(batch)
            logs = self.pass_on("train", [batch]) if cut is None else self._train_batch(cut)
            del batch, cut  # not held while the next batch is pulled
        return logs

    def _train_batch(self, cut: Cut) -> Any:
        """One batch, whole or in pieces; where one sample does not fit, recompute more."""
        while True:
            names = self.remat.apply(cut.signature)
            if names != self._remat_names:  # steps traced again, memory planned afresh
                self._remat_names, self._train_parts = names, None
            self.epoch_remat = max(self.epoch_remat, len(names))
            self._pieces_run = 0
            parts = self._train_parts_for(cut)
            planner = self._planner("train", cut)
            guard = None if parts.step.snapshots_itself else parts.guard
            try:
                logs = run_whole(self.model, "train", cut.chunk, parts.step, planner,
                                 guard=guard, cut=cut)
                if logs is SPLIT:
                    logs = self._train_pieces(parts, cut, planner, guard)
                planner.finish_batch()
                return logs
            except OutOfMemoryError as exc:
                if exc.cause != ONE_SAMPLE or self._pieces_run:
                    raise
                drop_frames(exc)  # the failed piece's buffers, freed before anything else
                beyond = self._layer_beyond_free(exc, cut, planner)
                if beyond is not None:
                    raise beyond
                if not self.remat.escalate(cut.signature, cut.x):
                    raise self._remat_error(exc, cut)
            finally:
                self._note_events(cut.lanes)
            self._remat_event(cut)

    def _remat_event(self, cut: Cut) -> None:
        """Record (and log) that more layers are recomputed for `cut`'s signature."""
        names = self.remat.names(cut.signature)
        ratio = self.remat.step_time(cut.signature)
        cost = "" if ratio is None else f" (estimated step time x{ratio})"
        self._unlocated.append(Event(
            phase="train", kind="remat", old_size=1, new_size=1,
            reason=(f"one sample did not fit; recomputing {len(names)} layer(s) in the "
                    f"backward pass{cost}: {', '.join(names)}"),
            layers=names, step_time=ratio,
        ))
        logger.warning("MemFit: %s", self._unlocated[-1].reason)
        self._note_events(cut.lanes)

    def _remat_error(self, exc: OutOfMemoryError, cut: Cut) -> OutOfMemoryError:
        """`exc`, saying which layers were recomputed when one sample still did not fit."""
        names = self._remat_names
        if not names:
            return exc
        saving = self.remat.saving(cut.signature)
        freed = f", estimated to free {saving / 2**20:.1f} MiB per sample," if saving else ""
        return _instead(exc, ONE_SAMPLE, (
            f"MemFit already recomputed {len(names)} layer(s) in the backward pass "
            f"({', '.join(names)}){freed} and found no more to recompute."),
            can_place=exc.can_place)

    def _layer_beyond_free(self, exc: OutOfMemoryError, cut: Cut,
                           planner: BatchPlanner) -> Optional[OutOfMemoryError]:
        """The error where one layer's own backward pass needs more than is free, or None."""
        free = planner.free_bytes()
        if self.remat.setting != "auto" or free is None:
            return None
        columns = _backend.get().conv_columns(self.model, planner.device)
        need = self.remat.heaviest(columns, cut.x)
        if need is None or need.total <= free:
            return None
        layer = need.layer
        matrix = (f", and its convolution's column matrix of {need.columns / 2**20:.1f} MiB"
                  if need.columns else "")
        return _instead(exc, ONE_LAYER, (
            f"Estimated: {need.total / 2**20:.1f} MiB for '{layer.name}' "
            f"({type(layer).__name__}: its inputs, outputs and their gradients"
            f"{matrix}), {free / 2**20:.1f} MiB free on {planner.device}."), layer=layer.name)

    def _train_pieces(self, parts: TrainParts, cut: Cut, planner: BatchPlanner,
                      guard: Optional[Guard]) -> Any:
        accumulate = self.mode == "accumulate"
        accumulation = self._accumulation(parts, cut, planner) if accumulate else None
        logs, count = None, 0
        for piece in run_in_pieces(
            self.model, "train", [cut.chunk], parts.step, requested=None, planner=planner,
            guard=guard, accumulation=accumulation, cut=cut,
        ):
            logs = piece.result
            count += piece.parts
            self._pieces_run += 1
        self.epoch_split = max(self.epoch_split, count)
        self._note_pieces("train", count, cut)
        return logs

    def _accumulation(self, parts: TrainParts, cut: Cut, planner: BatchPlanner) -> Accumulation:
        """`cut`'s batch as micro-batches whose summed gradients make one update."""
        model = self.model
        if self._weighting is None:
            self._weighting = _reductions.weighting(model)[0]

        def begin() -> None:
            try:
                if parts.accumulator is None:
                    parts.accumulator = self.layout.accumulator(model)
                parts.accumulator.reset()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                parts.accumulator = None  # frees the sums made before the OOM
                raise update_error(model, cut.chunk, planner.device, ACCUMULATE, cut.rows) from exc
            self._split_warnings.accumulated()
            parts.counted.begin()

        def add(piece: tuple) -> None:
            parts.accumulator.add(*cut.micro_batch(piece, self._weighting))

        def finish() -> Any:
            try:
                parts.accumulator.apply()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise update_error(model, cut.chunk, planner.device, UPDATE, cut.rows,
                                   held=parts.accumulator.held()) from exc
            parts.counted.settle()
            return model.get_metrics_result()

        return Accumulation(begin=begin, add=add, finish=finish, guard=parts.guard)

    def release(self) -> None:
        """Free the accumulator's sums; put recomputed calls back."""
        if self._train_parts is not None:
            self._train_parts.accumulator = None
        self.remat.release()
        self._remat_names, self._train_parts = (), None

    def _train_parts_for(self, cut: Cut) -> TrainParts:
        if self._train_parts is None:
            model, layout = self.model, self.layout
            custom = not _model_state.has_default_train_step(model)
            if not custom:  # builds the model, its metrics and loss, and the optimizer too
                layout.prepare(model, cut)
            key = (
                "train",
                _backend.get().step_variant(model),  # the layout's too
                custom,
                id(model.optimizer),
                tuple(id(v) for v in model.trainable_variables),
                tuple(id(v) for v in model.metrics_variables),
                bool(getattr(model, "run_eagerly", False)),
                model.jit_compile,
                self._remat_names,
            )
            self._train_parts = _cache.per_model(model, key, lambda: TrainParts(
                step=layout.train_step(model, custom, cut),
                guard=_backend.get().guard_variables(_model_state.train_state_variables(model)),
                counted=CountedOnce(model, copies=layout.copies),
            ))
        return self._train_parts

    # ------------------------------------------------------------- evaluate
    def test(self, batches: Iterable[Any]) -> Any:
        """Evaluate each Keras batch, one at a time; returns the last one's logs."""
        logs: Any = {}
        for batch in batches:
            cut = self._cut(batch)
            logs = self.pass_on("test", [batch]) if cut is None else self._test_batch(cut, logs)
            del batch, cut  # not held while the next batch is pulled
        return logs

    def _test_batch(self, cut: Cut, logs: Any) -> Any:
        if self._test_parts is None:
            step, guard = self.layout.test_step(self.model, cut, exact=False)
            self._test_parts = (step, guard, SplitBatches(self.model, False, self.layout.copies))
        step, guard, split = self._test_parts
        split.begin_batch(cut.lanes)

        def make_exact(first: tuple) -> Callable[[tuple], Any]:  # a split batch's pieces
            exact = self.layout.test_step(self.model, cut, exact=True)[0]
            return lambda piece: exact(cut.batch(piece))

        run = split.step(lambda piece: step(cut.batch(piece)), make_exact)
        for piece in self._pieces("evaluate", cut, run, guard):
            split.finished(piece)  # a split batch counts once for its losses
            logs = piece.result
        return logs

    # -------------------------------------------------------------- predict
    def predict(self, batches: Iterable[Any]) -> Any:
        """Predict each Keras batch; the outputs in input order."""
        batches = list(batches)
        cuts = [self._cut(batch) for batch in batches]
        if None in cuts:
            return self.pass_on("predict", batches)
        if self._predict_step is None:
            self._predict_step = self.layout.predict_step(self.model)
        step = self._predict_step
        outputs: List[Any] = []
        for cut in cuts:
            pieces = self._pieces("predict", cut, lambda piece, cut=cut: step(cut.batch(piece)))
            outputs.append(cut.join([piece.result for piece in pieces]))
        return concatenate(outputs)

    # ------------------------------------------------- batches MemFit passes on
    def pass_on(self, kind: str, batches: List[Any]) -> Any:
        """Keras's own `<kind>_function` on `batches`, which MemFit cannot split."""
        function = self.keras_functions.get(f"{kind}_function")
        if function is None:  # not made yet: Keras makes it as its loop would
            function = getattr(self.model, f"make_{kind}_function")(force=True)
        try:
            return _backend.get().call_keras_function(self.model, kind, function, batches)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            raise OutOfMemoryError(
                self.model.name, _PHASE_OF_KIND.get(kind, kind), cause=CANNOT_SPLIT,
                received=self.layout.unsplittable(batches), stateful=self.stateful,
            ) from exc

    # --------------------------------------------------------------- shared
    def _pieces(self, phase: str, cut: Cut, step: Callable[[Any], Any],
                guard: Optional[Guard] = None) -> Iterator[Piece]:
        """`cut`'s batch in pieces by `phase`'s planner (evaluate, predict); then its events."""
        planner = self._planner(phase, cut)
        count = 0
        try:
            for piece in run_in_pieces(self.model, phase, [cut.chunk], step, requested=None,
                                       guard=guard, planner=planner):
                count += 1
                yield piece
            planner.finish_batch()
            self._note_pieces(phase, count, cut)
        finally:
            self._note_events(cut.lanes)

    def _planner(self, phase: str, cut: Cut) -> BatchPlanner:
        """The planner of `phase` at `cut`'s signature, told that a batch begins."""
        signature = cut.signature
        if phase == "train" and self._remat_names:  # another step: memory planned afresh
            signature = (signature, self._remat_names)
        planner = self._planners.get((phase, signature))
        if planner is None:
            planner = self._planners[phase, signature] = BatchPlanner(
                self.model, phase, signature, None, self._unlocated, probe="after_oom"
            )
        planner.start_batch(cut.lanes)
        return planner

    @property
    def adapted(self) -> bool:
        """Whether anything was adapted: an event, or a batch run as pieces."""
        return bool(self.events or self.most_pieces)

    def _note_pieces(self, phase: str, pieces: int, cut: Cut) -> None:
        """Note a batch run as `pieces` pieces (more than one: warn once if rows couple)."""
        if pieces > 1:
            if pieces >= self.most_pieces.get(phase, (0, 0))[0]:
                self.most_pieces[phase] = (pieces, cut.rows)
            self._split_warnings.split(cut.x)

    def _note_events(self, batch_rows: Optional[int]) -> None:
        """Locate the planners' new events at the current epoch and step."""
        for event in self._unlocated:
            if event.kind in ("oom", "remat"):  # a rung of remat follows an OOM too
                self.epoch_ooms += 1
                if event.phase == "train" and self.fallback:
                    logger.warning("%s", self.fallback)
                    self.fallback = None
            self.events.append(event.located(self.epoch, self.step, batch_rows))
        self._unlocated.clear()


def _instead(exc: OutOfMemoryError, cause: str, detail: str, **more: Any) -> OutOfMemoryError:
    """The error raised instead of `exc` (its model, phase, batch shape, device, cause)."""
    error = OutOfMemoryError(exc.model_name, exc.phase, exc.batch_shape, exc.device,
                             cause=cause, detail=detail, **more)
    error.__cause__ = exc.__cause__
    return error
