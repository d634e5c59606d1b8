"""Statements sent together on Postgres (``fleet/store/driver.py``): in a
``Database.transaction`` fleet sends the BEGIN with the first statements and the
COMMIT with those ``send`` left pending. What must hold whatever the wire does: order
(a statement sees the writes sent before it), atomicity (a statement that fails at the
COMMIT's sync leaves nothing applied and is not an unknown commit), a lost connection
at the COMMIT is ``CommitUnknown``, and every connection goes back to the pool with
psycopg's own transactions (a later plain transaction still rolls back whole)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.store import driver
from fleet.store.engine import CommitUnknown
from tests.harness import Backend

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)

# Module constants: the driver compiles each statement once, by identity.
_BUMP = text("UPDATE fleet_runs SET wake_seq = wake_seq + 1 WHERE id = :b_run")
_SEQ = text("SELECT wake_seq FROM fleet_runs WHERE id = :b_run")
_FAIL = text("UPDATE fleet_runs SET wake_seq = wake_seq / 0 WHERE id = :b_run")
# What a deadlock or a serialization failure says (SQLSTATE 40001), on demand.
_ROLLED_BACK = text(
    "DO $$ BEGIN RAISE EXCEPTION 'as a deadlock would' USING ERRCODE = 'serialization_failure';"
    " END $$"
)


def _seq(client: Fleet, run_id: str) -> int:
    with client.runtime.db.begin() as conn:
        return int(conn.execute(_SEQ, {"b_run": run_id}).scalar_one())


def _autocommit_of_pool(client: Fleet) -> list[Any]:
    """What each connection the pool would hand out says of autocommit."""
    with client.runtime.db.engine.connect() as conn:
        dbapi: Any = conn.connection.dbapi_connection
        return [dbapi.autocommit]


def test_sent_writes_are_seen_by_later_statements_and_commit_together(
    backend: Backend, client: Fleet
) -> None:
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    with db.transaction() as tx:
        pending = driver.send(tx.conn, _BUMP, {"b_run": run_id})
        driver.send(tx.conn, _BUMP, {"b_run": run_id})
        assert pending.result is None  # not sent yet: it waits for the next sync
        # A statement through SQLAlchemy syncs them first, and sees both.
        seen = tx.conn.execute(_SEQ, {"b_run": run_id}).scalar_one()
        assert seen == before + 2
        assert pending.rows().rowcount == 1
        last = driver.send(tx.conn, _BUMP, {"b_run": run_id})
    assert last.rows().rowcount == 1  # read at the COMMIT's sync
    assert _seq(client, run_id) == before + 3
    assert _autocommit_of_pool(client) == [False]


@pytest.mark.parametrize(
    ("failing", "says", "raised_as"),
    [
        (_FAIL, "division by zero", Exception),
        # An operational error the server answers with a rollback (SQLSTATE class 40)
        # is a refusal too, not an unknown commit: the caller may commit again at once.
        (_ROLLED_BACK, "as a deadlock would", StoreUnavailable),
    ],
    ids=["data-error", "serialization-failure"],
)
def test_a_sent_statement_that_fails_at_the_commit_leaves_nothing_applied(
    backend: Backend, client: Fleet, failing: Any, says: str, raised_as: type[Exception]
) -> None:
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    with pytest.raises(raised_as) as raised, db.transaction() as tx:
        driver.pipelined(tx.conn, [(_BUMP, {"b_run": run_id})])
        driver.send(tx.conn, _BUMP, {"b_run": run_id})
        driver.send(tx.conn, failing, {"b_run": run_id})
    assert not isinstance(raised.value, CommitUnknown)  # refused: known not applied
    assert says in str(raised.value)
    assert _seq(client, run_id) == before
    assert _autocommit_of_pool(client) == [False]


def test_a_lost_connection_at_the_commit_is_an_unknown_commit(
    backend: Backend, client: Fleet
) -> None:
    run_id = client.enqueue("chain", 1).id
    db = client.runtime.db
    with db.engine.connect() as killer:
        killer.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(CommitUnknown), db.transaction() as tx:
            pid = tx.conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            driver.send(tx.conn, _BUMP, {"b_run": run_id})
            killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    assert _seq(client, run_id) >= 0  # the pool let the dead connection go
    assert _autocommit_of_pool(client) == [False]


def test_a_failed_owned_transaction_hands_back_a_connection_that_rolls_back(
    backend: Backend, client: Fleet
) -> None:
    """The connection fleet put in autocommit for its own BEGIN goes back to psycopg's
    transactions: a plain ``begin`` on it that fails midway applies nothing."""
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    with pytest.raises(StoreUnavailable), db.transaction() as tx:
        driver.send(tx.conn, _BUMP, {"b_run": run_id})
        raise StoreUnavailable("the caller gave up")
    for _ in range(3):  # whichever pooled connection it gets
        with pytest.raises(ZeroDivisionError), db.begin() as conn:
            conn.execute(_BUMP, {"b_run": run_id})
            raise ZeroDivisionError
    assert _seq(client, run_id) == before


def test_a_transaction_that_runs_nothing_commits_nothing(backend: Backend, client: Fleet) -> None:
    db = client.runtime.db
    with db.transaction():
        pass
    assert _autocommit_of_pool(client) == [False]


def _fleet_prepared(conn: Any) -> set[str]:
    rows = conn.execute(text("SELECT name FROM pg_prepared_statements WHERE name LIKE 'fleet%'"))
    return {name for (name,) in rows}


def test_a_statement_is_prepared_once_on_a_connection_and_kept_past_rollbacks(
    backend: Backend, client: Fleet
) -> None:
    """The first time a statement goes out on a connection it is prepared in the same
    round trip; later transactions on that connection run it as prepared (preparing it
    again would fail: the name is taken), even after a transaction that prepared it
    rolled back (psycopg, preparing its own, would deallocate them all there)."""
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    seen: dict[int, set[str]] = {}
    ran = 0
    for _ in range(50):  # until a connection comes back a second time
        with pytest.raises(ZeroDivisionError), db.transaction() as tx:
            driver.send(tx.conn, _SEQ, {"b_run": run_id})
            driver.send(tx.conn, _BUMP, {"b_run": run_id}).rows()
            raise ZeroDivisionError
        with db.transaction() as tx:
            driver.send(tx.conn, _BUMP, {"b_run": run_id})
            driver.send(tx.conn, _BUMP, {"b_run": run_id})
            pid = tx.conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            names = _fleet_prepared(tx.conn)
        ran += 1
        assert names
        if pid in seen:
            assert seen[pid] == names
            break
        seen[pid] = names
    else:
        pytest.fail("the pool never handed a connection back twice")
    assert _seq(client, run_id) == before + 2 * ran


def test_a_nul_in_a_value_is_refused_naming_it_and_applies_nothing(
    backend: Backend, client: Fleet
) -> None:
    """Postgres's text cannot hold NUL; libpq would cut the value at it. It is refused
    before anything is sent, as psycopg refuses it."""
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    with pytest.raises(Exception, match="NUL") as raised, db.transaction() as tx:
        driver.send(tx.conn, _BUMP, {"b_run": run_id})
        driver.send(tx.conn, _BUMP, {"b_run": run_id + "\x00"})
    assert not isinstance(raised.value, CommitUnknown)
    assert _seq(client, run_id) == before
    assert _autocommit_of_pool(client) == [False]


def test_a_value_refused_outside_a_fleet_transaction_leaves_its_connection_usable(
    backend: Backend, client: Fleet
) -> None:
    """Statements sent together in a transaction fleet does not hold (SQLAlchemy's own):
    one refused while they are queued ends their pipeline there, so the rollback and
    the connection's next transaction run as ever, and nothing queued before it applied."""
    run_id = client.enqueue("chain", 1).id
    before = _seq(client, run_id)
    db = client.runtime.db
    with db.engine.connect() as conn:
        with pytest.raises(Exception, match="NUL"), conn.begin():
            calls = [(_BUMP, {"b_run": run_id}), (_BUMP, {"b_run": run_id + "\x00"})]
            driver.pipelined(conn, calls)
        with conn.begin():
            assert conn.execute(_SEQ, {"b_run": run_id}).scalar_one() == before
            driver.pipelined(conn, [(_BUMP, {"b_run": run_id})])
    assert _seq(client, run_id) == before + 1
