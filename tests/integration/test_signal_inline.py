"""An advance (a new run's, or one that resumes a waiting run when its signal came)
executes the first task step its replay recorded itself, with no execute message; the
step is still taken through a delivery's lease, so a worker that dies in it or before
taking it costs a sweep.

The module is also a small application (``signal_app``) for the worker that kills
itself in the resumed step: ``fleet worker -A tests.integration.test_signal_inline``.
"""

from __future__ import annotations

import logging
import os
import signal as signals
from typing import Any

import pytest

from fleet import Fleet, RetryPolicy, StepContext, WorkflowContext
from fleet.errors import StoreUnavailable
from fleet.store.ledger import Lease
from fleet.worker.dispatch import ADVANCE, EXECUTE
from fleet.worker.inline import advance_steps
from fleet.worker.replay import replay_run
from tests.flows import log_event
from tests.harness import Backend, Cluster, InlineBroker, executions, find_event, poll

signal_app = Fleet("signalinline")
SIGNAL_APP = "tests.integration.test_signal_inline:signal_app"


@signal_app.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.1, jitter=False))
def die_once(ctx: StepContext) -> int:
    """Kills the process running it on its first attempt."""
    log_event(ctx, "start")
    if ctx.attempt == 1:
        os.kill(os.getpid(), signals.SIGKILL)
    return ctx.attempt


@signal_app.workflow(version="1")
def wait_then_die(wf: WorkflowContext) -> int:
    wf.wait_for("go")
    return int(wf.step(die_once))


def _parked(client: Fleet, broker: InlineBroker) -> str:
    """An ``approval`` run (work#1, then a wait), run in this process until it waits."""
    run = client.enqueue("approval")
    broker.drain(until=lambda: run.status() == "waiting")
    assert run.status() == "waiting"
    broker.sent.clear()
    return run.id


def _step_messages(cluster: Cluster, pid: int | None = None) -> list[str]:
    """The step messages the workers (or the one with ``pid``) took from the broker, by
    Celery's log line; a run's wake-up shows as ``advance:<queue>`` and is left out."""
    return [
        line
        for p in cluster.procs
        if pid is None or p.pid == pid
        for line in p.output().splitlines()
        if "celery.worker.strategy: Task " in line
        and line.endswith(" received")
        and "Task advance:" not in line
    ]


