"""The notes agent (``tasks/agent.py``) on real workers, Postgres and Redis: killed with
SIGKILL while a tool of a randomly chosen turn runs, it resumes into the very
conversation an uninterrupted run has, and no turn asks the model twice.

The turn is drawn from a seed printed by the test (``AGENT_KILL_SEED=N`` replays it).
A refused approval is checked in process: the destructive tool never runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, Settings
from fleet.states import AttemptOutcome, StepStatus
from fleet.testing import SWEEPER_READY, FleetProcess, sweeper_argv
from fleet.worker.gate import uses
from tasks import agent
from tasks import app as tasks_app
from tasks.model import read_calls
from tests.harness import Backend, Cluster, InlineBroker, make_backend, poll, same

APP = "tasks"
TOOL_LATENCY = 0.6  # long enough for the test to see a tool running and kill it there
APPROVAL = {"approved": True, "by": "test"}


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Backend]:
    b = make_backend("postgres", tmp_path)
    b.extra_env.update(
        FLEET_MODEL_CALLS=str(tmp_path / "model-calls.jsonl"),
        FLEET_NOTES_LOG=str(tmp_path / "notes.jsonl"),
        FLEET_TOOL_LATENCY=str(TOOL_LATENCY),
    )
    yield b
    for undo in b.cleanup:
        undo()


@pytest.fixture
def fleet(pg: Backend) -> Iterator[Fleet]:
    client = tasks_app.fleet.with_settings(pg.settings())
    client.upgrade_schema()
    yield client
    client.runtime.db.dispose()


@pytest.fixture
def crew(pg: Backend) -> Iterator[Cluster]:
    c = Cluster(pg)
    sweeper = FleetProcess("sweeper", sweeper_argv(APP), pg.env(), pg.workdir)
    c.procs.append(sweeper)
    if not sweeper.wait_for_output(SWEEPER_READY, 30):
        pytest.fail(f"the sweeper did not start:\n{sweeper.output()}")
    yield c
    c.stop()


def _turns(fleet: Fleet, run_id: str) -> list[dict[str, Any]]:
    """The assistant messages of a run, turn 1 first."""
    return [m for m in fleet.transcript(run_id).raw() if m["role"] == "assistant"]


def _chats_per_turn(pg: Backend, run_id: str) -> Counter[int]:
    calls = read_calls(pg.extra_env["FLEET_MODEL_CALLS"])
    return Counter(c["turn"] for c in calls if c["run"] == run_id and c["kind"] == "chat")


def test_killed_mid_loop_the_agent_resumes_into_the_same_conversation(
    pg: Backend, fleet: Fleet, crew: Cluster
) -> None:
    crew.worker("w1", app=APP)
    first = fleet.enqueue("agent")
    fleet.signal(first.id, "approval", APPROVAL)
    answer = first.wait(timeout=120)
    uninterrupted = fleet.transcript(first.id)
    turns = _turns(fleet, first.id)
    assert answer["turns"] == len(turns) == 7 and "I deleted 'scratch'" in answer["answer"]
    assert len(uninterrupted.compactions) == 2 and uninterrupted.current is not None

    seed = int(os.environ.get("AGENT_KILL_SEED") or random.randrange(1 << 30))
    turn = random.Random(seed).randint(1, len(turns) - 1)  # the last turn calls no tool
    target = turns[turn - 1]["tool_calls"][0]["id"]
    print(f"AGENT_KILL_SEED={seed}: killing the worker in {target} (turn {turn})")

    second = fleet.enqueue("agent", tenant="acme")
    fleet.signal(second.id, "approval", APPROVAL)  # kept for the wait before delete_note
    running = poll(
        lambda: (
            (s := fleet.runtime.queries.step(second.id, target)) is not None
            and s.status == StepStatus.RUNNING
            and s.lease_owner
            and s
        ),
        90,
        f"{target} of the second run to be running",
        interval=0.02,
    )
    pid = int(running.lease_owner.rpartition(":")[2])
    victim = crew.by_pid(pid)
    victim.signal(signal.SIGKILL)
    crew.worker("w2", app=APP)
    assert second.wait(timeout=120) == answer

    # The kill landed in the tool: its first attempt was lost, the second finished.
    tried = [a for a in fleet.runtime.queries.attempts(second.id) if a.step_id == target]
    outcomes = [a.outcome for a in tried]
    assert outcomes[0] in (AttemptOutcome.LOST, AttemptOutcome.FENCED) and outcomes[-1] == (
        AttemptOutcome.DONE
    ), outcomes
    assert "w1" in tried[0].worker and "w2" in tried[-1].worker

    # The same conversation, message for message, each from the same step; same window.
    resumed = fleet.transcript(second.id)
    assert len(resumed.messages) == len(uninterrupted.messages) == 18
    for a, b in zip(uninterrupted.messages, resumed.messages, strict=True):
        assert same(a.message, b.message), (a.position, a.message, b.message)
        assert a.step_id == b.step_id, a.position
    assert same(resumed.window(), uninterrupted.window())
    assert [c.step_id for c in resumed.compactions] == ["summarize#1", "summarize#2"]

    # Nothing re-asked of the model: one call per turn (the stand-in counts them).
    for run_id in (first.id, second.id):
        assert _chats_per_turn(pg, run_id) == {t: 1 for t in range(1, 8)}, run_id
    calls = read_calls(pg.extra_env["FLEET_MODEL_CALLS"])
    summaries = Counter((c["run"], c["step"]) for c in calls if c["kind"] == "summarize")
    assert summaries == {
        (run, step): 1 for run in (first.id, second.id) for step in ("summarize#1", "summarize#2")
    }

    # The effects happened once per run, under keys of their tool calls.
    changes = Counter(
        (c["key"], c["op"]) for c in agent.read_notes_log(Path(pg.extra_env["FLEET_NOTES_LOG"]))
    )
    assert changes == {
        (f"{run}:call_{op}_note_{name}", op): 1
        for run in (first.id, second.id)
        for op, name in (("write", "digest"), ("delete", "scratch"))
    }
    assert json.loads(resumed.messages[-2].message["content"]) == {"deleted": "scratch"}

    # Every model call went through the provider's limits the example declares
    # (tasks/app.py): counted (the second run's 9 at least are in the last minute), and
    # every slot given back.
    use = {u.key: u for u in uses(fleet.runtime)}
    assert use["model"].requests >= 9 and use["model"].tokens > 0, use
    assert use["model"].running == use["per-tenant#acme"].running == 0, use


def test_a_refused_approval_keeps_the_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process on SQLite: a person refuses; the tool never runs, the model is told."""
    monkeypatch.setenv("FLEET_NOTES_LOG", str(tmp_path / "notes.jsonl"))
    client = tasks_app.fleet.with_settings(Settings(database_url=f"sqlite:///{tmp_path}/t.db"))
    client.upgrade_schema()
    broker = InlineBroker(client)
    run = client.enqueue("agent")
    broker.drain()
    assert run.status() == "waiting"
    client.signal(run.id, "approval", {"approved": False, "by": "ops"})
    broker.drain()
    result = run.wait(timeout=0)
    assert "I kept 'scratch': deleting it was refused" in result["answer"]
    info = client.transcript(run.id)
    refusal = info.messages[-2]
    assert refusal.step_id is None, "the workflow wrote it: no tool step ran"
    assert json.loads(refusal.message["content"]) == {"refused": "scratch", "by": "ops"}
    assert [c["op"] for c in agent.read_notes_log(tmp_path / "notes.jsonl")] == ["write"]
    client.runtime.db.dispose()


