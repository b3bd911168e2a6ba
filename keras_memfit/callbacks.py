"""`MemFit`: `model.fit(..., callbacks=[MemFit()])` survives out-of-memory mid-training.

For each step MemFit installs its own `model.<kind>_function`, which hands the batch to
`training.run.Run` (ARCHITECTURE.md, "How a call flows").
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import legacy as _legacy
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal import reductions as _reductions
from keras_memfit.planning import shape_plan as _shape_plan
from keras_memfit.training.remat import check_setting as check_remat
from keras_memfit.training.run import MODES, Run
from keras_memfit.training.summary import pad_history, summary

logger = logging.getLogger("keras_memfit")


class MemFit(keras.callbacks.Callback):
    """Keeps `fit`, `evaluate` and `predict` running when a batch does not fit (docs/training.md).

    Args:
        mode: "accumulate" (one update from summed micro-batch gradients) or "shrink".
        place: True or a dict of `keras_memfit.place` arguments: place the model as `fit` starts.
        remat: Where one sample does not fit: "auto" (recompute layers), False, or layer names.

    Attributes:
        events: One dict per adaptation during the last call (`planning.knowledge.Event`).
        plan: The `PlacementPlan` of the last `place=` placement, or None.

    Raises:
        ValueError: If `mode`, `place` or `remat` is invalid.
        TypeError: With a tf_keras (Keras 2) model.
        NotImplementedError: For an unsupported backend, distribution or mode.
        keras_memfit.OutOfMemoryError: From `fit`, where running smaller cannot help.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> memfit = MemFit()
        >>> _ = model.fit(np.ones((8, 4)), np.zeros((8, 2)), verbose=0, callbacks=[memfit])
        >>> memfit.events  # nothing ran out of memory
        []
    """

    def __init__(
        self,
        mode: str = "accumulate",
        place: Union[None, bool, Dict[str, Any]] = None,
        remat: Union[str, bool, Sequence[str]] = "auto",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f'mode must be "accumulate" or "shrink"; received mode={mode!r}')
        check_remat(remat)
        self.mode = mode
        self.remat = remat
        self.place = place
        self._place_options = _place_options(place)
        self.plan = None
        self._placed: "weakref.WeakSet[keras.Model]" = weakref.WeakSet()
        self._originals: Dict[str, Any] = {}
        self._built: Dict[str, Any] = {}  # the functions made for the current call
        self._run: Optional[Run] = None
        self._kept_events: List[Any] = []  # the last call's, across pickling
        self._in_fit = False
        self._epochs = 0  # epochs ended in the current fit

    @property
    def events(self) -> List[Dict[str, Any]]:
        """One dict per adaptation during the last call."""
        events = self._kept_events if self._run is None else self._run.events
        return [dataclasses.asdict(event) for event in events]

    # -------------------------------------------------- pickling, Keras 2
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_kept_events"] = list(self._run.events) if self._run else self._kept_events
        state.update(
            _run=None, _originals={}, _built={}, _placed=None, _in_fit=False
        )
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_built", {})  # pickled by an older keras_memfit
        self.__dict__.setdefault("remat", "auto")
        self._placed = weakref.WeakSet()

    def set_model(self, model: Any) -> None:
        _legacy.refuse(model)
        super().set_model(model)

    # Keras 2's CallbackList calls these; Keras 3 never does.
    def _implements_train_batch_hooks(self) -> bool:
        raise TypeError(_legacy.legacy_keras_error(self._model) or (
            "MemFit is a Keras 3 callback and was called by tf_keras (Keras 2), which "
            "keras_memfit does not support. Build the model with Keras 3 (`import keras`) "
            "and unset TF_USE_LEGACY_KERAS."
        ))

    _implements_test_batch_hooks = _implements_train_batch_hooks
    _implements_predict_batch_hooks = _implements_train_batch_hooks

    # ------------------------------------------------------------ lifecycle
    def _start(self, mode: Optional[str] = None, fallback: Optional[str] = None) -> None:
        """Start a new call: Keras's own functions back, nothing remembered."""
        self._uninstall_all()
        if self._run is not None:
            self._run.release()  # a fit that raised kept its accumulator
        self._built = {}
        self._kept_events = []
        self._run = Run(self.model, mode or self.mode, self._originals, fallback,
                        self.remat if self._in_fit else False)

    # Keras looks the step functions up right after `on_*_batch_begin`: MemFit's are
    # installed there and remove themselves when they return or raise.
    def on_train_begin(self, logs=None):
        mode, fallback = self._check_supported()
        self._go_first()
        self._place_model()
        model = self.model
        if _backend.get().compiles_per_shape(model) and not _model_state.stateful_layers(model):
            _shape_plan.prepare(model)  # while the variables are readable (traces the model)
        self._in_fit = True
        self._start(mode, fallback)
        self._epochs = 0

    def _go_first(self) -> None:
        """Be first of `fit`'s callbacks, so that the others see MemFit's epoch logs."""
        callbacks = _keras_compat.calling_callback_list(self)
        if callbacks is not None:  # a new list: Keras's loop over the old one goes on
            callbacks.callbacks = [self] + [c for c in callbacks.callbacks if c is not self]

    def on_train_end(self, logs=None):
        self._run.release()
        self._uninstall_all()
        self._in_fit = False
        self._summarize("fit")

    def on_epoch_begin(self, epoch, logs=None):
        self._run.start_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._epochs += 1
        if logs is None or not self._run.adapted:
            return  # nothing adapted yet: Keras's logs as they are
        if self._epochs > 1:  # History of this fit is model.history by now
            pad_history(getattr(self.model, "history", None))
        logs["memfit_ooms"] = self._run.epoch_ooms
        logs["memfit_split"] = self._run.epoch_split
        logs["memfit_remat"] = self._run.epoch_remat

    def on_train_batch_begin(self, batch, logs=None):
        self._run.step = batch
        self._install("train", self._run.train)

    def on_test_begin(self, logs=None):
        if not self._in_fit:
            _backend.get()  # raises NotImplementedError for unsupported backends
            self._start()

    on_predict_begin = on_test_begin

    def on_test_batch_begin(self, batch, logs=None):
        self._install("test", self._run.test)

    def on_test_end(self, logs=None):
        self._end("test", "evaluate")

    def on_predict_batch_begin(self, batch, logs=None):
        self._install("predict", self._run.predict)

    def on_predict_end(self, logs=None):
        self._end("predict", "predict")

    def _end(self, kind: str, call: str) -> None:
        """Put Keras's `<kind>_function` back; outside `fit`, log the call's summary."""
        self._uninstall(f"{kind}_function")
        if not self._in_fit:
            self._summarize(call)

    def _summarize(self, call: str) -> None:
        if self._run is not None and self._run.adapted:
            logger.info(
                "%s", summary(call, self.model.name, self.events, self._run.most_pieces)
            )

    def _check_supported(self) -> Tuple[str, Optional[str]]:
        """The mode to train in, and why it is not the one asked for (or None)."""
        backend = _backend.get()
        model = self.model
        _keras_compat.warn_if_untested_keras()
        backend.training_layout(model)  # raises for a distribution MemFit refuses
        backend.check_training_mode(model, self.mode)  # raises for a mode it refuses there
        if self.mode != "accumulate":
            return self.mode, None
        if not _model_state.has_default_train_step(model):
            why = (f"cannot split the custom train_step of {type(model).__name__} into "
                   "accumulated micro-batches, so")
        else:
            how, reason = _reductions.weighting(model)
            if how is not None:
                return self.mode, None
            why = f"cannot weight the micro-batches exactly: {reason}. So"
        return "shrink", (
            f"MemFit(mode='accumulate') {why} it trains as MemFit(mode='shrink'): a batch that "
            "does not fit runs as smaller batches, one optimizer step each. Pass "
            "MemFit(mode='shrink') to say so."
        )

    def _place_model(self) -> None:
        model = self.model
        if self._place_options is None or model in self._placed:
            return
        from keras_memfit.placement import place

        self.plan = place(model, **self._place_options)
        self._placed.add(model)
        logger.info("MemFit(place=...): %s", self.plan.reason)
        # place() dropped the train function Keras made before on_train_begin.
        if getattr(model, "train_function", None) is None:
            model.make_train_function()

    # ------------------------------------------------- installing functions
    def _install(self, kind: str, run_batches: Callable[[Iterable[Any]], Any]) -> None:
        """Install MemFit's `model.<kind>_function`, which uninstalls itself when it ends."""
        name = f"{kind}_function"
        if name in self._originals:
            return
        # Not `self.model`: on JAX it syncs Keras's state into the variables at each step.
        model = self._model
        if name not in self._built:  # once per call and kind: Keras looks it up at every step
            self._built[name] = self._build(model, name, kind, run_batches)
        self._originals[name] = getattr(model, name, None)
        _keras_compat.set_function(model, name, self._built[name])

    def _build(
        self, model: Any, name: str, kind: str, run_batches: Callable[[Iterable[Any]], Any]
    ) -> Callable[..., Any]:
        """MemFit's `model.<kind>_function`, which uninstalls itself when it returns or raises."""
        backend = _backend.get()
        model_ref = weakref.ref(model)  # the model holds the function

        def installed(*args):
            try:
                with backend.keras_call(model_ref(), kind, *args) as call:
                    result = run_batches(call.batches)
                return call.returned(result)
            except BaseException as exc:
                if not backend.is_end_of_data(exc):  # the end of an epoch is no error
                    self._in_fit = False
                raise
            finally:
                self._uninstall(name)

        return installed

    def _uninstall(self, name: str) -> None:
        if name not in self._originals:
            return
        original = self._originals.pop(name)
        model = self._model  # not self.model: see _install
        if getattr(model, name, None) is self._built.get(name):
            _keras_compat.set_function(model, name, original)

    def _uninstall_all(self) -> None:
        for name in list(self._originals):
            self._uninstall(name)


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
