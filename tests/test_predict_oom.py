"""`safe_predict`'s recovery from OOM: every row exactly once and in order, wherever the OOM
strikes; what it remembers across calls; what it logs.

The `fault_at` fixture injects OOMs by content (a poisoned row), so the rows
each successful step received can be checked against the input itself.
"""

from __future__ import annotations

import gc
import logging
import re
import weakref

import keras
import numpy as np
import pytest

from keras_memfit import safe_predict
from support import (
    assert_same_result,
    batches,
    dense_model,
    identity_model,
    oom_error,
    random_data,
    reference,
    rows_data,
    wrap_factory,
)

pytestmark = pytest.mark.usefixtures("probing_planner")


@pytest.fixture
def fault_at(monkeypatch):
    """Fault injection by content: OOM when a piece holds a poisoned row.

    `fault_at(poison, max_rows)` makes keras_memfit's predict steps raise a
    real `ResourceExhaustedError` when the piece contains a row whose first
    column equals `poison` and the piece has more than `max_rows` rows (as if
    that sample were much larger than the others). `.pieces` records the
    first-column values of every piece that ran successfully, `.failed`
    those of every piece that raised.
    """

    class Fault:
        def __init__(self):
            self.poison = self.max_rows = None
            self.pieces, self.failed = [], []

        def __call__(self, poison, max_rows):
            self.poison, self.max_rows = poison, max_rows
            return self

    fault = Fault()

    def wrap(real):
        def step(x):
            ids = np.asarray(x)[:, 0].astype(int).tolist()
            if fault.poison in ids and len(ids) > fault.max_rows:
                fault.failed.append(ids)
                raise oom_error(len(ids))
            fault.pieces.append(ids)
            return real(x)

        return step

    wrap_factory(monkeypatch, "make_predict_step", wrap)
    return fault


# ---------------------------------------------------------------------------
# Every row exactly once, in order
# ---------------------------------------------------------------------------
def test_uneven_sizes_every_row_once_in_order(inject_oom):
    model = identity_model()
    x = rows_data(1000)
    inject_oom(70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    # Outputs map back to inputs row by row: nothing lost, duplicated or moved.
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    # The successful pieces cover the 1000 rows exactly once.
    assert sum(inject_oom.ok_rows()) == 1000
    assert all(rows <= 70 for rows in inject_oom.ok_rows())
    assert inject_oom.ooms() and all(rows > 70 for rows in inject_oom.ooms())
    assert all(rows <= 300 for rows in inject_oom.rows())


def test_uneven_sizes_pieces_seen_by_model_tile_the_input(fault_at):
    # Content-level check: the rows each successful step received, in order,
    # are exactly 0..n-1, each once.
    model = identity_model()
    n = 1000
    x = rows_data(n)
    fault_at(poison=600, max_rows=70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    seen = [i for piece in fault_at.pieces for i in piece]
    assert seen == list(range(n))
    assert fault_at.failed, "the poisoned row never caused an OOM"
    np.testing.assert_array_equal(result, x)


@pytest.mark.parametrize(
    "poison", [0, 500, 1025], ids=["first piece", "middle", "last partial piece"]
)
def test_oom_on_first_middle_and_last_partial_piece(fault_at, poison):
    # 1030 rows in batches of 100: the last piece holds only 30 rows.
    model = identity_model()
    n = 1030
    x = rows_data(n)
    fault_at(poison=poison, max_rows=20)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    seen = [i for piece in fault_at.pieces for i in piece]
    assert seen == list(range(n))
    assert fault_at.failed
    assert all(poison in ids for ids in fault_at.failed)
    if poison == 1025:
        assert fault_at.failed[0] == list(range(1000, 1030))  # the partial piece
    if poison == 0:
        assert fault_at.failed[0] == list(range(100))  # the very first piece


def test_oom_on_first_piece(inject_oom):
    model = dense_model()
    x = random_data(250)
    inject_oom(45)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.calls[0] == ("predict", 100, True)


def test_oom_in_the_middle_of_a_generator(inject_oom):
    model = identity_model()
    x = rows_data(140)
    sizes = [20, 20, 80, 20]
    inject_oom(50)
    result = safe_predict(model, batches(x, sizes), verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, batches(x, sizes)))
    assert inject_oom.ooms() == [80]
    # The first 40 rows ran before the OOM, the rest after it.
    first_oom = inject_oom.calls.index(("predict", 80, True))
    assert sum(inject_oom.rows()[:first_oom]) == 40


def test_oom_raised_after_the_step_ran_discards_its_result(inject_oom):
    model = identity_model()
    x = rows_data(500)
    inject_oom(60, after=True)
    result = safe_predict(model, x, batch_size=256, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == 500


# ---------------------------------------------------------------------------
# Memory across calls, logging
# ---------------------------------------------------------------------------
def test_second_call_does_not_pay_the_oom_again(inject_oom):
    model = dense_model()
    x = random_data(1000)
    inject_oom(70)
    first = safe_predict(model, x, batch_size=300, verbose=0)
    assert inject_oom.ooms(), "the first call should have hit the injected OOM"
    inject_oom.calls.clear()
    second = safe_predict(model, x, batch_size=300, verbose=0)
    assert inject_oom.ooms() == []
    assert sum(inject_oom.rows()) == 1000
    assert_same_result(second, first)
    assert_same_result(second, reference(model, x))


def test_second_call_with_other_length_same_signature_pays_no_oom(inject_oom):
    model = dense_model()
    inject_oom(50)
    safe_predict(model, random_data(400), batch_size=200, verbose=0)
    assert inject_oom.ooms()
    inject_oom.calls.clear()
    x = random_data(333, seed=7)
    result = safe_predict(model, x, batch_size=200, verbose=0)
    assert inject_oom.ooms() == []
    assert_same_result(result, reference(model, x))


def test_warning_names_failed_and_new_batch_size(inject_oom, caplog):
    model = dense_model()
    x = random_data(300)
    inject_oom(60)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        safe_predict(model, x, batch_size=100, verbose=0)
    records = [r for r in caplog.records
               if r.name == "keras_memfit" and r.levelno == logging.WARNING]
    assert records, "no WARNING was logged for the OOM"
    message = records[0].getMessage()
    failed = inject_oom.ooms()[0]
    assert failed == 100
    # The size tried next is the one the warning announces.
    index = inject_oom.calls.index(("predict", failed, True))
    retried = inject_oom.rows()[index + 1]
    sizes = [int(s) for s in re.findall(r"batch_size=(\d+)", message)]
    assert sizes == [failed, retried], message
    assert len(records) == len(inject_oom.ooms())


def test_no_warning_without_oom(inject_oom, caplog):
    inject_oom(None)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        safe_predict(dense_model(), random_data(100), batch_size=50, verbose=0)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_cached_steps_do_not_keep_a_deleted_model_alive():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    safe_predict(model, np.zeros((8, 4), "float32"), verbose=0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_repeated_calls_reuse_the_compiled_step(monkeypatch):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    built = []
    wrap_factory(monkeypatch, "make_predict_step", lambda step: built.append(1) or step)
    first = safe_predict(model, x, batch_size=16, verbose=0)
    second = safe_predict(model, x, batch_size=16, verbose=0)
    assert len(built) == 1
    np.testing.assert_allclose(second, first)
    np.testing.assert_allclose(first, model.predict(x, batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)
