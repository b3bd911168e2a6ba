"""Compiled predict and test steps, their traced outputs, and variable guards.

Keras's JAX trainer compiles its steps with `donate_argnums=0`: the model's
state buffers are handed to the computation, so when it runs out of memory
the model is gone (`get_weights()` itself raises). The steps here are
compiled without donation: they read the model's current state (Keras's
state tuple inside keras_memfit's step functions, else the variables; see
`state`), run functionally, wait for the result (`block_until_ready`, so
that an OOM surfaces inside keras_memfit's retry loop, not at a later read)
and only then write the new state. A step that fails leaves the model
exactly as it was. The price is that the old and the new state coexist
during a step (for predict and test, only the non-trainable and metric
variables, which are small).

A step may also be *started* (`start`: a `backend.base.StartedPiece`): its
new state is written at once (the arrays still being computed), and
`wait()` puts the old state back if the computation failed. The runner keeps
pieces started ahead of the one it waits for, as Keras's own loops do.

JAX compiles once per input shape, so every distinct piece size is compiled
once (as Keras compiles its last, smaller batch).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import jax
import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import NO_SPEC, Spec, model_of
from keras_memfit.backend.jax import distribution
from keras_memfit.backend.jax import state as _state

PREDICT_STATE = ("trainable", "non_trainable")
TEST_STATE = ("trainable", "non_trainable", "metrics")


# XLA options per platform for the steps here. On the CPU client the pass
# `cse_barrier_expander` removes the optimization barriers `jax.checkpoint`
# puts around a recomputation before common-subexpression elimination runs,
# which then merges the recomputation with the forward pass: the
# rematerialized step kept everything (same peak as without). Without that
# pass the recomputation stays (a transformer's gradient: 462 -> 76 MiB of
# temporaries, the same gradients). A program without barriers is unchanged.
# The GPU run (`benchmarks/gpu.py`, JAX "remat") says whether GPUs need it too.
COMPILER_OPTIONS = {"cpu": {"xla_disable_hlo_passes": "cse_barrier_expander"}}


def _compile(model: keras.Model, fn: Callable, donate_argnums: Tuple[int, ...] = ()) -> Callable:
    """`fn` jitted as Keras would compile the model's steps, donating only `donate_argnums`.

    Keras donates the whole state; the steps here donate nothing by default.
    A model that runs eagerly gets `fn` itself (nothing is donated then).
    """
    if getattr(model, "run_eagerly", False) or not getattr(model, "jit_compile", True):
        return fn
    options = COMPILER_OPTIONS.get(jax.default_backend())
    return jax.jit(fn, donate_argnums=donate_argnums, compiler_options=options)


def values(variables: Sequence[Any]) -> List[Any]:
    """The current values (JAX arrays) of Keras variables (see `state.read`)."""
    return _state.read(variables)


def assign(variables: Sequence[Any], new_values: Sequence[Any]) -> None:
    """Write a step's `new_values` into `variables` (see `state.write`)."""
    _state.write(variables, new_values)


class _Step:
    """A compiled step over the model's state, held weakly.

    Attributes:
        traced: Whether the step is compiled (jitted), so `output_spec` can
            trace it; False for a model that runs eagerly.
    """

    def __init__(self, model: keras.Model, fn: Callable) -> None:
        self._model_ref = weakref.ref(model)
        self._fn = fn
        self._compiled = _compile(model, fn)
        self.traced = self._compiled is not fn

    def model(self) -> keras.Model:
        """The step's model; RuntimeError if it was deleted."""
        return model_of(self._model_ref)

    def __call__(self, data: Any) -> Any:
        """Run the step on `data` and wait for its result (the subclass's `start`)."""
        return self.start(data).wait()

    def _start(self, names: Sequence[str], data: Any) -> "Started":
        """Start the compiled step on the state groups `names` and `data`.

        The step returns its output, then new values of every group of
        `names` but the first (the trainable weights, which inference leaves
        alone); those are written at once (see `Started`).
        """
        model = self.model()
        state = _state.get(model, names)
        result = self._compiled(*state, data)
        written = names[1:]
        _state.put(model, written, result[1:])
        return Started(model, written, state[1:], result, result[0])


class Started:
    """A step started on one piece (see `backend.base.StartedPiece`).

    Args:
        model: The model whose state the step replaced.
        names: The parts of the state it wrote (see `state.put`).
        before: Their values before the step.
        result: Everything the step returns (waited for by `wait`).
        output: What `wait` returns (a part of `result`).
    """

    __slots__ = ("_model", "_names", "_before", "_result", "_output")

    def __init__(self, model: keras.Model, names: Sequence[str], before: Sequence[Any],
                 result: Any, output: Any) -> None:
        self._model = model
        self._names = names
        self._before = before
        self._result = result
        self._output = output

    def wait(self) -> Any:
        """The step's output, once computed; if it failed, the old state is back first."""
        try:
            jax.block_until_ready(self._result)
        except BaseException:
            self.undo()
            raise
        return self._output

    def undo(self) -> None:
        """Put back the state the step replaced."""
        _state.put(self._model, self._names, self._before)


