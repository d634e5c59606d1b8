"""fleet.llm records usage from an OpenAI-compatible client's responses: the official
client against the stand-in model on loopback (``tests/provider.py``), run by real
workers. Every form a step may call the model in, whole or streamed, counts in the
run's usage, its budget and its limit's tokens (issue 48, item 15); an attempt that
never reached the provider gives its reservation back (item 16)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fleet import Fleet
from fleet.worker import gate
from tests.harness import Backend, Cluster, poll, wait_until
from tests.provider import COMPLETION_TOKENS, PROMPT_TOKENS, TEXT, serving_model

APP = "tests.llm_flows"
CALL = PROMPT_TOKENS + COMPLETION_TOKENS


@pytest.fixture
def model(backend: Backend) -> Iterator[list[dict[str, Any]]]:
    """The stand-in model, for the workers to call; the requests it was sent."""
    with serving_model() as (url, requests):
        backend.extra_env.update(FLEET_TEST_LLM_URL=url, NO_PROXY="127.0.0.1,localhost")
        yield requests


@pytest.fixture
def mclient(backend: Backend) -> Iterator[Fleet]:
    from tests import llm_flows

    client = llm_flows.fleet.with_settings(backend.settings())
    client.upgrade_schema()
    yield client
    client.runtime.db.dispose()


def test_usage_is_recorded_from_the_responses(
    backend: Backend, client: Fleet, cluster: Cluster, model: list[dict[str, Any]]
) -> None:
    cluster.worker("w1")
    run = client.enqueue("asker", ["hello", "again"])
    assert run.wait(timeout=60) == [TEXT, TEXT]
    usage = run.usage()
    assert (usage["calls"], usage["input_tokens"], usage["output_tokens"]) == (
        2,
        2 * PROMPT_TOKENS,
        2 * COMPLETION_TOKENS,
    )
    assert usage["cost"] == pytest.approx(2 * (PROMPT_TOKENS * 1e-6 + COMPLETION_TOKENS * 2e-6))
    models = {a.model for a in client.runtime.queries.attempts(run.id)}
    assert models == {"stub-model"}


def _limit_use(client: Fleet, expected: tuple[int, int]) -> tuple[int, int]:
    """The limit "model"'s (requests, tokens) once it shows ``expected`` (the last step's
    room is given back just after its run parks), or as it stands at the deadline."""

    def use() -> tuple[int, int]:
        found = {u.key: u for u in gate.uses(client.runtime)}["model"]
        return found.requests, found.tokens

    try:
        return wait_until(lambda: use() if use() == expected else None, 15, "the limit's use")
    except TimeoutError:
        return use()


# Per form: what one call records (input, output tokens) and keeps in the tokens limit.
# A stream closed early records the one word it passed on, not the provider's count,
# which never came: its reservation (1000) is kept in the limit.
FORMS = {
    "stream": (PROMPT_TOKENS, COMPLETION_TOKENS, CALL),
    "async-stream": (PROMPT_TOKENS, COMPLETION_TOKENS, CALL),
    "early-close": (0, 1, 1000),
    "responses": (PROMPT_TOKENS, COMPLETION_TOKENS, CALL),
    "responses-stream": (PROMPT_TOKENS, COMPLETION_TOKENS, CALL),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_of_model_call_is_recorded_budgeted_and_limited(
    backend: Backend,
    mclient: Fleet,
    cluster: Cluster,
    model: list[dict[str, Any]],
    form: str,
) -> None:
    """Three calls under a budget the second reaches: the run parks before the third,
    its usage is the two calls' and so is the tokens limit's use."""
    tin, tout, kept = FORMS[form]
    cluster.worker("w1", app=APP)
    run = mclient.enqueue("calls", form, 3, budget={"tokens": tin + tout + 1})
    ended = ("needs_decision", "succeeded", "failed")
    status = poll(lambda: run.status() in ended and run.status(), 60, "the run to stop")
    usage = run.usage()
    assert (usage["calls"], usage["input_tokens"], usage["output_tokens"]) == (
        2,
        2 * tin,
        2 * tout,
    )
    assert status == "needs_decision", "parked on its budget before the third call"
    assert len(model) == 2, "the third call was never made"
    if "responses" not in form:
        assert all(r["stream_options"] == {"include_usage": True} for r in model)
    assert _limit_use(mclient, (2, 2 * kept)) == (2, 2 * kept)


def test_attempts_that_never_reached_the_provider_give_their_reservation_back(
    backend: Backend, mclient: Fleet, cluster: Cluster, model: list[dict[str, Any]]
) -> None:
    """Three attempts fail before the call, a fourth at the provider (a 500), the fifth
    spends 85 tokens: the limit holds the two requests made and the 85 tokens, not five
    reservations of 1000."""
    cluster.worker("w1", app=APP)
    cluster.sweeper()
    run = mclient.enqueue("flaky", 3)
    assert run.wait(timeout=60) == TEXT
    assert [r["model"] for r in model] == ["broken", "stub"]
    assert run.usage()["tokens"] == CALL
    assert _limit_use(mclient, (2, CALL)) == (2, CALL)
