"""A recorded run replayed locally (issue 50, ``fleet.testing.replay``): its workflow
runs in the test's process over the run's history with no step body executed, ends as
the run ended or says what it would do next, names the first step a changed workflow
no longer takes, and never writes: the store is the same before and after, and the
replay's connections are ones the database refuses writes on. Both stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import make_url

from fleet import Fleet, NonDeterminism, RunFailed
from fleet.errors import BadInput, StoreUnavailable, UnknownRun
from fleet.records import Replay
from fleet.registry import WorkflowDef
from fleet.states import Incident
from fleet.store.engine import sqlite_path
from fleet.store.readonly import PG_READ_ONLY, read_only_url
from fleet.testing import InlineBroker, replay
from fleet.worker.replayer import local_runtime
from tests import replay_flows
from tests.harness import Backend, everything_in_the_store
from tests.replay_flows import BODIES, CHANGED

TOPIC = "durable runs"
APPROVED = {"approved": True, "by": "ann"}


def _until_waiting(fleet: Fleet, strict: bool = False) -> tuple[str, InlineBroker]:
    broker = InlineBroker(fleet)
    run = fleet.enqueue("agent", TOPIC, strict)
    broker.drain()
    assert run.status() == "waiting"
    return run.id, broker


def _recorded(fleet: Fleet, decision: dict[str, Any] = APPROVED, strict: bool = False) -> str:
    """A run of ``agent`` recorded to its end: the signal sent once it waits."""
    run_id, broker = _until_waiting(fleet, strict)
    fleet.signal(run_id, "approval", decision)
    broker.drain()
    assert fleet.run(run_id).status() in ("succeeded", "failed")
    return run_id


def _file_bytes(fleet: Fleet) -> bytes | None:
    """The embedded store's database file as it is on disk (None on Postgres)."""
    path = sqlite_path(fleet.settings.database_url)
    return None if path is None else path.read_bytes()


def _replayed(fleet: Fleet, run_id: str, **given: Any) -> Replay:
    """The replay, checked to have executed no step body and changed nothing: every
    row the same, and on SQLite the database file byte for byte."""
    before, file_before = everything_in_the_store(fleet), _file_bytes(fleet)
    BODIES.clear()
    try:
        return replay(run_id, fleet=fleet, **given)
    finally:
        assert sum(BODIES.values()) == 0, f"step bodies ran in the replay: {BODIES}"
        assert _file_bytes(fleet) == file_before, "the replay wrote to the database file"
        assert everything_in_the_store(fleet) == before, "the replay changed the store"


def test_a_finished_run_replays_to_its_result_with_no_step_body_executed(
    recorder: Fleet,
) -> None:
    run_id = _recorded(recorder)
    result = recorder.run(run_id).wait(timeout=0)
    assert result["child"] == 42 and result["decision"] == APPROVED
    assert result["window"][0]["role"] == "system", "the compaction's summary leads it"
    got = _replayed(recorder, run_id)
    assert got == Replay(run_id, "finished", result=result, replayed=9)
    # The child run is a run: replayed alone, it ends as it did.
    child = _replayed(recorder, f"{run_id}/helper")
    assert (child.status, child.result) == ("finished", 42)


def test_a_failed_run_replays_to_its_error(recorder: Fleet) -> None:
    run_id = _recorded(recorder, {"approved": False, "by": "bob"}, strict=True)
    with pytest.raises(RunFailed) as failed:
        recorder.run(run_id).wait(timeout=0)
    recorded = failed.value.error or ""
    got = _replayed(recorder, run_id)
    assert got.status == "failed" and got.error is not None
    assert got.error.partition("\n")[0] == recorded.partition("\n")[0]
    assert got.error.partition("\n")[0] == "RuntimeError: rejected by bob"


def test_a_run_stopped_at_a_wait_replays_to_suspended_naming_it(recorder: Fleet) -> None:
    run_id, _ = _until_waiting(recorder)
    got = _replayed(recorder, run_id)
    assert got == Replay(
        run_id, "suspended", next=("wait:approval#1",), wait="approval", replayed=7
    )


