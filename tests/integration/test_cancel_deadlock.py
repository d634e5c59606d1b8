"""A cancel that Postgres aborts to break a deadlock is tried again, never half-applied.

Cancelling a parent locks the parent's run row, then its children's; a child ending at
that moment locks its own row, then its parent's. Postgres breaks such a cycle by
aborting one transaction (``deadlock_detected``, after ``deadlock_timeout``). Here the
child's side is a plain connection holding the child's row, with a long
``deadlock_timeout``, so the cancel is the side Postgres aborts: it must try again and
cancel both runs, not fail with "store unavailable"."""

from __future__ import annotations

import threading

import psycopg
import pytest

from fleet import Fleet
from fleet.states import RunStatus
from tests.harness import Backend, InlineBroker, poll

LOCK_WAITS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()
"""


def test_a_cancel_aborted_by_a_deadlock_with_a_finishing_child_is_tried_again(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    if backend.kind == "sqlite":
        pytest.skip("SQLite locks the whole file: no two transactions wait on each other")
    run = client.enqueue("parent", 2, key="sub")
    child = f"{run.id}/sub"
    inline.drain(until=lambda: client.runtime.queries.run(child) is not None)
    outcome: list[object] = []

    def cancel() -> None:
        try:
            outcome.append(client.cancel(run.id, "deadlock test"))
        except Exception as exc:  # the failure the test is about, reported below
            outcome.append(exc)

    libpq_url = backend.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(libpq_url) as other:
        other.execute("SET deadlock_timeout = '60s'")  # Postgres picks the cancel to abort
        other.execute("SET statement_timeout = '30s'")
        # The child's side: its own row first (as a child's finishing transaction does).
        other.execute("UPDATE fleet_runs SET wake_seq = wake_seq WHERE id = %s", (child,))
        canceller = threading.Thread(target=cancel, daemon=True)
        canceller.start()
        with psycopg.connect(libpq_url, autocommit=True) as watch:
            poll(
                lambda: watch.execute(LOCK_WAITS).fetchone()[0] >= 1,  # type: ignore[index]
                10,
                "the cancel waiting on the child's row",
            )
        # Then its parent's, which the cancel holds: a cycle, broken by aborting the cancel.
        other.execute("UPDATE fleet_runs SET wake_seq = wake_seq WHERE id = %s", (run.id,))
        other.commit()
    canceller.join(30)
    assert not canceller.is_alive(), "the cancel never returned"
    assert outcome == [True], outcome
    for run_id in (run.id, child):
        row = client.runtime.queries.run(run_id)
        assert row is not None and row.status == RunStatus.CANCELLED, (run_id, row)
