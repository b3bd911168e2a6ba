"""Train steps that never lose the model's state to an OOM; the seam's `Training`.

`TrainStep` runs Keras's default step as a *gradient program*, which donates nothing, then an
in-place *update program* (ARCHITECTURE.md). The factories choose the variant of
`distribution.variant()`.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import keras

from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal import reductions as _reductions
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax.accumulation import (
    TRAIN_STATE, GradientAccumulator, gradients_and_metrics,
)
from keras_memfit.backend.jax.oom import is_oom_error
from keras_memfit.backend.jax import distribution, process_training
from keras_memfit.backend.jax import memory as _memory
from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax.steps import _compile

logger = logging.getLogger("keras_memfit")

# Room for what a step allocates beside its programs (the batch's logs, dispatch).
SPLIT_MARGIN = 16 << 20

OOM_RAISES_AT_DISPATCH: Dict[str, Optional[bool]] = {
    "cpu": False,  # measured: tests/test_jax_async_oom.py
    "gpu": None,
    "tpu": None,
}
"""Whether a program's OOM raises when it is called, per platform (None: unknown).

Else `TrainStep` waits for the gradient program: an update dispatched on a failed program's
outputs loses its donated inputs. `benchmarks.gpu`'s JAX "dispatch" check tells which.
"""


def oom_raises_at_dispatch() -> bool:
    """`OOM_RAISES_AT_DISPATCH` for JAX's first device (False where unknown)."""
    return OOM_RAISES_AT_DISPATCH.get(jax.devices()[0].platform) is True


def _nbytes(tree: Any) -> int:
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree)
               if hasattr(leaf, "dtype") and hasattr(leaf, "size"))


def _new_bytes(analysis: Any) -> int:
    """What a compiled program allocates when it runs."""
    return (analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)


def _signature(data: Any) -> Tuple[Any, ...]:
    return tuple([(getattr(leaf, "shape", None), getattr(leaf, "dtype", type(leaf)))
                  for leaf in jax.tree_util.tree_leaves(data)])


def _first_array(tree: Any) -> Any:
    """One array of `tree`, or `tree`."""
    return next((leaf for leaf in jax.tree_util.tree_leaves(tree)
                 if isinstance(leaf, jax.Array)), tree)


def _wait(outputs: Any, compiled: bool = True) -> None:
    """Wait for `outputs`; of a compiled program, for one array (all are ready together)."""
    jax.block_until_ready(_first_array(outputs) if compiled else outputs)


