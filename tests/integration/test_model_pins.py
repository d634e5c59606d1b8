"""The model pinned per run, enforced where the call is made: fleet.llm fills the pin in
and refuses another model before the provider is asked, on a real worker. The refused
step is dead-lettered at once in one line; the run's spend still counts every attempt."""

from __future__ import annotations

import pytest

from fleet import Fleet, RunFailed
from tests.flows import PINNED_MODEL
from tests.harness import Backend, Cluster, executions, starts

REFUSAL = (
    "request for model 'gpt-x' refused: run {run} is pinned to 'example-model-2026-10'"
    " (a change of model is a new workflow version)"
)
TURN_COST = 7 * 0.001 + 3 * 0.002


def _provider_calls(backend: Backend, run_id: str) -> list[tuple[str, str | None]]:
    return [
        (e["step"], e["model"])
        for e in executions(backend, run_id)
        if e["event"] == "provider-call"
    ]


def test_a_request_for_another_model_than_the_pin_fails_the_step_in_one_line(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("pinned_chat", "gpt-x")
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    refusal = REFUSAL.format(run=run.id)
    assert refusal in str(failed.value)
    assert run.status() == "failed"

    # Dead-lettered at once: NonRetryable, one attempt of the three the policy allows.
    steps = {s.id: s for s in run.steps()}
    assert (steps["pinned_turn#1"].status, steps["pinned_turn#1"].attempts) == ("done", 1)
    assert (steps["pinned_turn#2"].status, steps["pinned_turn#2"].attempts) == ("dead", 1)
    assert starts(backend, run.id) == {"pinned_turn#1": 1, "pinned_turn#2": 1}
    [letter] = client.dead_letters(run_id=run.id)
    assert (letter.step_id, letter.attempts) == ("pinned_turn#2", 1)
    assert letter.error == f"NonRetryable: {refusal}"
    assert "\n" not in letter.error

    # The step saw the run's pins; the pin was filled in; the refused request never
    # reached the provider.
    first_start = next(e for e in executions(backend, run.id) if e["event"] == "start")
    assert first_start["pins"] == {"model": PINNED_MODEL}
    assert _provider_calls(backend, run.id) == [
        ("pinned_turn#1", PINNED_MODEL),
        ("pinned_turn#2", PINNED_MODEL),
    ]

    # Spend counts every attempt, the refused one included (its call before the refusal).
    usage = run.usage()
    assert (usage["calls"], usage["input_tokens"], usage["output_tokens"]) == (2, 14, 6)
    assert usage["cost"] == pytest.approx(2 * TURN_COST)
    attempts = {a.step_id: a for a in client.runtime.queries.attempts(run.id)}
    assert set(attempts) == {"pinned_turn#1", "pinned_turn#2"}
    refused = attempts["pinned_turn#2"]
    assert (refused.model, refused.calls, refused.input_tokens) == (PINNED_MODEL, 1, 7)
    assert refused.error is not None and refusal in refused.error


def test_requests_naming_the_pin_or_no_model_go_through(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("pinned_chat", PINNED_MODEL)
    assert run.wait(timeout=60) == [[PINNED_MODEL], [PINNED_MODEL, PINNED_MODEL]]
    assert client.dead_letters(run_id=run.id) == []
    assert [m for _, m in _provider_calls(backend, run.id)] == [PINNED_MODEL] * 3
    usage = run.usage()
    assert (usage["calls"], usage["tokens"]) == (3, 30)
    assert usage["cost"] == pytest.approx(3 * TURN_COST)
