"""What a step costs the store: on Postgres, one transaction of four statements for a
step of a sequential run (the commit with its attempt closed and the run woken, the
history after the cached prefix, the next step recorded with the run marked advanced,
its lease taken with its attempt opened: ``fleet/store/fused.py``), each executed on
the driver's cursor (``fleet/store/driver.py``); SQLite keeps its plain path. And a
statement run on the driver's cursor fails as one run through SQLAlchemy does."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, func, select, text

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.states import Incident
from fleet.store import driver
from fleet.store.schema import incidents
from fleet.store.snapshots import RUN_ROW, HistoryRead, read_snapshot
from fleet.testing import InlineBroker
from fleet.worker.attempt import execute
from fleet.worker.inline import advance_steps, run_steps
from tests.harness import Backend, Wire

# Per step of a sequential run, once the task is under way (steps 2..n of one task).
STATEMENTS = {"postgres": 4, "sqlite": 9}
# Postgres: BEGIN with the commit and the history after it; the next step recorded and
# its lease taken with the COMMIT (fleet/store/driver.py).
ROUND_TRIPS = 2


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


# A one-step run from its advance to its end, in transactions. Postgres: the advance's
# one (the snapshot, queued → running, the step recorded with the run marked advanced,
# the lease) and the commit that ends the run; five before. SQLite takes its write lock
# at BEGIN, so there the advance stays four (the snapshot, the start, the record, the
# lease), none held while the workflow runs.
ADVANCE_TO_END = {"postgres": 2, "sqlite": 5}


def test_a_new_run_s_advance_is_one_transaction_with_its_first_lease(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """The advance that starts a run replays it and takes its first step's lease in one
    transaction (``inline._replay_keeping_first``), then runs that step itself."""
    run = client.enqueue("nops", 1)
    with counted(client) as counts:
        ran = advance_steps(client.runtime, run.id)
    assert ran == 1 and run.status() == "succeeded"
    assert counts["transactions"] == ADVANCE_TO_END[backend.kind], counts


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_sequential_step_costs_two_round_trips(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """Each step of a task's sequential run is one transaction on one checkout, and
    most cost ``ROUND_TRIPS``: the BEGIN, the commit and the history read after it go
    to the server together (``driver.pipelined``), and the next step's record and
    lease with the COMMIT (``driver.send``, ``driver.finish``). A few cost more:
    psycopg prepares a statement on a connection at its fifth execution there."""
    client.enqueue("nops", 42)
    inline.step()  # the advance: records step 1 and sends it
    (_, (run_id, step_id)) = inline.sent.pop(0)
    wire = Wire()
    wire.start()
    try:
        ran = run_steps(client.runtime, run_id, step_id, more=lambda _ran: True)
    finally:
        wire.stop()
    assert ran == 42
    steps = wire.per_checkout[2:-1]  # the first two take their lease first; the last ends
    assert statistics.mode(steps) == ROUND_TRIPS, wire.per_checkout
    assert sum(1 for t in steps if t == ROUND_TRIPS) >= 0.8 * len(steps), wire.per_checkout


# Postgres, a one-step run from its advance to its end: the advance's one transaction
# (its BEGIN with the snapshot's reads; queued → running sent with the step recorded and
# the run marked advanced; the lease taken with the COMMIT), and the commit that ends
# it (with the history read; the run's end, which names its family; the COMMIT with the
# leases revoked and the run marked advanced).
ONE_STEP_RUN = [3, 3]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_one_step_run_costs_six_round_trips(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """What a run costs beyond its steps: its advance is one transaction whose start of
    the run waits for no answer of its own, and its end is one statement for a run with
    no parent and no child (20 round trips before 2026-12-04, 7 before the advance was
    one transaction)."""
    ids = [client.enqueue("nops", 1).id for _ in range(12)]
    for run_id in ids[:6]:  # psycopg prepares a statement at its fifth execution
        advance_steps(client.runtime, run_id)
    traced = []
    for run_id in ids[6:]:
        wire = Wire()
        wire.start()
        try:
            assert advance_steps(client.runtime, run_id) == 1
        finally:
            wire.stop()
        traced.append(wire.per_checkout)
    assert statistics.mode(map(tuple, traced)) == tuple(ONE_STEP_RUN), traced
    assert all(client.run(i).status() == "succeeded" for i in ids)


# Postgres, the delivery of a branch of a fan-out that is not the last to settle: the
# read of its run and step (one round trip with its BEGIN and COMMIT), its take (one),
# its commit counted settled in its fan-out (sent with the BEGIN) and the COMMIT. Seven
# before issue 51's fix, one of them carrying a read of the run's whole history.
BRANCH = [1, 1, 2]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_branch_that_is_not_the_last_costs_four_round_trips(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("fan", 12)
    inline.step()  # the advance: twelve branches recorded and sent
    branches = list(inline.sent)
    inline.sent.clear()
    traced = []
    for _, (run_id, step_id) in branches[:-1]:
        wire = Wire()
        wire.start()
        try:
            execute(client.runtime, run_id, step_id)
        finally:
            wire.stop()
        traced.append(tuple(wire.per_checkout))
    assert inline.sent == [], "a branch that is not the last sends nothing"
    assert statistics.mode(traced) == tuple(BRANCH), traced


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_an_enqueue_is_one_round_trip_to_the_store(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A run's insert goes out with its transaction's BEGIN and COMMIT and is read after
    them (two round trips before 2026-12-06), and an id enqueued again is still told
    apart from a new one."""
    client.enqueue("nops", 1, run_id="warm")
    wire = Wire()
    wire.start()
    try:
        client.enqueue("nops", 1, run_id="once")
    finally:
        wire.stop()
    assert wire.per_checkout == [1], wire.per_checkout
    inline.sent.clear()
    client.enqueue("nops", 1, run_id="once")
    assert inline.sent == [], "an id enqueued again sends nothing"


