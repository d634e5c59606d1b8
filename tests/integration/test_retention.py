"""Retention (issue 13): ``fleet prune`` and ``FLEET_RETENTION`` delete finished runs
with every row of theirs and the blobs nothing references, in batches that re-check
the rule; live runs, and failed runs whose dead letter can still be replayed, stay
whole. Both stores; the sweeper and the CLI as real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, update

from fleet import Fleet
from fleet.states import Incident
from fleet.store.pruning import PruneReads
from fleet.store.schema import (
    attempts,
    blobs,
    compactions,
    dead_letters,
    fanouts,
    incidents,
    intents,
    messages,
    metadata,
    runs,
    signals,
    steps,
)
from fleet.worker.retention import BLOB_GRACE, PruneResult, RetentionSweep
from tests.harness import ROOT, Backend, Cluster, InlineBroker, make_backend, poll, starts

# Every table that holds rows of a run, and its run id column.
RUN_ROWS = {
    "runs": runs.c.id,
    "steps": steps.c.run_id,
    "attempts": attempts.c.run_id,
    "intents": intents.c.run_id,
    "signals": signals.c.run_id,
    "dead_letters": dead_letters.c.run_id,
    "incidents": incidents.c.run_id,
    "messages": messages.c.run_id,
    "compactions": compactions.c.run_id,
    "fanouts": fanouts.c.run_id,
}
BIG = 300_000  # over the 256 KiB inline limit: stored as a blob


def rows_of(client: Fleet, run_id: str) -> dict[str, list[str]]:
    """Every row of the run, table by table (as text, in a stable order)."""
    with client.runtime.db.begin() as conn:
        return {
            name: sorted(
                repr(tuple(r)) for r in conn.execute(select(col.table).where(col == run_id))
            )
            for name, col in RUN_ROWS.items()
        }


def everything(client: Fleet) -> str:
    with client.runtime.db.begin() as conn:
        return "\n".join(
            repr(tuple(row))
            for table in metadata.sorted_tables
            for row in conn.execute(select(table).order_by(*table.primary_key.columns)).all()
        )


def blob_digests(client: Fleet) -> set[str]:
    with client.runtime.db.begin() as conn:
        return set(conn.execute(select(blobs.c.digest)).scalars())


def age(client: Fleet, seconds: float, *run_ids: str) -> None:
    """Make runs look as if they finished ``seconds`` earlier."""
    with client.runtime.db.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id.in_(run_ids))
            .values(finished_at=runs.c.finished_at - seconds)
        )


def age_blobs(client: Fleet, seconds: float) -> None:
    with client.runtime.db.begin() as conn:
        conn.execute(update(blobs).values(created_at=blobs.c.created_at - seconds))


def every_kind(
    client: Fleet, inline: InlineBroker, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """Runs of every kind, by what should become of them: ``gone`` (finished) and
    ``stays`` (live, or failed with a dead letter still to replay)."""
    monkeypatch.setenv("FLEET_TEST_PROVIDER", str(backend.provider_path))
    made: dict[str, str] = {}
    made["gone:succeeded"] = client.enqueue("chain", 2).id
    made["gone:fan-out"] = client.enqueue("fan", 2).id
    made["gone:effect"] = client.enqueue("notify", "idempotent", "hello").id
    made["gone:caught-dead-letter"] = client.enqueue("guarded").id
    made["stays:failed-dead-letter"] = client.enqueue("refusing").id
    signalled = client.enqueue("approval").id
    cancelled = client.enqueue("approval").id
    made["stays:waiting"] = client.enqueue("approval").id
    made["gone:transcript"] = client.enqueue("talks").id
    made["stays:talking"] = client.enqueue("talks", True).id
    inline.drain()
    client.signal(signalled, "approval", {"approved": True})
    client.signal(made["stays:waiting"], "other", {"kept": "for a later wait"})
    client.cancel(cancelled, reason="test")
    inline.drain()
    made["gone:signalled"], made["gone:cancelled"] = signalled, cancelled
    made["stays:queued"] = client.enqueue("chain", 3).id  # its advance is never delivered
    for run_id in (made["gone:succeeded"], made["stays:waiting"]):
        client.runtime.ledger.incident(Incident.DUPLICATE_DELIVERY, run_id, "work#1")
    statuses = {k: client.run(v).status() for k, v in made.items()}
    assert statuses == {
        "gone:succeeded": "succeeded",
        "gone:fan-out": "succeeded",
        "gone:effect": "succeeded",
        "gone:caught-dead-letter": "succeeded",
        "gone:signalled": "succeeded",
        "gone:cancelled": "cancelled",
        "stays:failed-dead-letter": "failed",
        "stays:waiting": "waiting",
        "stays:queued": "queued",
        "gone:transcript": "succeeded",
        "stays:talking": "waiting",
    }
    return made


def test_finished_runs_go_with_every_row_of_theirs_and_live_runs_stay_whole(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = every_kind(client, inline, backend, monkeypatch)
    before = {kind: rows_of(client, run_id) for kind, run_id in made.items()}
    gone = [kind for kind in made if kind.startswith("gone:")]
    # Each kind of row is there to be deleted: the test would pass vacuously otherwise.
    for table in RUN_ROWS:
        assert any(before[kind][table] for kind in gone), f"no {table} row to prune"

    result = client.prune(0, batch=2)  # batches of two: several transactions

    expected = PruneResult(
        **{table: sum(len(before[kind][table]) for kind in gone) for table in RUN_ROWS},
        kept=1,
    )
    assert result == expected
    for kind, run_id in made.items():
        after = rows_of(client, run_id)
        if kind in gone:
            assert after == {table: [] for table in RUN_ROWS}, kind
        else:
            assert after == before[kind], f"{kind}: a live or kept run was touched"
    # The kept failed run's dead letter can still be replayed.
    (letter,) = client.dead_letters(run_id=made["stays:failed-dead-letter"])
    assert client.prune(0) == PruneResult(kept=1), "nothing more to prune"


def test_a_dry_run_counts_what_would_go_and_deletes_nothing(
    backend: Backend, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    every_kind(client, inline, backend, monkeypatch)
    store = everything(client)
    dry = client.prune(0, dry_run=True, batch=3)
    assert everything(client) == store, "a dry run deleted something"
    assert dry.dry_run and dry.runs == 7 and dry.kept == 1
    real = client.prune(0, batch=3)
    assert dry.counts() == real.counts()


def test_only_runs_finished_before_the_cutoff_go(client: Fleet, inline: InlineBroker) -> None:
    old, recent = client.enqueue("chain", 1).id, client.enqueue("chain", 1).id
    inline.drain()
    age(client, 7200, old)
    assert client.prune(3600).runs == 1
    assert rows_of(client, old)["runs"] == [] and rows_of(client, recent)["runs"] != []


def test_a_run_finished_at_the_cutoff_itself_goes(client: Fleet, inline: InlineBroker) -> None:
    """``prune(0)`` right after a run finished: SQLite's clock counts in milliseconds, so
    the cutoff can equal the run's finish time; "0 seconds ago or earlier" includes it."""
    run_id = client.enqueue("chain", 1).id
    inline.drain()
    with client.runtime.db.begin() as conn:
        finished_at = conn.execute(select(runs.c.finished_at).where(runs.c.id == run_id)).scalar()
    assert finished_at is not None
    assert PruneReads(client.runtime.db).prunable_trees(finished_at, "", 10).roots == [run_id]
    assert client.runtime.ledger.prune_trees([run_id], finished_at)["runs"] == 1


