"""The Digit Recognizer demo: plain Keras dies of OOM where keras_memfit does not (docs/cli.md).

The limit must be set before TensorFlow is imported, so the work runs in a `worker` child.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from typing import Any, Dict, List, Optional, Tuple

import keras_memfit
from keras_memfit.app import records, worker
from keras_memfit.app.env import gpu_visible
from keras_memfit.app.errors import WorkerError
from keras_memfit.app.worker import Reporter

# Too small for the plain calls; on the CPU large enough for the test set plain `predict`
# converts to one tensor: below the minimum, TensorFlow crashes (SIGSEGV) instead of raising.
DEFAULT_CPU_MEMORY_LIMIT_MB = 400
MIN_CPU_MEMORY_LIMIT_MB = 300
DEFAULT_GPU_MEMORY_LIMIT_MB = 256
DEFAULT_TRAIN_SAMPLES = 6000
DEFAULT_EPOCHS = 1
FIT_BATCH_SIZE = 768
TEST_SAMPLES = 28000  # rows of Kaggle's test.csv
_DEVICES = ("auto", "cpu", "gpu")


class DemoError(WorkerError):
    """The demo could not run (bad argument, unwritable output, worker failure)."""


@dataclasses.dataclass
class DemoResult:
    """What the demo did, as its worker reported it (times in seconds).

    Attributes:
        plain_fit_error: Plain `model.fit`'s OOM in one line, or None if it fitted.
        weight_difference: Largest absolute difference from plain `fit` without the limit.
        relative_difference: That difference's norm over that of the change plain `fit` made.
        plain_error: Plain `model.predict`'s OOM in one line, or None if it fitted.
        cleanup_seconds: What `gc.collect()` took to free the failed predict's memory.
    """

    output: str
    device: str
    memory_limit_mb: int
    train_samples: int
    epochs: int
    plain_fit_error: Optional[str]
    fit_seconds: float
    fit_ooms: int
    fit_events: List[Dict[str, Any]]
    optimizer_steps: int
    train_accuracy: float
    weight_difference: float
    relative_difference: float
    plain_error: Optional[str]
    plain_seconds: float
    cleanup_seconds: float
    safe_seconds: float
    batch_sizes: List[int]
    ooms_paid: int
    adaptations: List[str]
    accuracy: float
    rows: int
    total_seconds: float


# --------------------------------------------------------------------------
# Parent side: choose the device, start the worker, relay its report
# --------------------------------------------------------------------------
def run_demo(
    output: "str | os.PathLike[str]" = "submission.csv",
    memory_limit_mb: Optional[int] = None,
    train_samples: int = DEFAULT_TRAIN_SAMPLES,
    epochs: int = DEFAULT_EPOCHS,
    verbose: bool = True,
    *,
    device: str = "auto",
    seed: int = 0,
    report: Optional[Reporter] = None,
) -> DemoResult:
    """Run the Digit Recognizer OOM demo in a memory-limited child process.

    Args:
        output: Where to write the Kaggle submission.
        memory_limit_mb: MiB for the worker's device; default `DEFAULT_CPU_MEMORY_LIMIT_MB`
            or `DEFAULT_GPU_MEMORY_LIMIT_MB`.
        device: "auto" (a GPU if TensorFlow sees one), "cpu" or "gpu".
        report: Called with each line of the worker's report; default: stdout.

    Raises:
        ValueError: If an argument is out of range (on the CPU, below `MIN_CPU_MEMORY_LIMIT_MB`).
        DemoError: If the output cannot be written or the worker fails.
    """
    for name, value, low in (("train_samples", train_samples, 100), ("epochs", epochs, 1)):
        _check_int(name, value, low)
    if memory_limit_mb is not None:
        _check_int("memory_limit_mb", memory_limit_mb, 1)
    _check_int("seed", seed, 0)
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {list(_DEVICES)}; received device={device!r}")
    output = os.path.abspath(os.fspath(output))
    worker.check_writable(output, DemoError)

    if device == "auto":
        device = "gpu" if gpu_visible() else "cpu"
    if memory_limit_mb is None:
        memory_limit_mb = (
            DEFAULT_GPU_MEMORY_LIMIT_MB if device == "gpu" else DEFAULT_CPU_MEMORY_LIMIT_MB
        )
    elif device == "cpu" and memory_limit_mb < MIN_CPU_MEMORY_LIMIT_MB:
        raise ValueError(
            f"memory_limit_mb must be at least {MIN_CPU_MEMORY_LIMIT_MB} on the CPU, where "
            "TensorFlow crashes instead of raising when the capped allocator cannot hold "
            f"the 88 MiB test set; received memory_limit_mb={memory_limit_mb}"
        )
    config = dict(
        output=output, device=device, memory_limit_mb=memory_limit_mb,
        train_samples=train_samples, epochs=epochs, verbose=bool(verbose), seed=seed,
    )
    segv_hint = (
        "TensorFlow crashes instead of raising when the capped CPU allocator "
        f"cannot hold the 88 MiB test set: try a --memory-limit above {memory_limit_mb}"
        if device == "cpu" else None
    )
    try:
        result = worker.run_worker(
            "keras_memfit.app.demo:_work", config, report=report,
            what="the demo's worker process", segv_hint=segv_hint,
        )
    except WorkerError as err:
        raise DemoError(str(err)) from err
    return DemoResult(**result)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; received {name}={value!r}")


# --------------------------------------------------------------------------
# Worker side: runs in the memory-limited child process
# --------------------------------------------------------------------------
_OOM_LINE = re.compile(r"OOM when allocating tensor with shape\[[^\]]*\][^\n\[]*")


def build_cnn() -> Any:
    """The Kaggle Digit Recognizer notebooks' CNN, compiled (also the benchmarks' model)."""
    import keras

    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_cnn",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def _work(config: Dict[str, Any], say: Reporter) -> Dict[str, Any]:
    """The demo itself; returns the fields of `DemoResult`."""
    start = time.perf_counter()
    device, limit = config["device"], config["memory_limit_mb"]
    step = say if config["verbose"] else (lambda line: None)
    # On GPU, the child's entry (`worker.worker_main`) has set the limit already.

    import numpy as np

    from keras_memfit.app import digits

    where = "GPU:0" if device == "gpu" else "CPU"
    step(
        f"keras_memfit demo: Kaggle Digit Recognizer, {TEST_SAMPLES} test images, "
        f"{where} memory limited to {limit} MiB"
    )
    t = time.perf_counter()
    x_train, y_train, x_test, y_test = digits.load_digits(
        config["train_samples"], TEST_SAMPLES, config["seed"], return_test_labels=True
    )
    x_train = (x_train[..., None] / 255.0).astype("float32")
    x_test = (x_test[..., None] / 255.0).astype("float32")
    step(
        f"[1/5] Generated {len(x_train)} training and {len(x_test)} test digits "
        f"in {time.perf_counter() - t:.1f} s (no download)"
    )
    model, fitted = _fit(config, x_train, y_train, step)
    del x_train, y_train
    gc.collect()
    predicted = _predict(model, x_test, step)
    digits.write_submission(config["output"], predicted["labels"])
    accuracy = float(np.mean(np.asarray(predicted.pop("labels")) == y_test))
    result = dict(
        output=config["output"], device=device, memory_limit_mb=limit,
        train_samples=config["train_samples"], epochs=config["epochs"],
        accuracy=accuracy, rows=TEST_SAMPLES,
        total_seconds=time.perf_counter() - start, **fitted, **predicted,
    )
    step("")
    for line in _summary(result, where):
        say(line)
    return result


def _plain(call: Any) -> Tuple[Optional[str], float]:
    """Run a plain Keras call; its OOM as one line (None if it fitted) and its seconds."""
    t = time.perf_counter()
    try:
        call()
    except Exception as exc:
        if not keras_memfit.is_oom_error(exc):
            raise
        # One line: its type and TensorFlow's "OOM when..." line.
        message = getattr(exc, "message", None) or str(exc)
        match = _OOM_LINE.search(message)
        text = match.group(0).strip() if match else message.strip().splitlines()[0]
        return f"{type(exc).__name__}: {text}", time.perf_counter() - t
    return None, time.perf_counter() - t


def _failed(error: Optional[str], seconds: float, limit_hint: str) -> str:
    if error is not None:
        return f"      FAILED after {seconds:.1f} s: {error}"
    return f"      did not run out of memory ({seconds:.1f} s): {limit_hint}"


def _fit(
    config: Dict[str, Any], x_train: Any, y_train: Any, step: Reporter
) -> Tuple[Any, Dict[str, Any]]:
    """Plain `fit` at a batch that does not fit, then MemFit's, against the unlimited fit."""
    import keras

    from keras_memfit.app import reference

    seed, epochs, batch = config["seed"], config["epochs"], FIT_BATCH_SIZE

    def fresh_model() -> Any:  # the same initial weights every time
        keras.utils.set_random_seed(seed)
        return build_cnn()

    model = fresh_model()
    initial = model.get_weights()
    unlimited = reference.start_fit(
        model, x_train, y_train, seed=seed, batch_size=batch, epochs=epochs
    )
    step(
        f"[2/5] model.fit(x_train, y_train, batch_size={batch}) ... "
        "(an OOM takes ~10 s to surface)"
    )
    keras.utils.set_random_seed(seed)
    error, seconds = _plain(lambda: model.fit(
        x_train, y_train, batch_size=batch, epochs=epochs, verbose=0))
    step(_failed(error, seconds, "use a smaller --memory-limit to see the OOM"))

    step(f"[3/5] model.fit(x_train, y_train, batch_size={batch}, callbacks=[MemFit()]) ...")
    model = fresh_model()
    memfit = keras_memfit.MemFit()
    logged = records.LogRecords(step)
    t = time.perf_counter()
    keras.utils.set_random_seed(seed)
    with logged.capture():
        history = model.fit(
            x_train, y_train, batch_size=batch, epochs=epochs, verbose=0, callbacks=[memfit]
        )
    fit_seconds = time.perf_counter() - t
    steps = int(model.optimizer.iterations.numpy())
    accuracy = float(history.history["accuracy"][-1])
    step(f"      OK in {fit_seconds:.1f} s: {steps} optimizer steps of {batch} rows")
    for event in memfit.events:
        step(
            f"      event: epoch {event['epoch']} step {event['step']} {event['phase']} "
            f"{event['kind']}: split {event['old_split']} -> {event['new_split']} "
            f"({event['reason']})"
        )
    expected = unlimited.result()
    weights = model.get_weights()
    difference = reference.max_difference(weights, expected)
    relative = reference.relative_difference(weights, expected, initial)
    step(f"      weights: {_weights_line(difference, relative)}")
    return model, dict(
        plain_fit_error=error, fit_seconds=fit_seconds, fit_ooms=logged.warnings,
        fit_events=memfit.events, optimizer_steps=steps, train_accuracy=accuracy,
        weight_difference=difference, relative_difference=relative,
    )


