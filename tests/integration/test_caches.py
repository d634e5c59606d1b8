"""What a process keeps of what it read (a run's finished steps, a transcript's
messages) is kept only once the transaction it was read in has committed: a read in
a transaction sees that transaction's own writes, and a rolled-back write is no fact.
Without it, a commit that failed (``CommitUnknown``) would leave a worker replaying a
step output the store never held."""

from __future__ import annotations

import pytest

from fleet import Fleet
from fleet.store.message_cache import EMPTY
from tests.harness import InlineBroker


class Rollback(Exception):
    pass


def test_a_history_read_in_a_transaction_that_rolls_back_is_not_kept(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("chain", 3)
    inline.drain()
    db, queries = client.runtime.db, client.runtime.queries
    row = queries.run(run.id)
    assert row is not None
    key = f"{run.id}\x00{row.created_at!r}"
    db.history.clear()
    with pytest.raises(Rollback), db.transaction() as tx:
        snapshot = queries.within(tx).snapshot(run.id)
        assert snapshot is not None and len(snapshot.history) == 3
        raise Rollback
    assert db.history.prefix(key) == ()
    with db.transaction() as tx:
        queries.within(tx).snapshot(run.id)
        assert db.history.prefix(key) == (), "kept only once committed"
    assert len(db.history.prefix(key)) == 3


def test_messages_read_in_a_transaction_that_rolls_back_are_not_kept(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("talks")
    inline.drain()
    db, queries = client.runtime.db, client.runtime.queries
    row = queries.run(run.id)
    assert row is not None
    key = (run.id, row.created_at, "main")
    db.messages.clear()
    with pytest.raises(Rollback), db.transaction() as tx:
        assert len(queries.within(tx).recorded(run.id, row.created_at, "main")) == 2
        raise Rollback
    assert db.messages.get(key) is EMPTY
    assert len(queries.recorded(run.id, row.created_at, "main")) == 2
    assert len(db.messages.get(key)) == 2
