"""``fleet.testing.InlineBroker`` as a user's own test uses it: a workflow enqueued and
drained in this process on an SQLite store, with no broker and no worker.

The Fleet's broker is a Redis port nobody listens on: had the InlineBroker not taken
the dispatcher's place, every wake-up would fail to send and no run would finish.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import Fleet, RetryPolicy, Settings, StepContext, WorkflowContext
from fleet.testing import InlineBroker
from fleet.worker.dispatch import CelerySender, Message

app = Fleet("users-app", settings=Settings(broker_url="redis://127.0.0.1:1/0"))
tries: dict[str, int] = {}


# No back-off: a retry is due at once (see fleet.testing on retry delays in tests).
@app.step(retry=RetryPolicy(max_attempts=3, initial_delay=0, jitter=False))
def shout(ctx: StepContext, word: str) -> str:
    tries[word] = tries.get(word, 0) + 1
    if word == "flaky" and ctx.attempt == 1:
        raise ConnectionError("the first attempt fails")
    return word.upper()


@app.workflow
def greet(wf: WorkflowContext, words: list[str]) -> str:
    return " ".join(wf.step(shout, w) for w in words)


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    tries.clear()
    return app.with_settings(
        Settings(database_url=f"sqlite:///{tmp_path}/app.db", broker_url=app.settings.broker_url)
    )


def test_a_run_goes_end_to_end_in_this_process(fleet: Fleet) -> None:
    broker = InlineBroker(fleet)
    run = fleet.enqueue("greet", ["hello", "flaky", "world"])
    assert broker.sent == [("fleet.advance", [run.id])]
    broker.drain()
    assert run.wait(timeout=0) == "HELLO FLAKY WORLD"
    assert broker.sent == []
    assert tries == {"hello": 1, "flaky": 2, "world": 1}
    assert [(s.id, s.status, s.attempts) for s in run.steps()] == [
        ("shout#1", "done", 1),
        ("shout#2", "done", 2),
        ("shout#3", "done", 1),
    ]


def test_step_delivers_one_message_at_a_time(fleet: Fleet) -> None:
    broker = InlineBroker(fleet)
    run = fleet.enqueue("greet", ["one"])
    broker.step()  # the run's first replay records its first step and sends it
    assert broker.sent == [("fleet.execute", [run.id, "shout#1"])]
    assert run.status() == "running"
    broker.drain(until=lambda: run.status() == "succeeded")
    assert run.wait(timeout=0) == "ONE"


def test_drain_stops_at_its_limit(fleet: Fleet) -> None:
    broker = InlineBroker(fleet)
    fleet.enqueue("greet", ["a", "b", "c"])
    with pytest.raises(AssertionError, match="messages kept coming"):
        broker.drain(limit=2)


def test_the_fleet_sends_through_celery_until_told_otherwise(fleet: Fleet) -> None:
    celery = fleet.runtime.dispatcher.sender
    assert isinstance(celery, CelerySender) and celery.celery is fleet.celery
    broker = InlineBroker(fleet)
    assert fleet.runtime.dispatcher.sender is broker
    assert fleet.runtime.dispatcher.use(celery) is broker


def test_a_failed_send_is_reported_not_raised(fleet: Fleet) -> None:
    class Down:
        def send(self, message: Message) -> None:
            raise ConnectionError("broker down")

    fleet.runtime.dispatcher.use(Down())
    assert fleet.runtime.dispatcher.advance("some-run", "fleet") is False