def _weights_line(difference: float, relative: float) -> str:
    return (
        f"max difference {difference:.1e} from plain fit's without the memory limit "
        f"(run beside it, in a process of its own): {relative * 100:.2g}% of the change "
        "training made"
    )


def _predict(model: Any, x_test: Any, step: Reporter) -> Dict[str, Any]:
    """Plain `predict` of the whole test set, then `safe_predict`'s."""
    import keras

    n = len(x_test)
    step(f"[4/5] model.predict(x_test, batch_size={n}) ... (an OOM takes ~10 s to surface)")
    error, seconds = _plain(lambda: model.predict(x_test, batch_size=n, verbose=0))
    # Free what the failed call held first; slow at times: its tf.data iterator waits for a
    # prefetch thread stuck in the capped allocator.
    t = time.perf_counter()
    gc.collect()
    cleanup_seconds = time.perf_counter() - t
    step(_failed(error, seconds, "use a smaller --memory-limit to see the OOM"))
    if cleanup_seconds >= 1.0:
        step(
            f"      (TensorFlow took another {cleanup_seconds:.1f} s to release the failed "
            "call's memory)"
        )

    step(
        f"[5/5] keras_memfit.safe_predict(model, x_test, batch_size={n}, "
        "postprocess=argmax) ..."
    )
    logged = records.LogRecords(step)
    sizes: List[int] = []
    t = time.perf_counter()
    with logged.capture():
        labels = keras_memfit.safe_predict(
            model, x_test, batch_size=n,
            postprocess=lambda y: keras.ops.argmax(y, axis=-1),
            verbose=0, callbacks=[records.batch_sizes(sizes)],
        )
    safe_seconds = time.perf_counter() - t
    step(f"      OK in {safe_seconds:.1f} s: {len(labels)} labels")
    return dict(
        labels=labels, plain_error=error, plain_seconds=seconds,
        cleanup_seconds=cleanup_seconds, safe_seconds=safe_seconds, batch_sizes=sizes,
        ooms_paid=logged.warnings, adaptations=logged.messages,
    )