def test_a_run_past_its_recorded_steps_replays_to_what_it_would_record(
    recorder: Fleet,
) -> None:
    """Signalled, not yet advanced: the replay passes the wait and stands before the
    step an advance would record now."""
    run_id, broker = _until_waiting(recorder)
    recorder.signal(run_id, "approval", APPROVED)
    got = _replayed(recorder, run_id)
    assert got == Replay(run_id, "suspended", next=("add#1",), new=("add#1",), replayed=7)
    broker.drain()
    assert recorder.run(run_id).status() == "succeeded"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("asks_first", ["'add#1'", "'think#1'", "position 1"]),
        ("says_otherwise", ["message 0 of transcript 'main'", "DURABLE RUNS"]),
        ("one_more", ["the run succeeded", "'add#2'"]),
    ],
)
def test_a_workflow_changed_after_recording_raises_non_determinism(
    recorder: Fleet, change: str, named: list[str]
) -> None:
    run_id = _recorded(recorder)
    with pytest.raises(NonDeterminism) as raised:
        _replayed(recorder, run_id, workflow=CHANGED[change])
    for part in named:
        assert part in str(raised.value)
    assert recorder.runtime.queries.incident_counts(run_id).get(Incident.NONDETERMINISM) is None
    # The code as it was still replays: the run itself is untouched.
    assert _replayed(recorder, run_id).status == "finished"


def test_another_version_is_refused_unless_given_as_the_workflow(recorder: Fleet) -> None:
    run_id = _recorded(recorder)
    newer = WorkflowDef("agent", CHANGED["one_more"].fn, "2")
    try:
        recorder.registry.workflows["agent"] = newer
        with pytest.raises(BadInput, match="version 1 .* the registered one is version 2"):
            replay(run_id, fleet=recorder)
        with pytest.raises(NonDeterminism):
            replay(run_id, fleet=recorder, workflow="agent")
    finally:
        recorder.registry.workflows["agent"] = replay_flows.agent


def test_without_a_fleet_the_workflow_and_store_are_enough(
    backend: Backend, recorder: Fleet
) -> None:
    run_id = _recorded(recorder)
    got = replay(run_id, database_url=backend.database_url, workflow=replay_flows.agent)
    assert (got.status, got.result) == ("finished", recorder.run(run_id).wait(timeout=0))
    with pytest.raises(BadInput, match="needs the Fleet"):
        replay(run_id, database_url=backend.database_url)
    with pytest.raises(UnknownRun):
        replay("no-such-run", fleet=recorder)


def test_the_replay_store_refuses_writes(backend: Backend, recorder: Fleet) -> None:
    """The replay's runtime is read-only at the database: a write it tried (here, an
    incident) fails and leaves nothing."""
    run_id = _recorded(recorder)
    before = everything_in_the_store(recorder)
    rt = local_runtime(backend.settings(), recorder.registry)
    try:
        assert rt.queries.run(run_id) is not None, "it reads"
        with pytest.raises(Exception, match="(?i)read-?only"):
            rt.ledger.incident(Incident.TAKEOVER, run_id, detail="a write")
    finally:
        rt.db.dispose()
    assert everything_in_the_store(recorder) == before


def test_read_only_urls(tmp_path: Path) -> None:
    db = tmp_path / "a b.db"
    with pytest.raises(StoreUnavailable, match="no such file"):
        read_only_url(f"sqlite:///{db}")
    assert not db.exists(), "a missing store is never created"
    db.touch()
    url = make_url(read_only_url(f"sqlite:///{db}"))
    assert url.database == f"file:{quote(str(db))}"
    assert dict(url.query) == {"mode": "ro", "uri": "true"}
    pg = make_url(read_only_url("postgresql+psycopg://u:secret@h/db?options=-c%20search_path%3Dx"))
    assert pg.password == "secret"
    assert pg.query["options"] == f"-c search_path=x {PG_READ_ONLY}"
