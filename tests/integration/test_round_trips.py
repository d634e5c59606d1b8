"""What a step costs the store: on Postgres, one transaction of four statements for a
step of a sequential run (the commit with its attempt closed and the run woken, the
history after the cached prefix, the next step recorded with the run marked advanced,
its lease taken with its attempt opened: ``fleet/store/fused.py``), each executed on
the driver's cursor (``fleet/store/driver.py``); SQLite keeps its plain path. And a
statement run on the driver's cursor fails as one run through SQLAlchemy does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.store import driver
from fleet.store.queries import RUN_ROW
from fleet.testing import InlineBroker
from fleet.worker.inline import run_steps
from tests.harness import Backend

# Per step of a sequential run, once the task is under way (steps 2..n of one task).
STATEMENTS = {"postgres": 4, "sqlite": 9}


@contextmanager
def counted(client: Fleet) -> Iterator[dict[str, int]]:
    """Statements and transactions on the client's engine while inside."""
    counts = {"statements": 0, "transactions": 0}

    def statement(*_: Any) -> None:
        counts["statements"] += 1

    def transaction(*_: Any) -> None:
        counts["transactions"] += 1

    engine = client.runtime.db.engine
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", transaction)
    try:
        yield counts
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "commit", transaction)


def _statements_per_step(client: Fleet, inline: InlineBroker, n: int) -> tuple[float, float]:
    run = client.enqueue("nops", n)
    inline.step()  # the advance: records step 1 and sends it
    (task, (run_id, step_id)) = inline.sent.pop(0)
    assert task == "fleet.execute"
    seen: list[dict[str, int]] = []
    with counted(client) as counts:

        def more(ran: int) -> bool:
            seen.append(dict(counts))  # after the ran-th body, before its commit
            return True

        ran = run_steps(client.runtime, run_id, step_id, more=more)
    assert ran == n and run.status() == "succeeded"
    # From the 2nd body to the last: n-2 whole steps (commit, replay, record, take).
    first, last = seen[1], seen[-1]
    steps = n - 2
    return (
        (last["statements"] - first["statements"]) / steps,
        (last["transactions"] - first["transactions"]) / steps,
    )


def test_a_sequential_step_is_one_transaction_of_few_statements(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    statements, transactions = _statements_per_step(client, inline, 12)
    assert transactions == 1
    assert statements == STATEMENTS[backend.kind], statements


def test_the_fused_path_agrees_with_the_plain_one_on_a_fan_out_and_a_takeover(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A branch's commit counts it settled and only the last one wakes the run; a
    lease taken over marks the earlier attempt lost and records the takeover."""
    run = client.enqueue("fan", 3)
    inline.drain()
    assert run.wait(timeout=5) == {"total": 5, "last": 25, "n": 3}
    ledger = client.runtime.ledger
    run2 = client.enqueue("chain", 1)
    inline.step()
    (_, (run_id, step_id)) = inline.sent.pop(0)
    first = ledger.take_lease(run_id, step_id, "w1", -1.0)  # expired already
    second = ledger.take_lease(run_id, step_id, "w2", 30.0)
    assert not isinstance(first, str) and not isinstance(second, str)
    assert (first.epoch, second.epoch, second.took_over) == (1, 2, True)
    assert not ledger.commit_output(run_id, step_id, 1, "{}", effect=False)  # fenced
    attempts = {a.epoch: a.outcome for a in client.runtime.queries.attempts(run_id)}
    assert attempts == {1: "fenced", 2: "running"}
    assert run2.status() == "running"


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_dropped_connection_is_store_unavailable_and_the_next_transaction_works(
    backend: Backend, client: Fleet
) -> None:
    db = client.runtime.db
    run = client.enqueue("chain", 1)
    with db.engine.connect() as killer:
        killer.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(StoreUnavailable), db.begin() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            driver.run(conn, RUN_ROW, {"b_run": run.id})
    with db.begin() as conn:  # the pool let the dead connection go
        row = driver.run(conn, RUN_ROW, {"b_run": run.id}).first()
    assert row is not None and row.id == run.id