class TrainStep:
    """Keras's default train step as a gradient program and an in-place update program.

    A model's own `train_step` (`custom`) runs whole, without donation. `last_outcome` is
    `UPDATE_BEGAN` when the previous update program, or a fused step, failed.
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model, custom: bool = False) -> None:
        model_ref = self._model_ref = weakref.ref(model)
        self._custom = custom
        self._waits_for_gradients = not oom_raises_at_dispatch()
        self.last_outcome: Optional[StepOutcome] = None

        # Keras's own step: a model's own `train_step` run whole, without donation; Keras's
        # default one donating the whole state, only where the two programs would not fit.
        def keras_fn(state, data):
            return model_ref().train_step(state, data)

        if custom:
            self._whole = _compile(model, keras_fn)
            return

        def grad_fn(trainable, non_trainable, optimizer, metrics, data):
            return gradients_and_metrics(
                model_ref(), trainable, non_trainable, optimizer, metrics, data)

        # The arguments in the order of the outputs: each donated buffer is reused for its own.
        def update_fn(trainable, optimizer, grads):
            return model_ref().optimizer.stateless_apply(optimizer, grads, trainable)

        self._gradients = _compile(model, grad_fn)
        self._compiled = self._gradients is not grad_fn
        self._update = _compile(model, update_fn, donate_argnums=(0, 1))
        self._fused = _compile(model, keras_fn, donate_argnums=(0,))
        self._update_bytes: Optional[int] = None
        # data signature -> "split", "tight" or "fused" (`_choose`)
        self._mode_for: Dict[Tuple[Any, ...], str] = {}
        self._last_update: Any = None  # an output of the last update program

    def __call__(self, data: Any) -> Dict[str, Any]:
        model = self._model_ref()
        if self._custom:
            return self._call_keras(model, self._whole, _state.get(model, TRAIN_STATE), data)
        self._wait_for_update()
        current = _state.get(model, TRAIN_STATE)
        mode = "split"
        if self._compiled:
            key = _signature(data)
            mode = self._mode_for.get(key)
            if mode is None:
                mode = self._mode_for[key] = self._choose(model, current, data)
            if mode == "fused":
                return self._call_keras(model, self._fused, current, data)
        trainable, _, optimizer, _ = current
        if mode == "tight":
            gc.collect()
        try:
            try:
                outputs = self._run_gradients(current, data)
            except Exception as err:
                if mode == "split" or not is_oom_error(err):
                    raise
                # Freed memory may wait for the cycle collector; the state is untouched.
                del err
                gc.collect()
                outputs = self._run_gradients(current, data)
        except Exception:
            self.last_outcome = StepOutcome.UNTOUCHED
            raise
        grads, logs, non_trainable, metrics = outputs
        try:
            new_trainable, new_optimizer = self._update(trainable, optimizer, grads)
        except Exception:
            lost = any(getattr(a, "is_deleted", lambda: False)() for a in trainable + optimizer)
            self.last_outcome = StepOutcome.UPDATE_BEGAN if lost else StepOutcome.UNTOUCHED
            raise
        _state.put(model, TRAIN_STATE, (new_trainable, non_trainable, new_optimizer, metrics))
        self._last_update = _first_array(new_trainable)
        return logs

    def _run_gradients(self, current: List[List[Any]], data: Any) -> tuple:
        """The gradient program's outputs, waited for unless its OOM raises at dispatch."""
        outputs = self._gradients(*current, data)
        if self._waits_for_gradients:
            _wait(outputs, self._compiled)
        return outputs

    def _choose(self, model: keras.Model, current: List[List[Any]], data: Any) -> str:
        """How this input shape runs, from XLA's buffer analysis against the free memory: "split"
        (the two programs), "tight" (the same, collecting garbage first) or "fused" (Keras's)."""
        device = _memory.compute_device()
        if keras.distribution.distribution() is not None or _memory.free_bytes(device) is None:
            return "split"
        gc.collect()  # what the last steps freed, before the free memory is read
        try:
            gradients = self._gradients.lower(*current, data).compile().memory_analysis()
            if self._update_bytes is None:
                trainable, _, optimizer, _ = current
                update = self._update.lower(trainable, optimizer, trainable).compile()
                self._update_bytes = _new_bytes(update.memory_analysis())
        except Exception as err:  # noqa: BLE001 - no analysis (an OOM too): the two programs
            logger.debug("no buffer analysis of the train step: %s", err)
            return "split"
        free = _memory.free_bytes(device)  # after compiling: its code and caches are in use
        if gradients is None or free is None:
            return "split"
        grads = _nbytes(current[0])
        arrived = _nbytes([leaf for leaf in jax.tree_util.tree_leaves(data)
                           if not isinstance(leaf, jax.Array)])  # copied to the device
        split = arrived + max(_new_bytes(gradients), grads + self._update_bytes)
        if split + SPLIT_MARGIN <= free:
            return "tight" if 2 * split > free else "split"
        try:
            fused = self._fused.lower(tuple(current), data).compile().memory_analysis()
        except Exception as err:  # noqa: BLE001 - as above
            logger.debug("no buffer analysis of Keras's fused train step: %s", err)
            return "split"
        if fused is None or arrived + _new_bytes(fused) + SPLIT_MARGIN > free:
            return "split"  # an OOM of the fused step would lose the state: only with room
        shapes = [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(data)
                  if hasattr(leaf, "shape")]
        logger.warning(
            "train on model %r: at input shapes %s MemFit's two programs (gradients, then "
            "the in-place update) need %.1f MiB and %.1f MiB are free, so it runs Keras's "
            "own fused train step there (%.1f MiB, as plain fit does); an OOM in that step "
            "loses the training state, as in plain Keras, and MemFit then raises "
            "OutOfMemoryError.", model.name, shapes, split / 2**20, free / 2**20,
            (arrived + _new_bytes(fused)) / 2**20)
        return "fused"

    def _call_keras(self, model: keras.Model, program: Callable, current: List[List[Any]],
                    data: Any) -> Dict[str, Any]:
        """Keras's own step, waited for so that its OOM is reported here."""
        try:
            logs, state = jax.block_until_ready(program(tuple(current), data))
        except Exception:
            lost = any(getattr(a, "is_deleted", lambda: False)()
                       for group in current for a in group)
            self.last_outcome = StepOutcome.UPDATE_BEGAN if lost else StepOutcome.UNTOUCHED
            raise
        _state.put(model, TRAIN_STATE, state)
        return logs

    def _wait_for_update(self) -> None:
        """Wait for the previous update program, so that two sets of gradients are never held."""
        last, self._last_update = self._last_update, None
        if last is None or last.is_deleted():  # deleted: a later program consumed it
            return
        try:
            last.block_until_ready()
        except Exception:
            self.last_outcome = StepOutcome.UPDATE_BEGAN
            raise