class PredictStep(_Step):
    """`x -> outputs`: the model's `predict_step` (then `postprocess`), compiled."""

    def __init__(self, model: keras.Model, postprocess: Optional[Callable]) -> None:
        model_ref = weakref.ref(model)

        def predict_fn(trainable, non_trainable, x):
            outputs, non_trainable = model_ref().predict_step((trainable, non_trainable), (x,))
            if postprocess is not None:
                outputs = postprocess(outputs)
            return outputs, non_trainable

        super().__init__(model, predict_fn)

    def start(self, x: Any) -> "Started":
        """Start the step on `x` (see `Started`); `wait()` returns the outputs."""
        return self._start(PREDICT_STATE, x)

    def spec(self, x: Any) -> Any:
        """Output structure of `self(x)` by tracing only (see `output_spec`)."""
        model = self.model()
        state = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state.get(model, PREDICT_STATE)
        )
        first = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None)
        rows = int(first.shape[0])

        def at(n: int) -> Any:
            xs = keras.tree.map_structure(  # None: an optional input left out
                lambda a: None if a is None else jax.ShapeDtypeStruct(
                    (n,) + tuple(a.shape[1:]), a.dtype
                ),
                x,
            )
            return jax.eval_shape(self._fn, *state, xs)[0]

        # Two batch sizes: the dimensions that follow the batch are unknown.
        a, b = at(rows), at(rows + 1)

        def describe(left, right):
            if not hasattr(left, "shape"):
                return left
            shape = tuple(
                None if da != db else int(da) for da, db in zip(left.shape, right.shape)
            )
            return Spec(shape, np.dtype(left.dtype))

        return jax.tree_util.tree_map(describe, a, b)


class TestStep(_Step):
    """`(x, y, sample_weight) -> logs`: the model's `test_step`, compiled."""

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)

        def test_fn(trainable, non_trainable, metrics, data):
            logs, state = model_ref().test_step((trainable, non_trainable, metrics), data)
            return logs, state[1], state[2]

        super().__init__(model, test_fn)

    def start(self, data: Any) -> "Started":
        """Start the step on `data` (see `Started`); `wait()` returns the logs."""
        return self._start(TEST_STATE, data)


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Union[PredictStep, distribution.ShardedStep]:
    """A `PredictStep`; under `DataParallel` its pieces laid out over the devices."""
    step = PredictStep(model, postprocess)
    if distribution.variant() is distribution.Variant.DATA_PARALLEL:
        return distribution.ShardedStep(step, distribution.concatenate_outputs)
    return step


# Keras's JAX trainer compiles with static shapes: its per-output loss trackers
# weight each batch by its rows, so there is no batch-count rule to follow.
KERAS_COUNTS_EACH_BATCH_ONCE = False
# Keras's JAX loops call `on_*_batch_begin`, then fetch the batch.
KERAS_BEGINS_BATCH_BEFORE_FETCH = True


def make_test_step(
    model: keras.Model, exact: bool = False
) -> Union[TestStep, distribution.ShardedStep]:
    """A `TestStep` (static shapes: `exact` changes nothing); under `DataParallel`
    its pieces laid out over the devices."""
    step = TestStep(model)
    if distribution.variant() is distribution.Variant.DATA_PARALLEL:
        return distribution.ShardedStep(step, distribution.last_logs)
    return step


class VariableGuard:
    """A `Guard`: the values of some variables, taken before a step, restored if it fails.

    JAX arrays are immutable and keras_memfit's steps donate nothing, so a
    snapshot keeps references to the current values: it copies nothing.
    Inside keras_memfit's step functions (`state.threaded`), where the state
    is Keras's tuple rather than the variables, it snapshots and restores the
    whole tuple: between a snapshot and its restore only the guarded attempt
    runs, so that puts back exactly what the attempt changed.

    Example:
        >>> guard = VariableGuard(model.metrics_variables)
        >>> guard.snapshot(); ...; guard.restore()
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._saved: Optional[List[Any]] = None
        self._call: Optional[_state.Threaded] = None
        self._saved_state: Optional[Any] = None

    def snapshot(self) -> None:
        self._call = _state.active()
        if self._call is not None:
            self._saved_state = self._call.snapshot()
        else:
            self._saved = values(self._variables)

    def restore(self) -> None:
        if self._call is not None:
            self._call.restore(self._saved_state)
        elif self._saved is not None:
            assign(self._variables, self._saved)


def guard_variables(variables: Sequence[Any]) -> VariableGuard:
    return VariableGuard(variables)


def prepare_test(model: keras.Model, batch: Any) -> None:
    x, y, sample_weight = batch
    _keras_compat.symbolic_build(model, (x, y, sample_weight))
    _state.refresh(model)  # once per safe_evaluate call: the variable lists anew


def output_spec(step: Callable, x: Any) -> Any:
    """`NO_SPEC` for eager steps. JAX traces static shapes: the step is traced
    at two batch sizes, and the dimensions that differ are unknown."""
    if not isinstance(step, PredictStep):
        step = getattr(step, "__wrapped__", None)  # a functools.wraps wrapper
    if not isinstance(step, PredictStep):
        return NO_SPEC
    _state.refresh(step.model())  # once per safe_predict call: the variable lists anew
    if not step.traced:
        return NO_SPEC
    return step.spec(x)
