"""A finished step's commit, the replay after it and the lease of the next step share
one transaction (``Database.transaction``, handed to each store call through a
runtime bound to it): what it sends goes out only once it committed, a failure
inside it loses nothing that was recorded before, and the per-process history cache
serves exactly what a full read would."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.store.engine import Database, Transaction
from fleet.store.ledger import Ledger
from fleet.store.rows import StepRow
from fleet.store.snapshots import HISTORY, read_snapshot
from fleet.worker.dispatch import Message
from fleet.worker.inline import run_steps
from tests.harness import Backend, InlineBroker, starts


def _main_thread_transactions(client: Fleet) -> list[int]:
    """A counter of the transactions this thread begins (heartbeats run in others)."""
    count = [0]
    me = threading.get_ident()

    @event.listens_for(client.runtime.db.engine, "begin")
    def _begun(conn: Any) -> None:
        if threading.get_ident() == me:
            count[0] += 1

    return count


def test_an_inline_step_costs_one_transaction(
    client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ``work`` step's body records usage (a transaction of its own): not counted.
    usage = client.runtime.ledger.add_usage
    recorded = [0]

    def counted_usage(*args: Any, **kwargs: Any) -> None:
        recorded[0] += 1
        usage(*args, **kwargs)

    monkeypatch.setattr(client.runtime.ledger, "add_usage", counted_usage)
    run = client.enqueue("chain", 8)
    inline.drain(until=lambda: any(task == "fleet.execute" for task, _ in inline.sent))
    (message,) = [args for task, args in inline.sent if task == "fleet.execute"]
    inline.sent.clear()
    count = _main_thread_transactions(client)
    steps = run_steps(client.runtime, run.id, message[1], more=lambda n: True)
    transactions = count[0] - recorded[0]
    assert steps == 8 and run.wait(timeout=5) == sum(i * i for i in range(8))
    # The first step reads its run and takes its lease (2); every step then commits,
    # replays and takes the next one in one transaction. Without sharing it, 4 per step.
    assert transactions <= steps + 2, f"{transactions} transactions for {steps} steps"
    assert inline.sent == [], "a sequential run needs no message after the first"


class _VisibleWhenSent:
    """A sender that notes each execute message whose step another connection cannot
    see yet (``unseen``), then hands the message on to ``inline``."""

    def __init__(self, onlooker: Engine, inline: InlineBroker) -> None:
        self.onlooker = onlooker
        self.inline = inline
        self.sent: list[list[str]] = []
        self.unseen: list[list[str]] = []

    def send(self, message: Message) -> None:
        if message.task == "fleet.execute":
            self.sent.append(message.args)
            with self.onlooker.connect() as conn:
                rows = conn.execute(HISTORY, {"b_run": message.args[0]}).all()
            if not any(r.step_id == message.args[1] for r in rows):
                self.unseen.append(message.args)
        self.inline.send(message)


def test_new_steps_are_sent_only_after_they_are_committed(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A message for a step the store does not have yet is dropped by its worker (the
    sweeper would send it again, late): a fan-out's messages must follow the commit."""
    # A plain engine: fleet's own would BEGIN IMMEDIATE on SQLite and wait for the commit.
    onlooker = create_engine(backend.database_url)
    checking = _VisibleWhenSent(onlooker, inline)
    unseen = checking.unseen
    client.runtime.dispatcher.use(checking)
    run = client.enqueue("fan", 4)
    inline.drain()
    assert run.wait(timeout=5)["n"] == 4
    onlooker.dispose()
    assert unseen == [], f"sent before their rows were committed: {unseen}"


def _failing_once_in_transactions(
    monkeypatch: pytest.MonkeyPatch, method: str, after: bool = False
) -> list[int]:
    """Make ``method`` of the ledgers bound to a transaction (``Ledger.within``) raise
    ``StoreUnavailable`` once, before doing its work or (``after``) once it is done;
    the ledger that commits on its own is left alone. Returns the failures left."""
    within = Ledger.within
    failures = [1]

    def bound_with_a_failure(ledger: Ledger, tx: Transaction) -> Ledger:
        bound = within(ledger, tx)
        work = getattr(bound, method)

        def flaky(*args: Any, **kwargs: Any) -> Any:
            done = work(*args, **kwargs) if after else None
            if failures[0]:
                failures[0] -= 1
                raise StoreUnavailable(f"store hiccup in {method}")
            return done if after else work(*args, **kwargs)

        monkeypatch.setattr(bound, method, flaky)
        return bound

    monkeypatch.setattr(Ledger, "within", bound_with_a_failure)
    return failures


