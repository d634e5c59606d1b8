"""The console's reads (``fleet/store/browse.py``): keyset pages that list every run
exactly once however many share a creation time, each filter, the id search, the
fingerprints live views poll, the approval inbox, in-doubt steps, workers, incidents by
time bucket and the live runs' queues. Both stores; steps run in this process."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from fleet import BadInput, Fleet
from fleet.states import Incident, StepKind
from fleet.store.browse import Browse, RunFilter, RunListRow
from fleet.store.ledger import Lease, NewStep
from fleet.store.schema import runs
from tests.harness import InlineBroker

ARGS = '{"args":[1],"kwargs":{}}'


def _browse(client: Fleet) -> Browse:
    return Browse(client.runtime.db)


def _created(client: Fleet, run_ids: list[str], at: float) -> None:
    """Give runs one creation time (ties the keyset must break by id)."""
    with client.runtime.db.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.id.in_(run_ids)).values(created_at=at))


def _all_pages(browse: Browse, limit: int, **filters: object) -> list[RunListRow]:
    rows: list[RunListRow] = []
    after = None
    for _ in range(100):
        page = browse.runs_page(RunFilter(**filters), after, limit)  # type: ignore[arg-type]
        assert len(page.rows) <= limit
        rows += page.rows
        if page.next is None:
            return rows
        after = page.next
    raise AssertionError("the pages never ended")


def test_keyset_pages_list_every_run_once_through_ties_in_creation_time(client: Fleet) -> None:
    ids = [f"run-{i:02}" for i in range(23)]
    for run_id in ids:
        assert client.runtime.ledger.create_run(run_id, "chain", "1", "{}", ARGS, "fleet")
    # Three creation times, seven or eight runs each: most page boundaries fall in a tie.
    for k in range(3):
        _created(client, ids[k::3], 1000.0 + k)
    browse = _browse(client)
    for limit in (1, 4, 5, 7, 23, 50):
        listed = _all_pages(browse, limit)
        keys = [(r.created_at, r.id) for r in listed]
        assert [r.id for r in listed if r.id in ids] == [
            i for _, i in sorted(keys, reverse=True) if i in ids
        ], "newest first, then by id"
        assert sorted(r.id for r in listed) == sorted(ids), f"each once (pages of {limit})"
    assert browse.runs_page(limit=23).next is None


def test_each_filter_and_the_id_search(client: Fleet, inline: InlineBroker) -> None:
    parent = client.enqueue("parent", 2, run_id="fam", tenant="acme")
    other = client.enqueue("chain", 1, run_id="famous", tenant="globex")
    waiting = client.enqueue("approval", run_id="wait-1")
    inline.drain(until=lambda: parent.status() == "succeeded" and waiting.status() == "waiting")
    inline.drain()
    _created(client, ["fam"], 2000.0)
    _created(client, ["famous"], 3000.0)
    browse = _browse(client)

    def ids(**filters: object) -> set[str]:
        return {r.id for r in _all_pages(browse, 2, **filters)}

    everyone = {"fam", "famous", "wait-1"}
    assert ids() == everyone, "children are left out by default"
    assert ids(children=True) == everyone | {"fam/kid#1"}
    assert ids(status="waiting") == {"wait-1"}
    assert ids(workflow="chain") == {"famous"}
    assert ids(tenant="acme") == {"fam"}
    assert ids(tenant="acme", children=True) == {"fam", "fam/kid#1"}, "inherited"
    assert ids(since=1500.0, until=2500.0) == {"fam"}
    assert ids(until=2500.0) == {"fam"}
    assert ids(since=2500.0) == {"famous", "wait-1"}
    assert ids(q="fam") == {"fam", "famous", "fam/kid#1"}, "a prefix, children included"
    assert ids(q="fam/") == {"fam/kid#1"}
    assert ids(q="famous") == {"famous"}
    assert ids(q="f%") == set(), "the search is literal, not a pattern"
    assert ids(q="fam", workflow="parent") == {"fam"}

    (row,) = browse.runs_page(RunFilter(q="fam", workflow="parent")).rows
    usage = client.runtime.queries.usage("fam")
    assert (row.workflow, row.tenant, row.status, row.parent_id) == (
        "parent",
        "acme",
        "succeeded",
        None,
    )
    assert (row.tokens, row.cost) == (usage["tokens"], usage["cost"]), "its children's too"
    assert row.tokens > 0 and (row.steps_done, row.steps_total) == (2, 2)
    (child,) = browse.runs_page(RunFilter(q="fam/")).rows
    assert child.parent_id == "fam" and child.tokens < row.tokens
    assert other.status() == "succeeded"


def test_bad_arguments_are_one_line(client: Fleet) -> None:
    browse = _browse(client)
    with pytest.raises(BadInput, match="is not one this console made"):
        browse.runs_page(after="not-a-cursor")
    with pytest.raises(BadInput, match="unknown status 'sleepy'"):
        browse.runs_page(RunFilter(status="sleepy"))
    with pytest.raises(BadInput, match="limit must be 1-500"):
        browse.runs_page(limit=0)
    with pytest.raises(BadInput, match="bucket_seconds must be above 0"):
        browse.incidents_by_bucket(0.0, 0)


def _deliver(inline: InlineBroker, run_id: str) -> None:
    """Deliver the oldest message for ``run_id`` (the others wait their turn)."""
    i = next(i for i, (_, args) in enumerate(inline.sent) if args[0] == run_id)
    inline.sent.insert(0, inline.sent.pop(i))
    inline.step()


def test_fingerprints_change_when_a_step_commits_and_not_otherwise(
    client: Fleet, inline: InlineBroker
) -> None:
    browse = _browse(client)
    run = client.enqueue("chain", 2)
    assert browse.run_fingerprint("nope") is None
    inline.step()  # the advance: the run starts, work#1 is recorded
    seen = browse.run_fingerprint(run.id), browse.runs_fingerprint()
    assert seen == (browse.run_fingerprint(run.id), browse.runs_fingerprint()), "stable"
    client.enqueue("chain", 1, run_id="elsewhere", tenant="other")
    assert browse.run_fingerprint(run.id) == seen[0], "another run is not this one"
    assert browse.runs_fingerprint(RunFilter(tenant="nobody")) == browse.runs_fingerprint(
        RunFilter(tenant="nobody")
    )
    listed = browse.runs_fingerprint()
    assert listed != seen[1], "a new run in the list"
    before_other = browse.runs_fingerprint(RunFilter(tenant="other"))
    _deliver(inline, "elsewhere")  # its advance: it starts
    assert browse.run_fingerprint(run.id) == seen[0]
    assert browse.runs_fingerprint(RunFilter(tenant="other")) != before_other
    before = browse.run_fingerprint(run.id), browse.runs_fingerprint(RunFilter(workflow="chain"))
    _deliver(inline, run.id)  # work#1 runs and commits
    assert client.runtime.queries.step(run.id, "work#1").status == "done"  # type: ignore[union-attr]
    after = browse.run_fingerprint(run.id), browse.runs_fingerprint(RunFilter(workflow="chain"))
    assert after[0] != before[0] and after[1] != before[1], "a step committed"


def test_the_inbox_lists_a_waiting_run_until_its_signal(
    client: Fleet, inline: InlineBroker
) -> None:
    browse = _browse(client)
    run = client.enqueue("approval", 60.0, tenant="acme")
    busy = client.enqueue("chain", 1)
    inline.drain(until=lambda: run.status() == "waiting")
    (row,) = [w for w in browse.waiting_on_signal() if w.run_id == run.id]
    assert (row.workflow, row.tenant, row.name) == ("approval", "acme", "approval")
    assert row.timeout_at is not None and row.timeout_at == pytest.approx(row.since + 60, abs=1)
    assert busy.id not in {w.run_id for w in browse.waiting_on_signal()}
    client.signal(run.id, "approval", {"approved": False})
    inline.drain()
    assert run.status() == "succeeded"
    assert browse.waiting_on_signal() == []


def test_in_doubt_workers_incidents_and_queues(client: Fleet) -> None:
    browse, ledger = _browse(client), client.runtime.ledger
    assert browse.workers() == [] and browse.queue_names() == []
    assert ledger.create_run("r", "notify", "1", "{}", ARGS, "fleet")
    assert ledger.create_run("q", "chain", "1", "{}", ARGS, "slow-lane")
    assert ledger.start_run("r")
    new = [NewStep(f"s#{i}", i, "send_plain", StepKind.TASK, "{}", 1) for i in (1, 2, 3)]
    ledger.record_steps("r", new)
    held = ledger.take_lease("r", "s#1", "worker-a", 60)
    ledger.take_lease("r", "s#2", "worker-b", 0.001)  # expires at once: not live
    doubt = ledger.take_lease("r", "s#3", "worker-a", 60)
    assert isinstance(held, Lease) and isinstance(doubt, Lease)
    assert ledger.park_in_doubt("r", "s#3", doubt.epoch)
    assert browse.in_doubt("r") == ["s#3"] and browse.in_doubt("q") == []
    (worker,) = browse.workers()
    assert worker.worker == "worker-a" and [s[:2] for s in worker.running] == [("r", "s#1")]
    assert worker.running[0][2] > browse.now()
    assert browse.queue_names() == ["fleet", "slow-lane"]

    now = browse.now()
    for kind in (Incident.TAKEOVER, Incident.TAKEOVER, Incident.FENCED_WRITE):
        ledger.incident(kind, "r")
    later = browse.now()
    # Buckets on the clock (multiples of 300 s), whatever "since" is: each incident in
    # the one its time falls in, between now and later.
    found = browse.incidents_by_bucket(now - 100, 300)
    assert all(b % 300 == 0 and now // 300 * 300 <= b <= later for b, _, _ in found), found
    counts: dict[str, int] = {}
    for _, kind, n in found:
        counts[kind] = counts.get(kind, 0) + n
    assert counts == {"effect_in_doubt": 1, "fenced_write": 1, "takeover": 2}  # s#3 parked
    assert browse.incidents_by_bucket(now - 450, 60) == browse.incidents_by_bucket(now - 100, 60)
    assert browse.incidents_by_bucket(later + 60, 300) == []
    client.cancel("q")
    assert browse.queue_names() == ["fleet"], "the queues of live runs only"
