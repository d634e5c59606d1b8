"""Fan-outs scale linearly (issue 16): a branch that settles before the last of its
fan-out neither wakes nor replays the run; the last one does, exactly once, however
the branches settle (done, dead, a dead letter replayed) and however many commit at
once. Replays are counted by the workflow itself (``tests/flows.py::counted_fan``), so
here every advance replays it from the top (``FLEET_LIVE_RUNS=0``): a parked workflow
resumed is not entered again (fleet/worker/live.py), and these tests count advances."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import event, select, text

from fleet import Fleet
from fleet.store.schema import fanouts, runs
from fleet.store.snapshots import HISTORY, HISTORY_AFTER
from tests.harness import Backend, InlineBroker, client_for, executions, poll

N = 50


@pytest.fixture
def client(backend: Backend) -> Iterator[Fleet]:
    """The test workflows on ``backend``, every advance a replay from the top."""
    base = client_for(backend)
    fleet = base.with_settings(replace(base.settings, live_runs=0))
    yield fleet
    fleet.runtime.db.dispose()
    base.runtime.db.dispose()


def replays(backend: Backend, run_id: str) -> int:
    return sum(1 for e in executions(backend, run_id) if e["event"] == "replay")


def fanout_row(client: Fleet, run_id: str) -> tuple[int, int]:
    """(settled, size) of the run's one fan-out."""
    with client.runtime.db.begin() as conn:
        (row,) = conn.execute(
            select(fanouts.c.settled, fanouts.c.size).where(fanouts.c.run_id == run_id)
        ).all()
        return int(row.settled), int(row.size)


