"""Compiled predict and test steps, their traced outputs, and variable guards.

The steps donate nothing. A *started* step (`start`) writes its new state at once, and `wait()`
puts the old one back if the computation failed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import NO_SPEC, model_of, spec_of_two_sizes
from keras_memfit.backend.jax import distribution
from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax.memory import compiles_per_shape

PREDICT_STATE = _state.GROUPS["predict"]
TEST_STATE = _state.GROUPS["test"]


# The pass off on the CPU: else XLA merges `jax.checkpoint`'s recomputation back (docs/training.md).
COMPILER_OPTIONS = {"cpu": {"xla_disable_hlo_passes": "cse_barrier_expander"}}


def _compile(model: keras.Model, fn: Callable, donate_argnums: Tuple[int, ...] = ()) -> Callable:
    """`fn` jitted as Keras compiles steps, donating only `donate_argnums`; eager: `fn`."""
    if not compiles_per_shape(model):
        return fn
    options = COMPILER_OPTIONS.get(jax.default_backend())
    return jax.jit(fn, donate_argnums=donate_argnums, compiler_options=options)


class _Step:
    """A compiled step over the model's state, held weakly (`traced`: False when run eagerly)."""

    names: Tuple[str, ...]

    def __init__(self, model: keras.Model, fn: Callable) -> None:
        self._model_ref = weakref.ref(model)
        self._fn = fn
        self._compiled = _compile(model, fn)
        self.traced = self._compiled is not fn

    def model(self) -> keras.Model:
        return model_of(self._model_ref)

    def __call__(self, data: Any) -> Any:
        return self.start(data).wait()

    def start(self, data: Any) -> "Started":
        """Start the step on the state groups `names`; it returns its output, then `names[1:]`."""
        model = self.model()
        state = _state.get(model, self.names)
        result = self._compiled(*state, data)
        written = self.names[1:]
        _state.put(model, written, result[1:])
        return Started(model, written, state[1:], result)


class Started(NamedTuple):
    """A `StartedPiece`: `before` holds the values of `names` it replaced."""

    model: keras.Model
    names: Sequence[str]
    before: Sequence[Any]
    result: Any

    def wait(self) -> Any:
        try:
            jax.block_until_ready(self.result)
        except BaseException:
            self.undo()
            raise
        return self.result[0]

    def undo(self) -> None:
        _state.put(self.model, self.names, self.before)


class PredictStep(_Step):
    """`x -> outputs`: the model's `predict_step` (then `postprocess`), compiled."""

    names = PREDICT_STATE

    def __init__(self, model: keras.Model, postprocess: Optional[Callable]) -> None:
        model_ref = weakref.ref(model)

        def predict_fn(trainable, non_trainable, x):
            outputs, non_trainable = model_ref().predict_step((trainable, non_trainable), (x,))
            if postprocess is not None:
                outputs = postprocess(outputs)
            return outputs, non_trainable

        super().__init__(model, predict_fn)

    def spec(self, x: Any) -> Any:
        """Output structure of `self(x)` by tracing only."""
        state = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state.get(self.model(), self.names)
        )
        rows = distribution.batch_rows(x)

        def at(n: int) -> Any:
            xs = keras.tree.map_structure(  # None: an optional input left out
                lambda a: None if a is None else jax.ShapeDtypeStruct(
                    (n,) + tuple(a.shape[1:]), a.dtype
                ),
                x,
            )
            return jax.eval_shape(self._fn, *state, xs)[0]

        return spec_of_two_sizes(
            at(rows), at(rows + 1),
            lambda leaf: np.dtype(leaf.dtype) if hasattr(leaf, "shape") else None)


class TestStep(_Step):
    """`(x, y, sample_weight) -> logs`: the model's `test_step`, compiled."""

    names = TEST_STATE

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)

        def test_fn(trainable, non_trainable, metrics, data):
            logs, state = model_ref().test_step((trainable, non_trainable, metrics), data)
            return logs, state[1], state[2]

        super().__init__(model, test_fn)


def _laid_out(step: _Step, combine: Callable[[Any, Any], Any]) -> Any:
    """`step`; under `DataParallel` its pieces laid out over the devices."""
    if distribution.variant() is distribution.Variant.DATA_PARALLEL:
        return distribution.ShardedStep(step, combine)
    return step


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Union[PredictStep, distribution.ShardedStep]:
    """A `PredictStep`; under `DataParallel` its pieces laid out over the devices."""
    return _laid_out(PredictStep(model, postprocess), distribution.concatenate_outputs)


# Keras's JAX trainer compiles with static shapes: per-output losses weigh a batch by its rows.
KERAS_COUNTS_EACH_BATCH_ONCE = False
KERAS_BEGINS_BATCH_BEFORE_FETCH = True


def make_test_step(
    model: keras.Model, exact: bool = False
) -> Union[TestStep, distribution.ShardedStep]:
    """A `TestStep` (`exact` changes nothing); under `DataParallel` laid out over the devices."""
    return _laid_out(TestStep(model), distribution.last_logs)


class VariableGuard:
    """A `Guard` keeping references; inside `state.threaded`, over the whole tuple."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._call: Optional[_state.Threaded] = None
        self._saved: Optional[Any] = None  # the call's snapshot, or the variables' values

    def snapshot(self) -> None:
        self._call = _state.active()
        if self._call is not None:
            self._saved = self._call.snapshot()
        else:
            self._saved = _state.read(self._variables)

    def restore(self) -> None:
        if self._call is not None:
            self._call.restore(self._saved)
        elif self._saved is not None:
            _state.write(self._variables, self._saved)


def guard_variables(variables: Sequence[Any]) -> VariableGuard:
    return VariableGuard(variables)


def prepare_test(model: keras.Model, batch: Any) -> None:
    x, y, sample_weight = batch
    _keras_compat.symbolic_build(model, (x, y, sample_weight))
    _state.refresh(model)  # once per safe_evaluate call: the variable lists anew


def output_spec(step: Callable, x: Any) -> Any:
    """`NO_SPEC` for eager steps; else `PredictStep.spec`."""
    if not isinstance(step, PredictStep):
        step = getattr(step, "__wrapped__", None)  # a functools.wraps wrapper
    if not isinstance(step, PredictStep):
        return NO_SPEC
    _state.refresh(step.model())  # once per safe_predict call: the variable lists anew
    if not step.traced:
        return NO_SPEC
    return step.spec(x)
