"""What MemFit records (issue 12, items 5 and 6): events, History, the logger.

- Epoch logs (progress bar, History, TensorBoard) get `memfit_ooms` and
  `memfit_split` only once something was adapted, and History stays one entry
  per epoch (Keras's own entries are the reference for its length).
- At the end of a call that adapted anything, one INFO summary line.
- Log messages do not repeat the logger's name (`logging.basicConfig` shows
  it already).
- Growth counts batches, not micro-batches, and happens only when it lowers
  the number of pieces a batch is run as.

OOMs come from the `inject_oom` fixture (conftest.py).
"""

from __future__ import annotations

import logging

import keras
import numpy as np

from keras_memfit import MemFit, safe_predict
from keras_memfit.planning.planner import GROW_AFTER

MEMFIT_KEYS = {"memfit_ooms", "memfit_split", "memfit_remat"}
FEATURES, CLASSES = 4, 3


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, FEATURES)).astype("float32"),
            rng.integers(0, CLASSES, size=n))


def _classifier():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class _OOMsFromEpoch(keras.callbacks.Callback):
    """Turns the injected OOMs on at the start of epoch `epoch`."""

    def __init__(self, injector, epoch, threshold):
        super().__init__()
        self.injector, self.epoch, self.threshold = injector, epoch, threshold

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.injector.threshold = self.threshold


def _keras_records(caplog):
    return [r for r in caplog.records if r.name == "keras_memfit"]


# --------------------------------------------------------------------------
# Item 5: the logs stay Keras's until something is adapted
# --------------------------------------------------------------------------
def test_memfit_entries_appear_from_the_first_adaptation_and_history_stays_aligned(
        inject_oom, caplog):
    x, y = _data(64)
    model = _classifier()
    memfit = MemFit()
    seen = []

    class Logs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(set(logs))

    inject_oom(None)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                            callbacks=[_OOMsFromEpoch(inject_oom, 1, 5), memfit, Logs()])
    assert inject_oom.ooms("train")
    assert not MEMFIT_KEYS & seen[0]  # epoch 0: nothing adapted, Keras's logs only
    assert MEMFIT_KEYS <= seen[1] and MEMFIT_KEYS <= seen[2]
    epochs = len(history.history["loss"])  # Keras's own entry: one per epoch
    assert epochs == 3
    assert history.history["memfit_ooms"][0] == 0 and history.history["memfit_ooms"][1] > 0
    assert history.history["memfit_split"][0] == 1 and history.history["memfit_split"][1] > 1
    assert all(len(values) == epochs for values in history.history.values())
    summaries = [r for r in _keras_records(caplog) if r.getMessage().startswith("MemFit: fit")]
    assert len(summaries) == 1 and summaries[0].levelno == logging.INFO
    line = summaries[0].getMessage()
    assert model.name in line and "OOM" in line and "\n" not in line
    ooms = sum(1 for e in memfit.events if e["kind"] == "oom")
    assert f"{ooms} OOM" in line


def test_every_callback_gets_the_memfit_entries_whatever_its_place(inject_oom, tmp_path):
    x, y = _data(64)
    model = _classifier()
    seen = {"before": [], "after": []}

    class Logs(keras.callbacks.Callback):
        def __init__(self, where):
            super().__init__()
            self.where = where

        def on_epoch_end(self, epoch, logs=None):
            seen[self.where].append(dict(logs))

    csv = tmp_path / "log.csv"
    inject_oom(5)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25,
              callbacks=[Logs("before"), keras.callbacks.CSVLogger(str(csv)), MemFit(),
                         Logs("after")])
    assert inject_oom.ooms("train")
    assert seen["before"] == seen["after"]
    assert all(MEMFIT_KEYS <= set(logs) for logs in seen["before"])
    assert MEMFIT_KEYS <= set(csv.read_text().splitlines()[0].split(","))


def test_no_summary_and_no_records_when_nothing_is_adapted(inject_oom, caplog):
    x, y = _data(48)
    model = _classifier()
    inject_oom(None)
    memfit = MemFit()
    with caplog.at_level(logging.DEBUG, logger="keras_memfit"):
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[memfit],
                            validation_split=0.25)
        model.evaluate(x, y, verbose=0, callbacks=[memfit])
        model.predict(x, verbose=0, callbacks=[memfit])
    assert _keras_records(caplog) == []
    assert memfit.events == []
    assert not MEMFIT_KEYS & set(history.history)


def test_evaluate_with_memfit_logs_a_summary_when_it_adapted(inject_oom, caplog):
    x, y = _data(48)
    model = _classifier()
    inject_oom(5)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[MemFit()])
    lines = [r.getMessage() for r in _keras_records(caplog)
             if r.getMessage().startswith("MemFit: evaluate")]
    assert len(lines) == 1 and "evaluate batches of 16 rows" in lines[0]


# --------------------------------------------------------------------------
# Item 6: messages without the logger's name; growth by batches and splits
# --------------------------------------------------------------------------
def test_messages_do_not_repeat_the_logger_name(inject_oom, caplog):
    # With logging.basicConfig the record shows as "LEVEL:keras_memfit:<message>":
    # the message itself must not start with the name again.
    x, y = _data(64)
    model = _classifier()
    inject_oom(5)
    with caplog.at_level(logging.DEBUG, logger="keras_memfit"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_split=0.25,
                  callbacks=[MemFit()])
        safe_predict(model, x, batch_size=64)
    records = _keras_records(caplog)
    assert records
    formatter = logging.Formatter(logging.BASIC_FORMAT)
    for record in records:
        assert not record.getMessage().lower().startswith("keras_memfit"), record.getMessage()
        assert formatter.format(record).count("keras_memfit") == 1, formatter.format(record)


def test_growth_counts_batches_and_always_changes_the_split(inject_oom, caplog):
    # Batches of 16 with pieces of at most 7 rows: 16 and 8 fail, 4 fits
    # (4 pieces). Growing by one or two samples (5) keeps 4 pieces, so the
    # first growth goes to 6 (3 pieces), after GROW_AFTER whole batches.
    x, y = _data(16 * 20)
    model = _classifier()
    memfit = MemFit()
    inject_oom(7)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[memfit])
    grows = [e for e in memfit.events if e["kind"] == "grow"]
    assert grows, memfit.events
    for event in grows:
        assert event["new_split"] < event["old_split"], event
    first_oom_step = next(e["step"] for e in memfit.events if e["kind"] == "oom")
    # GROW_AFTER whole batches fitted at 4, the one that ran out of memory
    # first (not GROW_AFTER micro-batches, which two batches of 4 pieces are).
    assert grows[0]["step"] == first_oom_step + GROW_AFTER - 1
    assert (grows[0]["old_size"], grows[0]["new_size"]) == (4, 6)
    messages = [r.getMessage() for r in _keras_records(caplog)
                if f"{GROW_AFTER} batches in a row" in r.getMessage()]
    assert len(messages) == len(grows)
    assert max(inject_oom.ok_rows("train")) <= 7
