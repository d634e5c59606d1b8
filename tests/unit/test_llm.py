"""fleet.llm with fake providers: usage recorded from each response, the run's pinned
model filled in or enforced before the provider is called. No services."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import pytest

from fleet import NonRetryable
from fleet.llm import recording

PIN = "example-model-2026-10"


@dataclass
class Sink:
    """A usage sink shaped like a StepContext: run id, pins, record_usage."""

    pins: dict[str, Any] = field(default_factory=dict)
    run_id: str = "run-7"
    usage: list[dict[str, Any]] = field(default_factory=list)

    def record_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None:
        self.usage.append({"model": model, "in": input_tokens, "out": output_tokens, "cost": cost})


class BareSink:
    """A sink with record_usage only (no pins, no run id): nothing is enforced."""

    def __init__(self) -> None:
        self.models: list[str | None] = []

    def record_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None:
        self.models.append(model)


def _reply(model: str | None) -> dict[str, Any]:
    return {
        "model": model,
        "choices": [{"message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }


class _FakeCompletions:
    def __init__(self, answer_as: str | None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answer_as = answer_as

    def create(self, **kwargs: Any) -> dict[str, Any]:
        self.requests.append(kwargs)
        return _reply(self.answer_as or kwargs.get("model"))


class FakeClient:
    """An OpenAI-compatible client: ``chat.completions.create`` returns a dict; it
    answers as ``answer_as`` when given (a provider's dated model name)."""

    def __init__(self, answer_as: str | None = None) -> None:
        self.completions = _FakeCompletions(answer_as)
        self.chat = self
        self.models = "the client's other attributes pass through"


class _AsyncCompletions:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def create(self, **kwargs: Any) -> dict[str, Any]:
        self.requests.append(kwargs)
        return _reply(kwargs.get("model"))


class FakeAsyncClient:
    def __init__(self) -> None:
        self.completions = _AsyncCompletions()
        self.chat = self


MESSAGES = [{"role": "user", "content": "hi"}]


def test_usage_is_recorded_with_prices_and_the_response_passes_through() -> None:
    sink, client = Sink(), FakeClient()
    llm = recording(client, sink, prices={"m": (0.5, 2.0)})
    reply = llm.chat.completions.create(model="m", messages=MESSAGES)
    assert reply["choices"][0]["message"]["content"] == "ok"
    assert sink.usage == [{"model": "m", "in": 7, "out": 3, "cost": 7 * 0.5 + 3 * 2.0}]
    assert llm.models == client.models


def test_no_pin_passes_the_request_through_unchanged() -> None:
    sink, client = Sink(), FakeClient()
    recording(client, sink).chat.completions.create(model="any-model", messages=MESSAGES)
    recording(client, sink).chat.completions.create(messages=MESSAGES)
    assert client.completions.requests == [
        {"model": "any-model", "messages": MESSAGES},
        {"messages": MESSAGES},
    ]
    assert [u["model"] for u in sink.usage] == ["any-model", None]


def test_a_sink_without_pins_enforces_nothing() -> None:
    sink, client = BareSink(), FakeClient()
    recording(client, sink).chat.completions.create(model="other", messages=MESSAGES)
    assert sink.models == ["other"]


def test_the_pinned_model_is_filled_in_when_the_request_names_none() -> None:
    sink, client = Sink(pins={"model": PIN}), FakeClient()
    llm = recording(client, sink)
    llm.chat.completions.create(messages=MESSAGES)
    llm.chat.completions.create(model=None, messages=MESSAGES)
    llm.chat.completions.create(model=PIN, messages=MESSAGES)
    assert [r["model"] for r in client.completions.requests] == [PIN, PIN, PIN]
    assert [u["model"] for u in sink.usage] == [PIN, PIN, PIN]


def test_another_model_than_the_pin_is_refused_in_one_line_before_the_call() -> None:
    sink, client = Sink(pins={"model": PIN}), FakeClient()
    llm = recording(client, sink)
    with pytest.raises(NonRetryable) as refused:
        llm.chat.completions.create(model="gpt-x", messages=MESSAGES)
    message = str(refused.value)
    assert message == (
        f"request for model 'gpt-x' refused: run run-7 is pinned to '{PIN}'"
        " (a change of model is a new workflow version)"
    )
    assert "\n" not in message
    assert client.completions.requests == [], "the provider was never called"
    assert sink.usage == [], "nothing was spent, nothing recorded"


def test_a_dated_model_in_the_response_is_not_refused_and_is_what_is_recorded() -> None:
    sink, client = Sink(pins={"model": "gpt-4o"}), FakeClient(answer_as="gpt-4o-2024-08-06")
    prices = {"gpt-4o-2024-08-06": (1.0, 1.0)}
    reply = recording(client, sink, prices).chat.completions.create(messages=MESSAGES)
    assert reply["model"] == "gpt-4o-2024-08-06"
    assert client.completions.requests[0]["model"] == "gpt-4o"
    assert sink.usage == [{"model": "gpt-4o-2024-08-06", "in": 7, "out": 3, "cost": 10.0}]


def test_an_async_client_is_pinned_and_recorded_once_awaited() -> None:
    sink, client = Sink(pins={"model": PIN}), FakeAsyncClient()
    llm = recording(client, sink)

    async def calls() -> Any:
        reply = await llm.chat.completions.create(messages=MESSAGES)
        with pytest.raises(NonRetryable, match="'gpt-x' refused"):
            await llm.chat.completions.create(model="gpt-x", messages=MESSAGES)
        return reply

    reply = asyncio.run(calls())
    assert reply["model"] == PIN
    assert [r["model"] for r in client.completions.requests] == [PIN]
    assert sink.usage == [{"model": PIN, "in": 7, "out": 3, "cost": 0.0}]


def test_the_official_async_client_is_pinned_and_recorded() -> None:
    """AsyncOpenAI's create is not seen as a coroutine function (a decorator hides it);
    its awaitable result is what tells. Its HTTP goes to a handler in this process."""
    openai = pytest.importorskip("openai")
    # The client's HTTP library: httpx2 in the newest releases, httpx before.
    httpx = pytest.importorskip("httpx2" if find_spec("httpx2") else "httpx")
    sent: list[dict[str, Any]] = []

    def provider(request: Any) -> Any:
        body = json.loads(request.content)
        sent.append(body)
        reply = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"] + "-2026-10-01",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "ok"},
                }
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16},
        }
        return httpx.Response(200, json=reply)

    async def calls(sink: Sink) -> str:
        http = httpx.AsyncClient(transport=httpx.MockTransport(provider))
        client = openai.AsyncOpenAI(
            api_key="fake", base_url="http://provider.invalid/v1", http_client=http
        )
        llm = recording(client, sink)
        reply = await llm.chat.completions.create(messages=MESSAGES)
        with pytest.raises(NonRetryable, match="pinned to 'pinned-model'"):
            await llm.chat.completions.create(model="gpt-x", messages=MESSAGES)
        await http.aclose()
        return str(reply.choices[0].message.content)

    sink = Sink(pins={"model": "pinned-model"})
    assert asyncio.run(calls(sink)) == "ok"
    assert [b["model"] for b in sent] == ["pinned-model"]
    assert sink.usage == [{"model": "pinned-model-2026-10-01", "in": 11, "out": 5, "cost": 0.0}]


def test_an_async_client_in_an_async_step_records_off_the_loop() -> None:
    """A sink with ``arecord_usage`` (an async def step's context) has it awaited: the
    store write goes to a thread, never the sync call on the loop every step shares."""

    class AsyncSink(Sink):
        def record_usage(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the sync record_usage blocked the loop")

        async def arecord_usage(self, **kwargs: Any) -> None:
            await asyncio.sleep(0)
            Sink.record_usage(self, **kwargs)

    sink, client = AsyncSink(pins={"model": PIN}), FakeAsyncClient()
    llm = recording(client, sink)
    asyncio.run(llm.chat.completions.create(messages=MESSAGES))
    assert sink.usage == [{"model": PIN, "in": 7, "out": 3, "cost": 0.0}]