def test_a_map_replays_its_run_once_not_once_per_branch(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("counted_fan", N, [])
    inline.drain(limit=10 * N)
    assert run.wait(timeout=5) == list(range(N))
    # One replay records the branches, one (the last branch's) gathers them: not 1 + N.
    assert replays(backend, run.id) == 2
    assert fanout_row(client, run.id) == (N, N)


def test_a_branch_that_is_not_the_last_does_not_wake_the_run(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("counted_fan", 3, [])
    inline.step()  # the advance: three branches recorded
    assert [task for task, _ in inline.sent] == ["fleet.execute"] * 3

    def wake_seq() -> int:
        with client.runtime.db.begin() as conn:
            return int(conn.execute(select(runs.c.wake_seq).where(runs.c.id == run.id)).scalar())

    before = wake_seq()
    inline.step()
    inline.step()
    assert wake_seq() == before and fanout_row(client, run.id) == (2, 3)
    assert inline.sent == [("fleet.execute", [run.id, "tally#3"])], "nothing but the last branch"
    inline.step()
    assert wake_seq() == before + 1
    assert run.wait(timeout=5) == [0, 1, 2]


# What the delivery of a branch that is not the last runs, in statements. Postgres: the
# read of its run and step (two), its take, its commit counted settled in its fan-out
# (fleet/store/fused.py); 6 before issue 51's fix, one of them the history read.
BRANCH_STATEMENTS = {"postgres": 4, "sqlite": 10}


def test_a_branch_that_is_not_the_last_reads_none_of_the_run_s_history(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A branch's commit neither wakes nor replays the run unless it is the last of its
    fan-out, so it reads none of the run's history: that history holds every branch,
    and a read of it with each branch's commit made a map of N read N² rows (issue 51:
    on Postgres the history went out with the commit whether the step was a branch or
    not; a map of 2,000 took 2× the time of 2,000 one-step runs, 10,000 took 9×). The
    last branch reads it once, for the replay that gathers the results. Counted in
    statements, on both stores: each branch that is not the last runs the same number,
    however many siblings have settled before it."""
    engine = client.runtime.db.engine
    reads = {str(stmt.compile(dialect=engine.dialect)) for stmt in (HISTORY, HISTORY_AFTER)}
    seen: list[str] = []

    def statement(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        seen.append(sql)

    run = client.enqueue("counted_fan", 12, [])
    inline.step()  # the advance: twelve branches recorded and sent
    branches = list(inline.sent)
    assert len(branches) == 12
    inline.sent.clear()
    per_branch: list[tuple[int, int]] = []  # (statements, history reads) per branch
    event.listen(engine, "before_cursor_execute", statement)
    try:
        for task, args in branches:
            assert task == "fleet.execute"
            seen.clear()
            inline.sent.append((task, args))
            inline.step()
            per_branch.append((len(seen), sum(1 for sql in seen if sql in reads)))
    finally:
        event.remove(engine, "before_cursor_execute", statement)
    assert run.wait(timeout=5) == list(range(12))
    *others, last = per_branch
    assert {reads for _, reads in others} == {0}, per_branch
    assert {statements for statements, _ in others} == {BRANCH_STATEMENTS[backend.kind]}
    assert last[1] == 1, per_branch  # the replay that gathers the results


def test_dead_branches_among_the_map_lead_to_exactly_one_replay(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("counted_fan", 20, [3, 7])
    inline.drain(limit=200)
    out = run.wait(timeout=5)
    assert out[3] == "dead tally#4" and out[7] == "dead tally#8" and out[0] == 0
    assert replays(backend, run.id) == 2
    assert fanout_row(client, run.id) == (20, 20)


def test_a_replayed_dead_letter_is_uncounted_then_counted_again(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("counted_fan", 5, [2], False)
    inline.drain(limit=50)
    assert run.status() == "failed" and fanout_row(client, run.id) == (5, 5)
    assert replays(backend, run.id) == 2
    (letter,) = client.dead_letters(run.id)
    client.replay(letter.id, [[2, []]])  # good input this time
    assert fanout_row(client, run.id) == (4, 5), "the replayed branch is not settled"
    inline.drain(limit=50)
    assert run.wait(timeout=5) == [0, 1, 2, 3, 4]
    assert fanout_row(client, run.id) == (5, 5)
    assert replays(backend, run.id) == 3, "once more, by the replayed branch: the last"


@pytest.mark.parametrize("branch", [False, True], ids=["counted-after", "counted-in-commit"])
def test_the_last_two_branches_committing_at_once_replay_exactly_once(
    backend: Backend, client: Fleet, inline: InlineBroker, branch: bool
) -> None:
    """Two transactions commit the last two branches: the first holds the fan-out's row
    (and has not committed) while the second's commit waits on it; exactly one of them
    is told to replay, and it sees both branches done. Whether the branch is counted by
    a statement of its own after the commit or in the commit's (``branch``: the lease
    said it is one, ``fused.COMMIT_AND_SETTLE``)."""
    if backend.kind != "postgres":
        pytest.skip("SQLite takes its write lock up front: no two commits overlap")
    run = client.enqueue("counted_fan", 2, [])
    inline.step()
    ledger, db = client.runtime.ledger, client.runtime.db
    leases = {s: ledger.take_lease(run.id, s, "w", 30) for s in ("tally#1", "tally#2")}
    epochs: dict[str, int] = {s: lease.epoch for s, lease in leases.items()}  # type: ignore[union-attr]
    assert all(lease.branch for lease in leases.values())  # type: ignore[union-attr]
    first_holds, outcomes = threading.Event(), {}
    release = threading.Event()

    def commit(step_id: str, hold: bool) -> None:
        with db.transaction() as tx:
            done = ledger.within(tx).commit_output(
                run.id, step_id, epochs[step_id], "1", effect=False, snapshot=True, branch=branch
            )
            outcomes[step_id] = done
            if hold:
                first_holds.set()
                release.wait(30)

    first = threading.Thread(target=commit, args=("tally#1", True))
    first.start()
    assert first_holds.wait(30)
    second = threading.Thread(target=commit, args=("tally#2", False))
    second.start()

    def second_waits_on_a_lock() -> bool:
        with db.begin() as conn:
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            return int(conn.execute(text(waiting)).scalar_one()) > 0

    poll(second_waits_on_a_lock, 10, "the second commit to wait on the fan-out's row")
    release.set()
    first.join(30)
    second.join(30)
    replaying: list[Any] = [s for s, done in outcomes.items() if done.applied and done.replay]
    assert replaying == ["tally#2"]
    assert outcomes["tally#1"].snapshot is None
    snapshot = outcomes["tally#2"].snapshot
    assert snapshot is not None
    assert [row.status for row in snapshot.history] == ["done", "done"]
    assert fanout_row(client, run.id) == (2, 2)