def test_a_research_sub_task_is_handed_to_a_child_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process on SQLite: a task that asks for research has the research workflow
    run as a child of the agent, in parallel with the first tool call; its report
    reaches the digest and its spend the agent's usage."""
    monkeypatch.setenv("FLEET_NOTES_LOG", str(tmp_path / "notes.jsonl"))
    client = tasks_app.fleet.with_settings(Settings(database_url=f"sqlite:///{tmp_path}/t.db"))
    client.upgrade_schema()
    broker = InlineBroker(client)
    task = "Tidy my notes: read them all, research durable execution, and write a digest."
    run = client.enqueue("agent", task)
    broker.drain()
    client.signal(run.id, "approval", APPROVAL)  # the scratch note's delete
    broker.drain()
    result = run.wait(timeout=0)
    assert "a researcher looked into durable execution" in result["answer"]
    kids = [r for r in client.runtime.queries.runs(limit=100) if r.parent_id == run.id]
    assert [(k.id, k.workflow, k.status) for k in kids] == [
        (f"{run.id}/call_research", "research", "succeeded")
    ]
    first = _turns(client, run.id)[0]
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["list_notes", "research"]
    report = client.runtime.queries.run(kids[0].id)
    assert report is not None and report.result is not None
    gist = json.loads(report.result)["report"].split("In short:")[1].strip()[:40]
    (written,) = [c for c in agent.read_notes_log(tmp_path / "notes.jsonl") if c["op"] == "write"]
    assert "- research on durable execution: " + gist in written["text"]
    tree, kid = run.usage(), client.run(kids[0].id).usage()
    assert kid["calls"] > 0 and kid["cost"] > 0
    assert tree["calls"] > kid["calls"] and tree["cost"] > kid["cost"]
    client.runtime.db.dispose()