def test_a_replay_that_fails_inside_the_transaction_still_records_the_step(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction rolls back whole, so the step's output is committed on its own
    and the run goes on: the body never runs twice for a failure after it."""
    failures = _failing_once_in_transactions(monkeypatch, "record_steps")
    run = client.enqueue("chain", 3)
    inline.drain()
    assert failures == [0], "the failure was injected"
    assert run.wait(timeout=5) == 0 + 1 + 4
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1, "work#3": 1}


def test_what_a_rolled_back_replay_recorded_is_never_sent(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay inside the commit's transaction records a fan-out, then the
    transaction fails and rolls back: those steps are sent only by the replay that
    committed, each once, and each visible to another connection when it is sent."""
    onlooker = create_engine(backend.database_url)
    checking = _VisibleWhenSent(onlooker, inline)
    sent, unseen = checking.sent, checking.unseen
    client.runtime.dispatcher.use(checking)
    run = client.enqueue("fan", 3)
    inline.drain(until=lambda: any(task == "fleet.execute" for task, _ in inline.sent))
    sent.clear()
    # The first square's commit replays the run, which records the sum's step only
    # once all squares are done: the fan's last square's commit is the one that fails.
    failures = _failing_once_in_transactions(monkeypatch, "record_steps", after=True)
    inline.drain()
    onlooker.dispose()
    assert failures == [0], "the failure was injected"
    assert run.wait(timeout=5) == {"total": 5, "last": 25, "n": 3}
    assert unseen == [], f"sent before their rows were committed: {unseen}"
    assert sorted(step for _, step in sent) == ["work#1"], "sent once, after the commit"


def test_a_store_error_caught_inside_a_transaction_still_rolls_it_back(backend: Backend) -> None:
    from sqlalchemy import text

    db = Database(backend.database_url)
    table = f"unit_probe_{backend.kind}"
    with db.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(text(f"CREATE TABLE {table} (n INTEGER)"))
    with pytest.raises(StoreUnavailable, match="in the transaction failed"), db.transaction() as tx:
        with db.begin(tx) as conn:
            conn.execute(text(f"INSERT INTO {table} VALUES (1)"))
        try:
            with db.begin(tx) as conn:
                conn.execute(text(f"INSERT INTO {table} VALUES ('x', 'too many')"))
        except Exception:
            pass  # a caller that swallows the error must not get a half commit
    with db.begin() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 0

    # A plain engine: fleet's own would BEGIN IMMEDIATE on SQLite and wait for ours.
    onlooker = create_engine(backend.database_url)

    def committed() -> int:
        with onlooker.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())

    with db.transaction() as tx:
        with db.begin(tx) as conn:
            conn.execute(text(f"INSERT INTO {table} VALUES (2)"))
        with db.begin(tx) as conn:  # handed the transaction: sees its own write
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 1
        assert committed() == 0, "others see nothing before the commit"
    assert committed() == 1, "the transaction committed on leaving"
    with pytest.raises(RuntimeError, match="has ended"), db.begin(tx):
        pass
    onlooker.dispose()
    with db.begin() as conn:
        conn.execute(text(f"DROP TABLE {table}"))
    db.dispose()


def test_the_history_cache_serves_what_a_full_read_would(
    client: Fleet, inline: InlineBroker
) -> None:
    db = client.runtime.db
    run = client.enqueue("fan", 3)
    checked = 0
    while inline.sent:
        inline.step()
        with db.begin() as conn:
            cached = read_snapshot(conn, run.id, db.history)
            full = conn.execute(HISTORY, {"b_run": run.id}).all()
        assert cached is not None
        assert list(cached.history) == [StepRow.from_row(r) for r in full]
        checked += 1
    assert checked >= 4 and db.history.hits > 0, "later reads came partly from the cache"
    assert run.wait(timeout=5)["n"] == 3