def test_a_run_that_changed_after_it_was_listed_is_not_deleted(
    client: Fleet, inline: InlineBroker
) -> None:
    """The batch delete re-checks the rule: a run listed as prunable that moved on before
    its batch ran (as a failed run does when its dead letter is replayed) stays whole."""
    first, second = client.enqueue("chain", 1).id, client.enqueue("chain", 1).id
    inline.drain()
    cutoff = client.runtime.queries.now() + 1
    listed = PruneReads(client.runtime.db).prunable_trees(cutoff, "", 10).roots
    assert listed == sorted([first, second])
    with client.runtime.db.begin() as conn:  # what a replay does to a failed run
        conn.execute(
            update(runs).where(runs.c.id == second).values(status="running", finished_at=None)
        )
    kept = rows_of(client, second)
    counts = client.runtime.ledger.prune_trees(sorted([first, second]), cutoff)
    assert counts["runs"] == 1
    assert rows_of(client, first)["runs"] == [] and rows_of(client, second) == kept


def test_blobs_go_only_when_nothing_references_them(client: Fleet, inline: InlineBroker) -> None:
    shared_a, shared_b = client.enqueue("large", BIG).id, client.enqueue("large", BIG).id
    alone = client.enqueue("large", BIG + 1).id
    inline.drain()
    assert len(blob_digests(client)) == 2, "one blob per distinct value"
    age_blobs(client, 2 * BLOB_GRACE)
    age(client, 7200, shared_a, alone)

    assert client.prune(3600, dry_run=True).blobs == 1
    assert client.prune(3600).blobs == 1, "the blob only `alone` referenced"
    (digest,) = blob_digests(client)
    assert client.run(shared_b).wait(timeout=5) == {"len": BIG, "same": True}

    # A writer that has just stored the same value again (and is about to reference it)
    # keeps the blob through a prune that removes its last reference.
    body = client.runtime.queries.blob(digest)
    assert body is not None
    client.runtime.ledger.put_blob(digest, body)
    assert client.prune(0).blobs == 0 and blob_digests(client) == {digest}
    age_blobs(client, 2 * BLOB_GRACE)
    assert client.prune(0) == PruneResult(blobs=1), "an unreferenced, settled blob goes"
    assert blob_digests(client) == set()


