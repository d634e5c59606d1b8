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
from fleet.llm.sending import attempt_calls
from tests.provider import COMPLETION_TOKENS, PROMPT_TOKENS, TEXT, WORDS, model_answer

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


# --- streams and the Responses API, through the official client (issue 48, item 15) ------


def _official(sent: list[dict[str, Any]], asyncio_client: bool = False) -> Any:
    """The official client (sync or asyncio) whose HTTP goes to the stand-in model."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx2" if find_spec("httpx2") else "httpx")

    def provider(request: Any) -> Any:
        body = json.loads(request.content)
        sent.append(body)
        status, kind, data = model_answer(request.url.path, body)
        return httpx.Response(status, headers={"content-type": kind}, content=data)

    transport = httpx.MockTransport(provider)
    if asyncio_client:
        http = httpx.AsyncClient(transport=transport)
        return openai.AsyncOpenAI(api_key="-", base_url="http://model.invalid/v1", http_client=http)
    http = httpx.Client(transport=transport)
    return openai.OpenAI(api_key="-", base_url="http://model.invalid/v1", http_client=http)


SPENT = {"model": PIN, "in": PROMPT_TOKENS, "out": COMPLETION_TOKENS, "cost": 0.0}


def _texts(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_sync_stream_is_passed_on_unchanged_and_recorded_when_it_ends() -> None:
    sent: list[dict[str, Any]] = []
    sink = Sink(pins={"model": PIN})
    llm = recording(_official(sent), sink)
    with attempt_calls() as calls:
        stream = llm.chat.completions.create(messages=MESSAGES, stream=True)
        assert sink.usage == [], "nothing is known before the stream is read"
        chunks = list(stream)
    # The caller did not ask for usage: fleet asked, and kept the chunk it adds.
    assert _texts(chunks) == TEXT and all(c.choices for c in chunks)
    assert sent[0]["stream_options"] == {"include_usage": True} and sent[0]["model"] == PIN
    assert sink.usage == [SPENT], "recorded once, from the provider's count"
    assert calls.sent and not calls.uncounted and not calls.open
    stream.close()
    assert sink.usage == [SPENT], "closing an ended stream records nothing more"


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": False}])
def test_the_usage_chunk_is_passed_on_only_to_a_caller_who_asked(options: dict[str, Any]) -> None:
    sent: list[dict[str, Any]] = []
    sink = Sink()
    llm = recording(_official(sent), sink)
    with llm.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options=options
    ) as stream:
        chunks = list(stream)
    assert sent[0]["stream_options"] == {"include_usage": True}
    assert (chunks[-1].usage is not None) is options["include_usage"]
    assert [(u["in"], u["out"]) for u in sink.usage] == [(PROMPT_TOKENS, COMPLETION_TOKENS)]


def test_a_stream_closed_early_records_what_it_passed_on() -> None:
    """The provider's count comes last: closed before it, the output pieces passed on
    are recorded as output tokens, no input, and the attempt knows it was not counted."""
    sink = Sink()
    llm = recording(_official([]), sink)
    with attempt_calls() as calls:
        with llm.chat.completions.create(model="m", messages=MESSAGES, stream=True) as stream:
            first, second = next(stream), next(stream)  # the role, then a word
        assert (first.choices[0].delta.content, second.choices[0].delta.content) == ("", WORDS[0])
    assert [(u["in"], u["out"]) for u in sink.usage] == [(0, 1)]
    assert calls.uncounted


def test_a_stream_left_open_is_recorded_when_its_attempt_ends() -> None:
    sink = Sink()
    with attempt_calls() as calls:
        llm = recording(_official([]), sink)
        stream = llm.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        next(stream), next(stream), next(stream)
        assert sink.usage == [] and calls.open
        calls.finish()  # what the limits' gate does as the attempt ends
    assert [(u["in"], u["out"]) for u in sink.usage] == [(0, 2)]
    calls.finish()
    assert len(sink.usage) == 1, "recorded once"


def test_an_async_stream_is_recorded_when_it_ends_or_is_closed() -> None:
    sent: list[dict[str, Any]] = []
    sink = Sink(pins={"model": PIN})

    async def calls() -> str:
        llm = recording(_official(sent, asyncio_client=True), sink)
        text = ""
        async for chunk in await llm.chat.completions.create(messages=MESSAGES, stream=True):
            text += chunk.choices[0].delta.content or ""
        stream = await llm.chat.completions.create(messages=MESSAGES, stream=True)
        async with stream:
            await stream.__anext__()
        with pytest.raises(NonRetryable, match="pinned to"):
            await llm.chat.completions.create(model="gpt-x", messages=MESSAGES, stream=True)
        return text

    assert asyncio.run(calls()) == TEXT
    assert len(sent) == 2
    assert sink.usage == [SPENT, {**SPENT, "in": 0, "out": 0}]


def test_the_responses_api_is_pinned_and_recorded_whole_and_streamed() -> None:
    sent: list[dict[str, Any]] = []
    sink = Sink(pins={"model": PIN})
    llm = recording(_official(sent), sink, prices={PIN: (0.5, 2.0)})
    with attempt_calls() as calls:
        whole = llm.responses.create(input="hi")
        assert calls.sent
    assert whole.output_text == TEXT
    events = list(llm.responses.create(input="hi", stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == TEXT and events[-1].type == "response.completed"
    with pytest.raises(NonRetryable, match="pinned to"):
        llm.responses.create(model="gpt-x", input="hi")
    assert [b["model"] for b in sent] == [PIN, PIN]
    cost = PROMPT_TOKENS * 0.5 + COMPLETION_TOKENS * 2.0
    assert sink.usage == [{**SPENT, "cost": cost}] * 2


def test_the_responses_api_of_the_asyncio_client_is_recorded() -> None:
    sink = Sink()

    async def calls() -> list[str]:
        llm = recording(_official([], asyncio_client=True), sink)
        whole = await llm.responses.create(model="m", input="hi")
        kinds = [
            e.type async for e in await llm.responses.create(model="m", input="hi", stream=True)
        ]
        return [whole.output_text, kinds[-1]]

    assert asyncio.run(calls()) == [TEXT, "response.completed"]
    assert [(u["in"], u["out"]) for u in sink.usage] == [(PROMPT_TOKENS, COMPLETION_TOKENS)] * 2


@pytest.mark.parametrize(
    "form",
    [
        lambda llm: llm.embeddings,
        lambda llm: llm.completions,
        lambda llm: llm.beta,
        lambda llm: llm.with_raw_response,
        lambda llm: llm.chat.completions.stream,
        lambda llm: llm.chat.completions.with_streaming_response,
        lambda llm: llm.responses.stream,
        lambda llm: llm.responses.with_raw_response,
        lambda llm: llm.responses.create(model="m", input="hi", background=True),
    ],
)
def test_a_form_fleet_cannot_record_is_refused_in_one_line(form: Any) -> None:
    sent: list[dict[str, Any]] = []
    with attempt_calls() as calls:
        llm = recording(_official(sent), Sink())
        with pytest.raises(NonRetryable, match="fleet.llm.recording does not record") as refused:
            form(llm)
    assert "\n" not in str(refused.value)
    assert sent == [] and not calls.sent


def test_with_options_gives_a_recording_client_again() -> None:
    sink = Sink()
    llm = recording(_official([]), sink).with_options(timeout=5.0)
    llm.chat.completions.create(model="m", messages=MESSAGES)
    assert [(u["in"], u["out"]) for u in sink.usage] == [(PROMPT_TOKENS, COMPLETION_TOKENS)]


def test_a_refused_pin_sends_nothing_and_a_failed_request_was_sent() -> None:
    """What the limits' gate settles by: a request refused before the call was not sent;
    one the provider answered with an error was."""
    sink = Sink(pins={"model": PIN})
    with attempt_calls() as calls:
        llm = recording(_official([]), sink)
        with pytest.raises(NonRetryable):
            llm.chat.completions.create(model="gpt-x", messages=MESSAGES)
        assert not calls.sent
    with attempt_calls() as calls:
        llm = recording(_official([]), Sink())
        with pytest.raises(Exception, match="broken"):
            llm.chat.completions.create(model="broken", messages=MESSAGES)
        assert calls.sent