def test_a_snapshot_made_for_another_run_of_that_id_is_read_again(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """``Queries.snapshot`` sends the history read before the run's row says when the
    run was created, made for the run of that id the history cache knows: kept under
    another creation time (a pruned run's id used again), it is read again, whole."""
    run = client.enqueue("chain", 3)
    inline.step()
    inline.step()  # work#1 ran; work#2 is recorded
    db = client.runtime.db
    real = client.runtime.queries.snapshot(run.id)
    assert real is not None and [s.step_id for s in real.history] == ["work#1", "work#2"]
    stale = (dataclasses.replace(real.history[0], output='"another run\'s"'),)
    db.history.clear()
    db.history.extend(f"{run.id}\x00{real.run.created_at - 1.0!r}", (), stale)
    again = client.runtime.queries.snapshot(run.id)
    assert again is not None and list(again.history) == list(real.history)
    assert db.history.key_of(run.id) == f"{run.id}\x00{real.run.created_at!r}"


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
@pytest.mark.parametrize("told", ["right", "wrong", "none"])
def test_a_commit_reads_the_same_history_whatever_creation_time_it_is_told(
    backend: Backend, client: Fleet, inline: InlineBroker, told: str
) -> None:
    """The history read with the commit is the one read after it; told the wrong
    creation time (another run of that id), the commit reads it again, and a cache
    entry is never filed under a creation time that is not the run's."""
    run = client.enqueue("chain", 3)
    inline.step()
    inline.step()  # step 1 runs; step 2 is recorded and sent
    (_, (run_id, step_id)) = inline.sent.pop(0)
    rt = client.runtime
    lease = rt.ledger.take_lease(run_id, step_id, "w1", 30.0)
    assert not isinstance(lease, str)
    created = rt.queries.run(run_id).created_at
    hint = {"right": created, "wrong": created - 1.0, "none": None}[told]
    done = rt.ledger.commit_output(
        run_id, step_id, lease.epoch, '"out"', effect=False, snapshot=True, created_at=hint
    )
    assert done.applied and done.snapshot is not None
    with rt.db.begin() as conn:
        fresh = read_snapshot(conn, run_id, type(rt.db.history)())
    assert fresh is not None
    assert done.snapshot.run == fresh.run
    assert done.snapshot.history == fresh.history
    assert done.snapshot.history[-1].step_id == step_id
    wrong = HistoryRead.of(run_id, created - 1.0, rt.db.history)
    assert wrong.prefix == ()  # nothing was kept under the wrong creation time
    assert run.status() == "running"


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


def _takeovers(client: Fleet, step_id: str) -> int:
    query = (
        select(func.count())
        .select_from(incidents)
        .where(incidents.c.kind == Incident.TAKEOVER, incidents.c.step_id == step_id)
    )
    with client.runtime.db.begin() as conn:
        return int(conn.execute(query).scalar_one())


def test_a_lease_taken_at_the_commit_notes_its_takeover_with_it(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A takeover's incident is written in the transaction that took the lease, also
    when the take goes out with the COMMIT (``fused.TAKE_OPEN_AND_NOTE``): none if that
    transaction rolls back, one if it commits."""
    ledger, db = client.runtime.ledger, client.runtime.db
    client.enqueue("chain", 1)
    inline.step()
    (_, (run_id, step_id)) = inline.sent.pop(0)
    first = ledger.take_lease(run_id, step_id, "w1", -1.0)  # expired already
    assert not isinstance(first, str) and first.epoch == 1
    with pytest.raises(RuntimeError), db.transaction() as tx:
        ledger.within(tx).take_lease_at_commit(run_id, step_id, "w2", 30.0)
        raise RuntimeError("the commit's transaction failed")
    assert _takeovers(client, step_id) == 0
    with db.transaction() as tx:
        answer = ledger.within(tx).take_lease_at_commit(run_id, step_id, "w2", 30.0)
    assert _takeovers(client, step_id) == 1  # committed with the take, before any answer
    lease = answer()
    assert not isinstance(lease, str)
    assert (lease.epoch, lease.took_over) == (2, True)
    assert _takeovers(client, step_id) == 1
    attempts = {a.epoch: a.outcome for a in client.runtime.queries.attempts(run_id)}
    assert attempts == {1: "lost", 2: "running"}


def _one_by_one(conn: Any, run_id: str) -> list[str]:
    return [driver.run(conn, RUN_ROW, {"b_run": run_id}).first().id]


def _pipelined(conn: Any, run_id: str) -> list[str]:
    calls = [(RUN_ROW, {"b_run": run_id})] * 2
    return [rows.first().id for rows in driver.pipelined(conn, calls)]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
@pytest.mark.parametrize("read", [_one_by_one, _pipelined], ids=["run", "pipelined"])
def test_a_dropped_connection_is_store_unavailable_and_the_next_transaction_works(
    backend: Backend, client: Fleet, read: Any
) -> None:
    db = client.runtime.db
    run = client.enqueue("chain", 1)
    with db.engine.connect() as killer:
        killer.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(StoreUnavailable), db.begin() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            read(conn, run.id)
    with db.begin() as conn:  # the pool let the dead connection go
        assert set(read(conn, run.id)) == {run.id}
