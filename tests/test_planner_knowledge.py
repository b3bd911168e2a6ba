"""BatchPlanner against a simulated device: what it keeps between calls, its events and logs."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from keras_memfit.planning.planner import (
    GROW_AFTER,
    BatchPlanner,
    forget,
    knowledge_for,
)
from planner_support import (  # noqa: F401, F811 (device and model are fixtures)
    SIG,
    Dummy,
    MiB,
    attempt,
    device,
    drive,
    model,
)

pytestmark = pytest.mark.usefixtures("probing_planner")


# --------------------------------------------------------------------------
# Memory across calls
# --------------------------------------------------------------------------
def test_second_planner_starts_at_largest_ok_and_pays_no_oom(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "evaluate", SIG, 1000), dev, 1000)
    assert dev.ooms()
    largest = knowledge_for(model, "evaluate", SIG).largest_ok
    dev.attempts.clear()
    events = []
    second = BatchPlanner(model, "evaluate", SIG, 1000, events)
    assert second.next_size() == largest
    log = drive(second, dev, 20 * GROW_AFTER * largest)
    assert dev.ooms() == []
    assert {s for s, _ in log} == {largest}  # never grows
    assert events == []


def test_second_planner_with_stats_skips_probes_after_an_oom(device, model):
    dev = device(capacity=1000 * MiB, per_sample=MiB, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 4096), dev, 2000)
    assert dev.ooms()
    largest = knowledge_for(model, "predict", SIG).largest_ok
    assert largest <= 300
    dev.attempts.clear()
    second = BatchPlanner(model, "predict", SIG, 4096)
    assert second.next_size() == largest
    drive(second, dev, 5000)
    assert dev.ooms() == []


def test_second_planner_after_a_clean_call_starts_at_the_request(device, model):
    dev = device(stats=False)
    drive(BatchPlanner(model, "predict", SIG, 100), dev, 500)
    assert BatchPlanner(model, "predict", SIG, 100).next_size() == 100


@pytest.mark.parametrize(
    "phase, sig",
    [("predict", SIG), ("evaluate", ((("5",), "float32"),)), ("evaluate", ((("4",), "int32"),))],
    ids=["other-phase", "other-shape", "other-dtype"],
)
def test_knowledge_is_per_phase_and_signature(device, model, phase, sig):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "evaluate", SIG, 1000), dev, 1000)
    assert BatchPlanner(model, "evaluate", SIG, 1000).next_size() == 250
    assert BatchPlanner(model, phase, sig, 1000).next_size() == 1000
    assert knowledge_for(model, phase, sig).smallest_failed is None


def test_knowledge_is_per_model(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 1000), dev, 1000)
    assert BatchPlanner(Dummy("other"), "predict", SIG, 1000).next_size() == 1000


def test_forget_drops_the_knowledge(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 1000), dev, 1000)
    forget(model)
    assert BatchPlanner(model, "predict", SIG, 1000).next_size() == 1000


def test_knowledge_does_not_keep_the_model_alive(device):
    dev = device(stats=False, fail_above=300)
    doomed = Dummy("doomed")
    drive(BatchPlanner(doomed, "predict", SIG, 1000), dev, 1000)
    ref = weakref.ref(doomed)
    del doomed
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------
# Events and logs
# --------------------------------------------------------------------------
def test_oom_is_a_warning_event_and_log(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(stats=False, fail_above=400)
    events = []
    planner = BatchPlanner(model, "evaluate", SIG, 1000, events)
    attempt(planner, dev, 10_000)
    assert [(e.phase, e.kind, e.old_size, e.new_size) for e in events] == [
        ("evaluate", "oom", 1000, 500)
    ]
    warnings = [r for r in caplog.records
                if r.name == "keras_memfit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "batch_size=1000" in message and "batch_size=500" in message
    assert "dummy" in message and "evaluate" in message


def test_estimate_is_an_info_event_and_log(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(capacity=1000 * MiB, per_sample=MiB)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 4096, events)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    chosen = planner.next_size()
    assert [(e.kind, e.old_size, e.new_size) for e in events] == [("estimate", 4096, chosen)]
    infos = [r for r in caplog.records if r.name == "keras_memfit" and r.levelno == logging.INFO]
    assert len(infos) == 1
    assert f"batch_size={chosen}" in infos[0].getMessage()
    assert "4096" in infos[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_grow_is_an_info_event(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(stats=False, fail_above=300)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 1000, events)
    drive(planner, dev, (GROW_AFTER + 2) * 250 + 1500)
    grows = [e for e in events if e.kind == "grow"]
    assert grows and (grows[0].old_size, grows[0].new_size) == (250, 374)
    grow_logs = [r for r in caplog.records
                 if r.levelno == logging.INFO and "batches in a row" in r.getMessage()]
    assert len(grow_logs) == len(grows)


def test_no_events_when_everything_fits(device, model, caplog):
    caplog.set_level(logging.DEBUG, logger="keras_memfit")
    dev = device(stats=False)
    events = []
    drive(BatchPlanner(model, "predict", SIG, 64, events), dev, 1000)
    assert events == []
    assert not [r for r in caplog.records if r.name == "keras_memfit"]