def _summary(result: Dict[str, Any], where: str) -> List[str]:
    batch, n = FIT_BATCH_SIZE, TEST_SAMPLES
    fit_error, predict_error = result["plain_fit_error"], result["plain_error"]
    lines = [
        "Summary",
        f"  plain model.fit(batch_size={batch}):  "
        + (f"FAILED with {fit_error}" if fit_error else "did not run out of memory"),
        f"  model.fit(batch_size={batch}, callbacks=[MemFit()]):  OK, "
        f"{result['optimizer_steps']} optimizer steps in {result['fit_seconds']:.1f} s, "
        f"{result['fit_ooms']} OOM(s) caught",
        f"    weights: {_weights_line(result['weight_difference'], result['relative_difference'])}",
        f"  plain model.predict(batch_size={n}):  "
        + (f"FAILED in {result['plain_seconds']:.1f} s with {predict_error}" if predict_error
           else f"did not run out of memory ({result['plain_seconds']:.1f} s)"),
        f"  keras_memfit.safe_predict(batch_size={n}):  OK, {result['rows']} labels in "
        f"{result['safe_seconds']:.1f} s, {result['ooms_paid']} OOM(s) paid",
        # The size most batches ran at (the probes and the last, clipped batch are smaller).
        f"    batch size used: {records.usual_size(result['batch_sizes'])} "
        f"(batches run: {records.describe_sizes(result['batch_sizes'])})",
    ]
    lines += [f"    adapted: {message}" for message in result["adaptations"]]
    if not result["adaptations"]:
        lines.append("    adapted: nothing (the whole batch fitted)")
    lines += [
        f"  accuracy against the generated test labels: {result['accuracy']:.4f}",
        f"  wrote {result['output']} (ImageId,Label; {result['rows']} rows)",
        f"  demo time: {result['total_seconds']:.1f} s ({where}, "
        f"{result['memory_limit_mb']} MiB)",
    ]
    return lines