def test_the_signal_s_advance_runs_the_next_step_in_its_own_task_without_a_message(
    backend: Backend, client: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    broker = InlineBroker(client)
    run_id = _parked(client, broker)
    client.signal(run_id, "approval", {"approved": True})
    assert broker.sent == [(ADVANCE, [run_id])]
    broker.sent.clear()

    assert advance_steps(client.runtime, run_id) == 1, "work#2 ran in the advance's task"
    assert [m for m in broker.sent if m[0] == EXECUTE] == [], "and was never sent"
    run = client.run(run_id)
    assert run.status() == "succeeded"
    (work2,) = [s for s in run.steps() if s.id == "work#2"]
    assert (work2.status, work2.attempts, work2.epoch) == ("done", 1, 1), "leased like a delivery"
    assert find_event(backend, run_id, "work#2", "start", pid=os.getpid())


def test_the_advance_of_a_new_run_runs_its_first_step_in_its_own_task(
    backend: Backend, client: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run starts with one message, not two: its advance takes the first step's
    lease as a delivery would and runs it, then goes on to the run's wait."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    broker = InlineBroker(client)
    run = client.enqueue("approval")
    assert broker.sent == [(ADVANCE, [run.id])]
    broker.sent.clear()
    assert advance_steps(client.runtime, run.id) == 1, "work#1 ran in the advance's task"
    assert broker.sent == [], "and was never sent"
    assert run.status() == "waiting"
    (work1,) = run.steps()
    assert (work1.id, work1.status, work1.attempts, work1.epoch) == ("work#1", "done", 1, 1)
    assert find_event(backend, run.id, "work#1", "end", pid=os.getpid())


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_an_advance_whose_one_transaction_fails_is_made_store_call_by_store_call(
    backend: Backend, client: Fleet, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The replay and the first step's lease are one transaction: when it fails (here
    the record of the step, the connection lost), none of it applies, and the advance
    is made again with each store call on its own, as a step's commit falls back."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    broker = InlineBroker(client)
    run = client.enqueue("approval")
    broker.sent.clear()
    ledger = type(client.runtime.ledger)
    record = ledger.record_steps
    failed: list[str] = []

    def lost_in_the_transaction(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.tx is not None and not failed:
            failed.append(run.status())
            raise StoreUnavailable("the connection was lost")
        return record(self, *args, **kwargs)

    monkeypatch.setattr(ledger, "record_steps", lost_in_the_transaction)
    with caplog.at_level(logging.WARNING, logger="fleet.replay"):
        assert advance_steps(client.runtime, run.id) == 1, "work#1 ran all the same"
    assert failed == ["queued"], "the start of the run had not committed when it failed"
    assert "in one transaction failed" in caplog.text
    assert run.status() == "waiting"
    (work1,) = run.steps()
    assert (work1.id, work1.status, work1.attempts, work1.epoch) == ("work#1", "done", 1, 1)
    assert [e["step"] for e in executions(backend, run.id) if e["event"] == "start"] == ["work#1"]


def test_a_second_advance_of_the_same_signal_drops_the_step_on_the_live_lease(
    backend: Backend, client: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two advances of one signal (the signal's and the sweeper's) both read the run
    waiting: the second finds the step recorded and leased by the first, and drops it
    as a duplicate delivery does (invariant 3)."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    broker = InlineBroker(client)
    run_id = _parked(client, broker)
    client.signal(run_id, "approval", {"approved": True})
    broker.sent.clear()
    rt = client.runtime
    stale = rt.queries.snapshot(run_id)  # what the second advance read: the run waiting
    replayed = replay_run(rt, run_id)  # the first advance records work#2 ...
    assert replayed is not None and [t.step_id for t in replayed.tasks] == ["work#2"]
    lease = rt.ledger.take_lease(run_id, "work#2", "elsewhere:1", 60.0)  # ... and runs it
    assert isinstance(lease, Lease)
    # Every Queries reads it, the one bound to the advance's transaction included.
    monkeypatch.setattr(type(rt.queries), "snapshot", lambda _self, _run_id: stale)
    assert advance_steps(rt, run_id) == 0, "the second one runs nothing"
    assert broker.sent == [], "and sends nothing"
    assert not [e for e in executions(backend, run_id) if e["step"] == "work#2"]
    monkeypatch.undo()
    (work2,) = [s for s in client.run(run_id).steps() if s.id == "work#2"]
    assert (work2.status, work2.epoch) == ("running", 1), "the first one's lease stands"


def test_the_next_step_runs_in_the_worker_that_took_the_signal(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=1)
    run = client.enqueue("approval")
    poll(lambda: run.status() == "waiting", 30, "the run to wait")
    assert _step_messages(cluster) == [], "work#1 ran in the new run's advance"
    client.signal(run.id, "approval", {"approved": True})
    assert run.wait(timeout=60)["decision"] == {"approved": True}
    assert _step_messages(cluster) == [], "work#2 ran in the signal's advance"
    assert find_event(backend, run.id, "work#2", "end")


def test_a_worker_killed_right_after_the_record_leaves_the_step_to_the_sweeper(
    backend: Backend, client: Fleet, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay recorded work#2 and resumed the run; its worker died before taking
    the step (never sent: only the store knows of it)."""
    monkeypatch.setenv("FLEET_TEST_LOG", str(backend.log_path))
    sender = client.runtime.dispatcher.sender
    broker = InlineBroker(client)
    run_id = _parked(client, broker)
    client.signal(run_id, "approval", {"approved": True})
    broker.sent.clear()  # the advance message is lost with its worker
    replayed = replay_run(client.runtime, run_id)  # what it did before it died
    assert replayed is not None and [t.step_id for t in replayed.tasks] == ["work#2"]
    client.runtime.dispatcher.use(sender)
    cluster.worker("w1", concurrency=1)
    cluster.sweeper()
    assert client.run(run_id).wait(timeout=60)["decision"] == {"approved": True}


def test_a_worker_killed_in_the_resumed_step_leaves_it_to_the_sweeper(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """SIGKILL inside the step the advance runs: its lease expires, the sweeper sends
    it, another worker runs it again, once."""
    app = signal_app.with_settings(backend.settings())
    cluster.worker("w1", concurrency=1, app=SIGNAL_APP)
    cluster.worker("w2", concurrency=1, app=SIGNAL_APP)
    cluster.sweeper()
    run = app.enqueue("wait_then_die")
    poll(lambda: run.status() == "waiting", 30, "the run to wait")
    app.signal(run.id, "go", {})
    assert run.wait(timeout=60) == 2
    first = find_event(backend, run.id, "die_once#1", "start", attempt=1)
    second = find_event(backend, run.id, "die_once#1", "start", attempt=2)
    assert first and second and first["pid"] != second["pid"]
    assert _step_messages(cluster, first["pid"]) == [], "the killed worker got no message for it"
    (step,) = [s for s in run.steps() if s.id == "die_once#1"]
    assert (step.status, step.attempts) == ("done", 2)