def check_training_mode(model: keras.Model, mode: str) -> None:
    """Refuses only under several processes."""
    if distribution.variant() is not distribution.Variant.PROCESSES:
        return
    why = fix = None
    if mode != "accumulate":
        why, fix = f"received MemFit(mode={mode!r})", "Pass MemFit()"
    elif not _model_state.has_default_train_step(model):
        why = f"model '{model.name}' ({type(model).__name__}) has its own train_step"
        fix = "Train it without MemFit"
    elif _reductions.weighting(model)[0] != _reductions.ROWS:
        names = sorted({repr(r) for r in _reductions.loss_reductions(model)})
        why = f"model '{model.name}' has losses reduced with {', '.join(names)}"
        fix = "Use the default reduction"
    if why is not None:
        raise NotImplementedError(
            f"MemFit across {jax.process_count()} processes trains each batch as one update "
            "of every process (mode='accumulate', Keras's default train_step, losses reduced "
            f"with 'sum_over_batch_size' or 'mean'); {why}. {fix}, or train in one process."
        )


def _as_variant(model: keras.Model, one_device: Callable, laid_out: Callable,
                several: Callable) -> Any:
    """`model`'s step or accumulator for `distribution.variant()`."""
    chosen = distribution.variant()
    if chosen is distribution.Variant.PROCESSES:
        return several(model)
    made = one_device(model)
    return laid_out(made) if chosen is distribution.Variant.DATA_PARALLEL else made


def make_train_step(
    model: keras.Model, peak_at: Optional[Callable[[int], Optional[int]]] = None
) -> Any:
    """The variant's train step (`peak_at` unused)."""
    return _as_variant(model, TrainStep, distribution.ShardedTrainStep,
                       process_training.ProcessTrainStep)


def checkpoint(fn: Callable) -> Callable:
    """`jax.checkpoint(fn)`; `steps._compile` keeps its recomputation on XLA's CPU client."""
    return jax.checkpoint(fn)


def make_custom_train_step(model: keras.Model, data: Any) -> Any:
    """The model's own `train_step` run whole (`data` unused: Keras's `fit` built the model)."""
    check_training_mode(model, "accumulate")
    _state.refresh(model)
    whole = functools.partial(TrainStep, custom=True)  # under several processes too
    return _as_variant(model, whole, distribution.ShardedTrainStep, whole)


def make_accumulator(model: keras.Model) -> Any:
    return _as_variant(model, GradientAccumulator, distribution.ShardedAccumulator,
                       process_training.ProcessAccumulator)
