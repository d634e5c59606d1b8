"""Live runs (fleet/worker/live.py): a run's workflow parked between its advances and
resumed where it stood, on both stores, with the broker stood in by an in-process list.
What a live run records is what a run replayed from the top records; each rule that
keeps that so has a test here that fails without it. (Every test with real workers
runs live too, and every kill test replays from the top in the worker that takes over.)
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, Settings
from fleet.testing import InlineBroker
from fleet.worker import live
from fleet.worker.replay import replay_run
from tests import flows
from tests.harness import Backend


def _replaying(client: Fleet) -> tuple[Fleet, InlineBroker]:
    """The same store and workflows, every advance a replay from the top."""
    fleet = client.with_settings(replace(client.settings, live_runs=0))
    return fleet, InlineBroker(fleet)


def test_a_long_run_is_resumed_not_replayed(client: Fleet, inline: InlineBroker) -> None:
    resumed = live.RUNS.resumed
    run = client.enqueue("counted", 40)
    inline.drain()
    assert run.wait(timeout=5) == sum(range(40))
    # Entered once; replayed from the top it is entered at every advance (41 times).
    assert flows.ENTERED[run.id] == 1
    assert live.RUNS.resumed - resumed >= 40
    assert not live.RUNS.holds(run.id), "a run that ended keeps nothing parked"

    replaying, broker = _replaying(client)
    again = replaying.enqueue("counted", 40)
    broker.drain()
    assert again.wait(timeout=5) == sum(range(40))
    assert flows.ENTERED[again.id] == 41


def _story(fleet: Fleet, broker: InlineBroker, run_id: str) -> tuple[Any, list[Any], list[Any]]:
    run = fleet.enqueue("lively", run_id=run_id)
    broker.drain()
    assert run.status() == "waiting"
    fleet.signal(run.id, "go", {"ok": True})
    broker.drain()
    result = run.wait(timeout=5)
    rt = fleet.runtime
    steps = [
        (s.step_id, s.name, s.kind, s.status, s.seq, None if s.kind == "value" else s.output)
        for s in rt.queries.steps(run.id)
    ]
    return result, steps, fleet.transcript(run.id).raw()


def test_a_live_run_records_what_a_replayed_run_records(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    live_id, replayed_id = f"live-{backend.kind}", f"replayed-{backend.kind}"
    live_result, live_steps, live_chat = _story(client, inline, live_id)
    assert flows.ENTERED[live_id] == 1
    replaying, broker = _replaying(client)
    result, steps, chat = _story(replaying, broker, replayed_id)
    assert flows.ENTERED[replayed_id] > 5
    assert (
        live_result
        == result
        == {
            "first": 1,
            "squares": [2, 3, 4],
            "both": [5, 36],
            "heard": 2,
            "decision": {"ok": True},
            "later": 49,
            "random": True,
            "clock": True,
        }
    )
    assert live_steps == steps
    assert live_chat == chat


def test_a_rolled_back_advance_keeps_no_parked_workflow(
    client: Fleet, inline: InlineBroker
) -> None:
    rt = client.runtime
    run = client.enqueue("counted", 3)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), rt.db.transaction() as tx:
        replay_run(rt.within(tx), run.id)
        raise Boom
    # Kept, it would be resumed past a step whose record rolled back.
    assert not live.RUNS.holds(run.id)
    with rt.db.transaction() as tx:
        replayed = replay_run(rt.within(tx), run.id)
        assert not live.RUNS.holds(run.id), "kept only once the transaction commits"
    assert live.RUNS.holds(run.id)
    assert replayed is not None
    replayed.send(rt)
    inline.drain()
    assert run.wait(timeout=5) == 0 + 1 + 2


def test_a_workflow_handed_a_dead_step_is_not_kept(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("forgiving")
    inline.drain()
    assert run.status() == "waiting"
    # It went on past refuse#1's error; a replayed dead letter would make that step
    # pending again, and only a replay from the top sees that.
    assert not live.RUNS.holds(run.id)
    client.signal(run.id, "go", True)
    inline.drain()
    assert run.wait(timeout=5) == "caught refuse#1"


def test_a_parked_workflow_is_resumed_only_for_its_own_run(
    client: Fleet, inline: InlineBroker, tmp_path: Path
) -> None:
    """Parked workflows are kept by run id; a run of the same id in another store (or
    the id enqueued again once retention deleted its run) is another run, whose advance
    replays its own workflow (fails without ``Live.fits``: the parked workflow went on
    over the other run's history)."""
    run = client.enqueue("counted", 3, run_id="twin")
    inline.step()  # its first advance records nop#1 and parks
    assert live.RUNS.holds("twin")
    folder = tmp_path / "elsewhere"
    other = flows.fleet.with_settings(
        Settings(database_url=f"sqlite:///{folder}.db", broker_url=f"filesystem:///{folder}-broker")
    )
    other.upgrade_schema()
    elsewhere = InlineBroker(other)
    twin = other.enqueue("counted", 5, run_id="twin")
    elsewhere.drain()
    assert twin.wait(timeout=5) == sum(range(5))
    inline.drain()
    assert run.wait(timeout=5) == sum(range(3))
    other.runtime.db.dispose()


def test_an_advance_on_another_thread_replays_from_the_top(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("counted_approval")
    inline.drain()
    assert run.status() == "waiting"
    assert live.RUNS.holds(run.id)
    client.signal(run.id, "approval", {"approved": True})
    # A greenlet resumes only on its own thread: another thread's advance replays.
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            inline.drain()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=drain)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and errors == []
    assert run.wait(timeout=5) == {"approved": True}
    assert [s.id for s in run.steps()] == ["work#1", "work#2"]
    assert flows.ENTERED[run.id] == 2, "once on each thread"


def _on_thread(fn: Any) -> int:
    """Run ``fn`` on a new thread; its ident."""
    idents: list[int] = []
    errors: list[BaseException] = []

    def body() -> None:
        idents.append(threading.get_ident())
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and errors == [], errors
    return idents[0]


def test_a_dead_threads_parked_workflow_is_not_resumed_by_its_ident_s_next_owner(
    client: Fleet, inline: InlineBroker
) -> None:
    """A thread's ident is reused once it has ended; its greenlets are not resumable on
    the new thread (fails without ``Live.bind``: the run failed with "parent cannot be
    on a different thread")."""
    run = client.enqueue("counted_approval")
    first = _on_thread(inline.drain)
    assert run.status() == "waiting"
    client.signal(run.id, "approval", {"approved": True})
    # CPython hands a new thread the ident of one that ended (if no other thread of the
    # process took it first): drain on the first new thread that has it.
    drained: list[int] = []

    def drain_if_reused() -> None:
        if threading.get_ident() == first:
            inline.drain()
            drained.append(first)

    for _ in range(50):
        _on_thread(drain_if_reused)
        if drained:
            break
    else:  # pragma: no cover - depends on the platform's thread ids
        pytest.skip("no new thread was given the ended thread's ident")
    assert run.wait(timeout=5) == {"approved": True}
    assert flows.ENTERED[run.id] == 2
