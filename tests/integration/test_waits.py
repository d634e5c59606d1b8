"""Invariant 7: waiting holds no worker. Approvals, signals, timers and cancel, on real
workers over both backends."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from fleet import BadInput, Fleet, RunFailed, UnknownRun
from fleet.errors import StoreUnavailable
from fleet.states import StepKind
from fleet.store.ledger import NewStep
from fleet.testing import InlineBroker
from fleet.worker.inline import advance_steps
from fleet.worker.sweeper import sweep_once
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, find_event, poll, starts


def test_an_approval_holds_no_worker_and_survives_restarts(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    first = cluster.worker("w1", concurrency=1)  # one slot: a held worker would block all
    run = client.enqueue("approval")
    poll(lambda: run.status() == "waiting", 30, "the run to wait for its approval")
    others = [client.enqueue("chain", 3) for _ in range(3)]
    assert [o.wait(timeout=60) for o in others] == [5, 5, 5], "the one slot stayed free"
    first.signal(signal.SIGKILL)  # a redeploy while it waits
    cluster.worker("w2", concurrency=1)
    assert run.status() == "waiting"

    out = fleet_cli(backend, "signal", run.id, "approval", "--data", '{"approved": true}')
    assert out.returncode == 0, out.stderr
    assert run.wait(timeout=60) == {"decision": {"approved": True}}
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1}


def test_signals_before_the_wait_are_kept_and_consumed_in_order(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("inbox", 2)
    client.signal(run.id, "msg", {"n": 1})  # before the first wait: work#1 takes 1 s
    client.signal(run.id, "msg", {"n": 2})
    assert run.wait(timeout=60) == [{"n": 1}, {"n": 2}]


def test_a_wait_times_out_with_none(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    cluster.worker("w1")
    cluster.sweeper()
    run = client.enqueue("approval", 1.0)
    assert run.wait(timeout=60) == {"decision": None}
    assert starts(backend, run.id) == {"work#1": 1}


def test_signalling_an_ended_or_unknown_run_is_a_clear_error(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("chain", 1)
    run.wait(timeout=60)
    with pytest.raises(BadInput, match="is succeeded: a signal can only go to a live run"):
        client.signal(run.id, "approval", {})
    with pytest.raises(UnknownRun, match="unknown run id 'nope'"):
        client.signal("nope", "approval", {})
    out = fleet_cli(backend, "signal", "nope", "approval", "--data", "{bad")
    assert out.returncode == 2 and "--data is not JSON" in out.stderr


def test_concurrent_deliveries_resume_exactly_once(client: Fleet) -> None:
    ledger = client.runtime.ledger
    assert ledger.create_run("r", "approval", "1", "{}", '{"args":[],"kwargs":{}}', "fleet")
    assert ledger.start_run("r")
    ledger.record_steps("r", [NewStep("wait:go#1", 0, "wait:go", StepKind.WAIT, "{}", 1)])
    for i in range(3):
        assert ledger.add_signal("r", "go", f'{{"i":{i}}}')
    delivered: list[int] = []
    barrier = threading.Barrier(6)

    def deliver() -> None:
        barrier.wait()
        delivered.append(ledger.deliver_signals("r"))

    threads = [threading.Thread(target=deliver) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(delivered) == 1, "one wait, one resumption"
    step = client.runtime.queries.step("r", "wait:go#1")
    assert step is not None and step.output == '{"i":0}', "the oldest signal first"


def test_sleep_survives_a_worker_restart(backend: Backend, client: Fleet, cluster: Cluster) -> None:
    first = cluster.worker("w1")
    cluster.sweeper()
    run = client.enqueue("napper", 3.0)
    poll(lambda: run.status() == "waiting", 30, "the run to go to sleep")
    first.signal(signal.SIGKILL)
    cluster.worker("w2")
    slept = run.wait(timeout=60)
    assert slept >= 3.0 - 0.05
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1}


def test_cancel_a_running_a_waiting_and_a_queued_run(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    queued = client.enqueue("chain", 2)  # no worker yet: it stays queued
    assert client.cancel(queued.id, "no longer needed")
    cluster.worker("w1")
    cluster.sweeper()
    waiting = client.enqueue("approval")
    running = client.enqueue("chain", 3, 0.0, 0, 6.0)  # work#1 holds its first attempt 6 s
    poll(lambda: find_event(backend, running.id, "work#1", "start"), 30, "a running step")
    # The running run first, at once and in this process: a CLI started under load (or
    # a wait for the other run first) can take longer than the step's hold, and the run
    # would have succeeded by then.
    assert client.cancel(running.id, "over budget")
    poll(lambda: waiting.status() == "waiting", 30, "a waiting run")
    out = fleet_cli(backend, "cancel", waiting.id, "--reason", "changed my mind")
    assert out.returncode == 0, out.stderr

    for handle, reason in (
        (queued, "no longer needed"),
        (waiting, "changed my mind"),
        (running, "over budget"),
    ):
        with pytest.raises(RunFailed, match=f"cancelled: {reason}"):
            handle.wait(timeout=5)
    # The running step finished its work, but its commit was fenced and nothing followed.
    poll(
        lambda: any(a.outcome == "fenced" for a in client.runtime.queries.attempts(running.id)),
        30,
        "the cancelled step's commit to be fenced",
    )
    assert starts(backend, running.id) == {"work#1": 1}
    assert starts(backend, queued.id) == {}
    with pytest.raises(BadInput, match="a signal can only go to a live run"):
        client.signal(waiting.id, "approval", {"approved": True})
    again = fleet_cli(backend, "cancel", waiting.id)
    assert again.returncode == 1 and "already ended" in again.stderr


def test_a_kept_signal_reaches_its_wait_when_the_advance_died_after_recording_it(
    client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal sent before its wait is handed over by the advance that records the
    wait. When that advance dies between the two (the wait committed, the hand-over
    lost with the connection: found by the chaos run under a Postgres restart), the
    advance made again replays onto the pending wait and must hand the kept signal
    over there; else the run waits for ever on a signal it has."""
    run = client.enqueue("approval")
    client.signal(run.id, "approval", {"approved": True})  # before the wait is reached
    ledger = type(client.runtime.ledger)
    deliver = ledger.deliver_signals
    armed = [True]

    def lost(self: Any, run_id: str) -> int:
        if armed[0]:
            raise StoreUnavailable("the connection was lost")
        return deliver(self, run_id)

    monkeypatch.setattr(ledger, "deliver_signals", lost)
    # work#1, then the advance after it: its one transaction fails (Postgres; SQLite
    # makes each store call its own), then store call by store call the wait's record
    # commits and the hand-over after it fails: "the sweeper will retry".
    inline.drain()
    wait = client.runtime.queries.step(run.id, "wait:approval#1")
    assert wait is not None and wait.status == "pending"
    assert run.status() == "running"  # its wake-up unanswered: the sweeper re-sends it
    armed[0] = False
    advance_steps(client.runtime, run.id)  # the re-sent advance replays onto the wait
    inline.drain()
    assert run.wait(timeout=5) == {"decision": {"approved": True}}


def test_a_signal_both_hand_overs_missed_is_handed_over_by_the_sweeper(
    client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal sent while its wait is being recorded: the sender's hand-over finds no
    pending wait and the recording advance's finds no signal, when each runs before
    the other's write commits (found by the chaos run: a run waited for ever with the
    signal kept). The store holds both, so the sweeper hands the signal over."""
    ledger = type(client.runtime.ledger)
    monkeypatch.setattr(ledger, "deliver_signals", lambda self, run_id: 0)  # both miss
    run = client.enqueue("approval")
    inline.drain()  # work#1, then the advance that records the wait and parks
    client.signal(run.id, "approval", {"approved": True})  # kept: no wait found
    inline.drain()
    assert run.status() == "waiting"
    assert sweep_once(client.runtime).signals == 0  # still missed: nothing handed over
    monkeypatch.undo()
    assert sweep_once(client.runtime).signals == 1
    inline.drain()
    assert run.wait(timeout=5) == {"decision": {"approved": True}}
    assert sweep_once(client.runtime).signals == 0  # consumed: never handed over twice
