"""Issue 13, items 3 and 5 (engine side): user JSON is never read as a secret marker; a
recorded payload that cannot be loaded fails its run or dead-letters its step once;
a secret's value quoted in an error is masked in everything fleet records or logs.
Real workers, both backends."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import update

from fleet import Fleet, RunFailed
from fleet.secrets import MASK
from fleet.store.schema import steps
from tests.harness import Backend, Cluster, everything_in_the_store, executions, poll, starts

# A quote and a backslash, so repr() and JSON spell it differently from the raw value.
SECRET = "s3cr3t'value\\that-must-not-leak-ü"
SPELLINGS = {SECRET, repr(SECRET)[1:-1], json.dumps(SECRET)[1:-1]}


def _deep(levels: int) -> Any:
    value: Any = {"$$x": 1, "$y": ["$z", {"$fleet_secret": "FLEET_DATABASE_URL"}]}
    for i in range(levels):
        value = {"$$x": i, "$y": [value, {"$": None, "$$": "$$"}], "plain": {"$fleet_secret": 1}}
    return value


HOSTILE = [
    {"$fleet_secret": "FLEET_DATABASE_URL"},
    {"$fleet_secret": "not a name"},
    {"$fleet_secret": None},
    _deep(40),
]


def _leaks(text: str) -> list[str]:
    return [s for s in SPELLINGS if s in text]


def test_arguments_holding_marker_keys_reach_the_workflow_and_step_unchanged(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    runs = [(value, client.enqueue("echo_back", value, **{"$k": value})) for value in HOSTILE]
    for value, run in runs:
        sent = {"value": value, "extra": {"$k": value}}
        assert run.wait(timeout=60) == {"workflow": sent, "step": sent}


def test_a_signal_payload_holding_marker_keys_arrives_unchanged(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("inbox", len(HOSTILE))
    for payload in HOSTILE:
        client.signal(run.id, "msg", payload)
    assert run.wait(timeout=60) == HOSTILE


@pytest.mark.parametrize(
    "args, why",
    [
        ('{"args":[{"$fleet_secret":"not a name"}],"kwargs":{}}', "is not an environment"),
        ('{"args":[1,', "is not valid JSON"),
        ("[1, 2]", "is not an args and kwargs record"),
    ],
)
def test_run_arguments_that_cannot_be_loaded_fail_the_run_in_one_line(
    backend: Backend, client: Fleet, cluster: Cluster, args: str, why: str
) -> None:
    """A row written before markers were escaped, or a corrupt one: the run fails at
    once, instead of staying running while its advance is sent again and again."""
    cluster.worker("w1")
    wf = client.registry.workflow("echo_back")
    queue = wf.queue(client.settings.queue)
    ledger = client.runtime.ledger
    assert ledger.create_run("corrupt", wf.name, wf.version, "{}", args, queue)
    client.runtime.dispatcher.advance("corrupt", queue)
    with pytest.raises(RunFailed) as failed:
        client.run("corrupt").wait(timeout=60)
    error = failed.value.error or ""
    assert error.startswith("PayloadError: arguments of run corrupt cannot be loaded: ")
    assert why in error and "\n" not in error
    assert executions(backend, "corrupt") == []


def test_step_input_that_cannot_be_loaded_is_dead_lettered_at_once(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    """A corrupt input is a fact about the row: one dead letter, no retries."""
    cluster.worker("w1")
    run = client.enqueue("refusing")
    with pytest.raises(RunFailed):
        run.wait(timeout=60)
    (letter,) = client.dead_letters(run_id=run.id)
    with client.runtime.db.begin() as conn:
        conn.execute(
            update(steps)
            .where(steps.c.run_id == run.id, steps.c.step_id == "refuse#1")
            .values(input='{"args":["permission denied"')
        )
    client.replay(letter.id)
    with pytest.raises(RunFailed, match="PayloadError: input of step refuse#1 cannot be"):
        run.wait(timeout=60)
    (again,) = client.dead_letters(run_id=run.id)
    assert again.error_type == "PayloadError" and again.attempts == 1
    assert again.error_message.startswith("input of step refuse#1 cannot be loaded: ")
    assert "\n" not in again.error_message
    assert again.input is None, "listed and shown, though its input cannot be loaded"
    assert starts(backend, run.id)["refuse#1"] == 1, "the step body never ran again"


@pytest.mark.parametrize("how", ["message", "cause", "environ", "workflow", "later"])
def test_a_secret_quoted_in_an_error_is_masked_everywhere(
    backend: Backend, client: Fleet, cluster: Cluster, how: str
) -> None:
    """ "later": revealed in one advance, quoted in the next (a live run's workflow is
    resumed, not run again: the values it revealed are carried over)."""
    backend.extra_env["FLEET_TEST_SECRET"] = SECRET
    worker = cluster.worker("w1")
    run = client.enqueue("leaky_secret", how)
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    # "cause" quotes the value only in its traceback, which a run's error leaves out.
    assert (MASK in (failed.value.error or "")) is (how != "cause")
    letters = client.dead_letters(run_id=run.id)
    if how not in ("workflow", "later"):
        (letter,) = letters
        assert letter.attempts == 2 and MASK in letter.traceback
        assert MASK in (letter.error_message if how != "cause" else letter.traceback)
        assert [a.error for a in client.runtime.queries.attempts(run.id) if a.error]
        poll(lambda: backend.hook_calls(), 30, "the dead-letter hook")
        assert not _leaks(backend.hook_log_path.read_text())
    assert not _leaks(everything_in_the_store(client))
    assert "calling the API with" in worker.output() or how in ("workflow", "later")
    assert not _leaks(worker.output()), "nor in the worker's log lines"
