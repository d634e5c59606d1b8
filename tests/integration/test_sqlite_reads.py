"""On the embedded default, a read takes no write lock: a reader frozen (SIGSTOP) or
slow inside its transaction (a heartbeat's look at its leases, an operator's page)
never holds up another worker's writes. Writes still take the lock up front."""

from __future__ import annotations

import threading

import pytest

from fleet import Fleet
from fleet.store.engine import Database
from tests.harness import Backend

pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


def _write_within(db: Database, seconds: float, writers: list[threading.Thread]) -> bool:
    """Whether another thread's write transaction (kept in ``writers``) commits within
    ``seconds``."""
    done = threading.Event()

    def write() -> None:
        with db.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS probe (x INTEGER)")
            conn.exec_driver_sql("INSERT INTO probe VALUES (1)")
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writers.append(writer)
    return done.wait(seconds)


def test_a_write_goes_on_beside_a_read_held_open(backend: Backend, client: Fleet) -> None:
    db, writers = client.runtime.db, list[threading.Thread]()
    run = client.enqueue("chain", 1)
    with db.begin(read=True) as conn:  # a reader stopped inside its transaction
        conn.exec_driver_sql("SELECT count(*) FROM fleet_runs").all()
        assert _write_within(db, 5.0, writers), "a write waited for a read to end"
        assert client.runtime.queries.run(run.id) is not None  # reads beside it too
    assert _write_within(db, 5.0, writers)


def test_a_write_still_takes_the_lock_up_front(backend: Backend, client: Fleet) -> None:
    db, writers = client.runtime.db, list[threading.Thread]()
    with db.begin() as conn:  # a writer inside its transaction
        conn.exec_driver_sql("SELECT count(*) FROM fleet_runs").all()
        assert not _write_within(db, 0.5, writers), "two write transactions at once"
        # ... while a read is not held up by it (WAL: it reads its snapshot).
        assert client.runtime.queries.runs(limit=1) is not None
    writers[0].join(10)
    assert not writers[0].is_alive(), "the second write went on once the first ended"