def test_the_history_cache_is_bounded() -> None:
    from collections import namedtuple

    from fleet.store.history import HistoryCache

    row = namedtuple("row", "seq status input output error")
    cache = HistoryCache(max_runs=2, max_bytes=10_000)
    for run in ("a", "b", "c"):
        rows = [row(0, "done", "{}", "1", None), row(1, "pending", "{}", None, None)]
        cache.extend(run, (), rows)
    assert cache.prefix("a") == (), "the least recently used run was evicted"
    assert [r.seq for r in cache.prefix("c")] == [0], "only the finished prefix is kept"
    cache.extend("big", (), [row(0, "done", "{}", "x" * 20_000, None)])
    assert cache.prefix("big") == () and cache.prefix("c") == ()


def test_a_commit_whose_outcome_is_unknown_is_not_made_again(
    client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A COMMIT that failed may have applied: committing the step again could record it
    twice or count its own success as a fenced zombie. The attempt stops; the lease
    decides (an expired lease lets the step run again)."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.exc import OperationalError

    from fleet.store.engine import CommitUnknown

    run = client.enqueue("chain", 2)
    inline.drain(until=lambda: any(task == "fleet.execute" for task, _ in inline.sent))
    (message,) = [args for task, args in inline.sent if task == "fleet.execute"]
    inline.sent.clear()
    commit = Connection.commit
    replies = {"lost": 0}

    def lost_reply(conn: Connection) -> None:
        commit(conn)  # it applies...
        if replies["lost"]:
            replies["lost"] -= 1  # ...but the reply of the step's commit never comes
            raise OperationalError("COMMIT", {}, Exception("server closed the connection"))

    def body_ran(n: int) -> bool:
        # Called after the body, before its commit: the lease's own COMMIT came back.
        replies["lost"] = int(n == 1)
        return True

    monkeypatch.setattr(Connection, "commit", lost_reply)
    with pytest.raises(CommitUnknown):
        run_steps(client.runtime, run.id, message[1], more=body_ran)
    monkeypatch.setattr(Connection, "commit", commit)
    step = client.runtime.queries.step(run.id, "work#1")
    assert step is not None and step.status == "done", "the commit did apply"
    assert client.runtime.queries.incident_counts(run.id).get("fenced_write") is None
    assert [a.outcome for a in client.runtime.queries.attempts(run.id)] == ["done", "running"]


def test_a_replay_whose_run_cannot_start_records_nothing_and_is_advanced_again(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay of separate store calls (every advance on SQLite, and an advance's
    fallback on Postgres once its one transaction failed) moves its run on first. Were
    the start the last of its writes, a failure there would leave the next step
    recorded and the run marked advanced under a run still queued: the sweeper re-sends
    neither a run marked advanced nor a step of a run that is not running, and the run
    would wait forever (seen with Postgres cutting a loaded worker's connections)."""
    begin_replay = Ledger.begin_replay
    failures = [1]

    def flaky(ledger: Ledger, run_id: str, status: Any) -> None:
        if ledger.tx is None and failures[0]:
            failures[0] -= 1
            raise StoreUnavailable("store hiccup in begin_replay")
        begin_replay(ledger, run_id, status)

    monkeypatch.setattr(Ledger, "begin_replay", flaky)
    run = client.enqueue("chain", 3)
    with pytest.raises(StoreUnavailable):
        inline.step()  # the advance: replayed store call by store call (InlineBroker)
    assert failures == [0], "the failure was injected"
    view = client.run(run.id)
    assert view.status() == "queued"
    with client.runtime.db.begin() as conn:
        recorded = conn.execute(
            text("SELECT count(*) FROM fleet_steps WHERE run_id = :r"), {"r": run.id}
        )
        assert recorded.scalar_one() == 0, "nothing recorded under a run that did not start"
    inline.sent.append(("fleet.advance", [run.id]))  # as the sweeper re-sends it
    inline.drain()
    assert run.wait(timeout=5) == 0 + 1 + 4
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1, "work#3": 1}