def test_a_pruned_run_id_can_be_used_again_for_a_new_run(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """A replay caches a run's finished steps by run id; a run enqueued again under a
    pruned run's id must not be replayed over the old run's steps."""
    client.enqueue("chain", 2, run_id="order-42")
    inline.drain()
    assert client.run("order-42").wait(timeout=5) == 1
    assert client.prune(0).runs == 1
    again = client.enqueue("chain", 2, run_id="order-42")
    inline.drain()
    assert again.wait(timeout=5) == 1
    assert [s.status for s in again.steps()] == ["done", "done"], "recorded afresh"
    assert starts(backend, "order-42") == {"work#1": 2, "work#2": 2}, "each run ran its steps"


def test_a_pruned_run_id_used_again_records_its_transcript_afresh(
    client: Fleet, inline: InlineBroker
) -> None:
    """Each process caches a transcript's messages by run id and creation time: a run
    enqueued again under a pruned run's id must not be compared with the old messages."""
    client.enqueue("talks", False, "first", run_id="chat-7")
    inline.drain()
    assert client.prune(0).messages == 2
    again = client.enqueue("talks", False, "second", run_id="chat-7")
    inline.drain()
    assert again.wait(timeout=5) == 2
    assert client.transcript("chat-7").raw()[0] == {"role": "user", "content": "second"}


def fleet_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args, "-A", "tests.flows"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("duration", ["30", "-1d", "1.5h", "0s", "30x", "nan", "", "d"])
def test_a_bad_duration_is_one_line_and_exit_2(tmp_path: Path, duration: str) -> None:
    """Checked before the store is opened: one store is enough."""
    env = make_backend("sqlite", tmp_path).env()
    result = fleet_cli(env, "prune", "--finished-before", duration)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--finished-before" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_the_cli_prunes_and_dry_runs(backend: Backend, client: Fleet, inline: InlineBroker) -> None:
    old = client.enqueue("chain", 2).id
    inline.drain()
    age(client, 2 * 86400, old)
    dry = fleet_cli(backend.env(), "prune", "--finished-before", "1d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would prune 1 run(s)" in dry.stdout and "2 steps" in dry.stdout
    assert rows_of(client, old)["runs"] != []
    real = fleet_cli(backend.env(), "prune", "--finished-before", "1d")
    assert real.returncode == 0, real.stderr
    assert "pruned 1 run(s)" in real.stdout
    assert rows_of(client, old) == {table: [] for table in RUN_ROWS}


def test_the_sweeper_prunes_with_fleet_retention(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    done = [client.enqueue("chain", 2) for _ in range(3)]
    for run in done:
        assert run.wait(timeout=60) == 1
    waiting = client.enqueue("approval")
    poll(lambda: waiting.status() == "waiting", 30, "the approval run to wait")
    live_rows = rows_of(client, waiting.id)
    backend.extra_env["FLEET_RETENTION"] = "1s"
    cluster.sweeper()

    def pruned() -> bool:
        return all(rows_of(client, r.id)["runs"] == [] for r in done)

    poll(pruned, 30, "the sweeper to prune the finished runs")
    assert all(rows_of(client, r.id) == {t: [] for t in RUN_ROWS} for r in done)
    assert rows_of(client, waiting.id) == live_rows, "the waiting run was touched"
    assert waiting.status() == "waiting"


def test_fleet_retention_must_be_a_duration() -> None:
    from fleet import Settings
    from fleet.errors import BadInput

    assert Settings.from_env({"FLEET_RETENTION": "30d"}).retention == 30 * 86400
    assert Settings.from_env({}).retention is None
    with pytest.raises(BadInput, match="FLEET_RETENTION '30' is not a duration"):
        Settings.from_env({"FLEET_RETENTION": "30"})


# --- trees (issue 48, item 2): a run goes only with its whole tree, all of it finished --


def finish_at(client: Fleet, seconds_ago: float, *run_ids: str) -> None:
    """Make runs look as if they finished ``seconds_ago`` seconds before now."""
    now = client.runtime.queries.now()
    with client.runtime.db.begin() as conn:
        conn.execute(
            update(runs).where(runs.c.id.in_(run_ids)).values(finished_at=now - seconds_ago)
        )


def run_ids(client: Fleet) -> set[str]:
    with client.runtime.db.begin() as conn:
        return set(conn.execute(select(runs.c.id)).scalars())


def orphans(client: Fleet) -> list[str]:
    """Runs whose parent_id names a run that is not in the store."""
    with client.runtime.db.begin() as conn:
        found = conn.execute(select(runs.c.id, runs.c.parent_id)).all()
    ids = {run_id for run_id, _ in found}
    return [run_id for run_id, parent in found if parent is not None and parent not in ids]


def test_a_live_parent_keeps_its_finished_child_and_its_budget_counts_the_childs_spend(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """The issue's case: a parent waiting on a signal, its child finished long ago with
    101 tokens spent. Neither ``fleet prune`` nor the sweeper deletes the child; the
    parent's usage stays 101 and its budget of 150 still counts it: after "go", one more
    step of 101 starts and the next does not (before the fix: usage 0, both started)."""
    run = client.enqueue("scout_then_wait", budget={"tokens": 150})
    inline.drain()
    child = f"{run.id}/scout"
    assert (run.status(), client.run(child).status()) == ("waiting", "succeeded")
    assert run.usage()["tokens"] == 101
    finish_at(client, 7200, child)
    usage, tree = run.usage(), {run.id: rows_of(client, run.id), child: rows_of(client, child)}

    assert client.prune(1, dry_run=True).runs == 0
    assert client.prune(1, batch=1) == PruneResult()
    assert RetentionSweep(client.runtime, 1.0).tick() == PruneResult()
    assert {r: rows_of(client, r) for r in tree} == tree, "a run of a live tree was touched"
    assert run.usage() == usage
    assert [r.id for r in client.runtime.queries.runs() if r.parent_id == run.id] == [child]

    client.signal(run.id, "go", {})
    inline.drain()
    assert run.status() == "needs_decision", "the budget counted the child's spend"
    assert run.usage()["tokens"] == 202
    assert starts(backend, run.id) == {"work#1": 1}


def test_a_finished_parent_and_its_running_detached_child_both_stay_then_go_together(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("abandoner")
    inline.drain()
    stray = f"{run.id}/stray"
    assert (run.status(), client.run(stray).status()) == ("succeeded", "waiting")
    finish_at(client, 7200, run.id)
    kept = {r: rows_of(client, r) for r in (run.id, stray)}

    assert client.prune(1) == PruneResult()
    assert {r: rows_of(client, r) for r in kept} == kept
    assert orphans(client) == []

    client.signal(stray, "go", {})
    inline.drain()
    assert client.run(stray).status() == "succeeded"
    assert client.prune(0).runs == 2
    assert run_ids(client) == set()


@pytest.mark.parametrize("batch", [1, 200])
def test_a_tree_three_levels_deep_goes_whole_once_every_run_of_it_is_past_the_horizon(
    client: Fleet, inline: InlineBroker, batch: int
) -> None:
    """Root, child, detached grandchild, great-grandchild, and a lone run beside them.
    While any one run of the tree finished inside the horizon, none of it goes (a dry run
    says so too); once all have, the whole tree goes in one batch, even one of a single
    run, and the dry run before counted exactly what went."""
    root = client.enqueue("lineage", 3, 2).id
    lone = client.enqueue("chain", 1).id
    inline.drain()
    tree = [root, f"{root}/heir", f"{root}/heir/heir", f"{root}/heir/heir/heir"]
    assert run_ids(client) == {*tree, lone}
    assert client.run(root).wait(timeout=5) == 4
    rows = [client.runtime.queries.run(r) for r in tree]
    assert [r.detached for r in rows if r is not None] == [False, False, True, False]

    for inside in tree:
        finish_at(client, 7200, *tree, lone)
        finish_at(client, 1800, inside)
        rows = {r: rows_of(client, r) for r in tree}
        dry = client.prune(3600, dry_run=True, batch=batch)
        assert (dry.runs, dry.steps) == (1, 1), f"only the lone run, {inside} inside"
        assert client.prune(3600, batch=batch).counts() == dry.counts()
        assert {r: rows_of(client, r) for r in tree} == rows, f"{inside} finished inside"
        lone = client.enqueue("chain", 1).id
        inline.drain()

    finish_at(client, 7200, *tree, lone)
    dry = client.prune(3600, dry_run=True, batch=batch)
    assert (dry.runs, dry.steps, dry.attempts) == (5, 5, 2)  # three child steps, two work
    assert client.prune(3600, batch=batch).counts() == dry.counts()
    assert run_ids(client) == set()


def test_a_tree_whose_child_changed_after_it_was_listed_stays_whole(
    client: Fleet, inline: InlineBroker
) -> None:
    """The ledger reads each tree again under its lock: a child that moved on after the
    tree was listed (as a replayed dead letter moves a failed run) keeps all of it."""
    run = client.enqueue("parent", 2)
    inline.drain()
    child = f"{run.id}/kid#1"
    cutoff = client.runtime.queries.now() + 1
    assert PruneReads(client.runtime.db).prunable_trees(cutoff, "", 10).roots == [run.id]
    with client.runtime.db.begin() as conn:
        conn.execute(
            update(runs).where(runs.c.id == child).values(status="running", finished_at=None)
        )
    kept = {r: rows_of(client, r) for r in (run.id, child)}
    assert client.runtime.ledger.prune_trees([run.id], cutoff) == {}
    assert {r: rows_of(client, r) for r in kept} == kept


def test_a_run_whose_parent_is_already_gone_heads_its_own_tree(
    client: Fleet, inline: InlineBroker
) -> None:
    """A store pruned run by run (before trees) may hold a child whose parent is gone:
    it is the root of what is left of its tree, and goes when that is finished."""
    run = client.enqueue("parent", 2)
    inline.drain()
    with client.runtime.db.begin() as conn:
        for column in reversed(RUN_ROWS.values()):  # the run row last
            conn.execute(column.table.delete().where(column == run.id))
    assert orphans(client) == [f"{run.id}/kid#1"]
    assert client.prune(0).runs == 1
    assert run_ids(client) == set()
