"""The two ways a recording client calls a model: ``chat.completions`` (``create`` and
``parse``) and ``responses`` (``create``, ``parse`` and ``compact``), each answered in
one piece or, with ``stream=True``, as a stream recorded when it ends
(``fleet/llm/streams.py``). Their other spending forms (the ``stream`` helpers, raw
responses, background responses, live connections) are refused in one line; the rest
(retrieve, list, delete, ...) is passed through.

A streamed chat completion asks for the provider's count of its tokens
(``stream_options={"include_usage": True}``, merged into the caller's options, whatever
they said): the usage-only chunk that adds is passed on only if the caller asked for it
(``include_usage=True``), so the caller sees the stream it asked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from fleet.llm.sending import Recorder, call, count, field, refusal
from fleet.llm.streams import Reader, RecordedAsyncStream, RecordedStream, Seen


class _Endpoint:
    """A group of model calls: sent through the recorder, answered whole or streamed."""

    # What is refused, and what to use instead.
    refused: Mapping[str, str] = {
        "stream": "call create(stream=True)",
        "with_raw_response": "call create (or create(stream=True))",
        "with_streaming_response": "call create(stream=True)",
    }
    path = ""

    def __init__(self, inner: Any, rec: Recorder) -> None:
        self._inner, self._rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        if name in self.refused:
            raise refusal(f"{self.path}.{name}", self.refused[name])
        return getattr(self._inner, name)

    def _prepared(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Reader | None]:
        """The request to send, and how to read its stream (None: not streamed)."""
        raise NotImplementedError

    def _usage(self, answer: Any) -> tuple[int, int]:
        raise NotImplementedError

    def _send(self, method: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        kwargs, reader = self._prepared(kwargs)
        kwargs = self._rec.sending(kwargs)
        answer = call(method, kwargs)
        if inspect.isawaitable(answer):
            return self._later(answer, kwargs, reader)
        if reader is not None:
            return RecordedStream(answer, reader, self._rec, kwargs.get("model"))
        self._rec.record(self._model(answer, kwargs), *self._usage(answer))
        return answer

    async def _later(self, pending: Any, kwargs: dict[str, Any], reader: Reader | None) -> Any:
        answer = await pending
        if reader is not None:
            return RecordedAsyncStream(answer, reader, self._rec, kwargs.get("model"))
        await self._rec.arecord(self._model(answer, kwargs), *self._usage(answer))
        return answer

    @staticmethod
    def _model(answer: Any, kwargs: dict[str, Any]) -> Any:
        """The model the provider answered as (a dated name, say), else the one asked."""
        return field(answer, "model") or kwargs.get("model")


class _ChatReader:
    """A chat completion's chunks: usage from the chunk carrying it (the last, with
    ``include_usage``), a piece of output for each delta with content or a tool call."""

    def __init__(self, show_usage: bool) -> None:
        self.show_usage = show_usage

    def read(self, item: Any, seen: Seen) -> bool:
        seen.model = field(item, "model") or seen.model
        usage = field(item, "usage")
        if usage is not None:
            seen.usage = (count(usage, "prompt_tokens"), count(usage, "completion_tokens"))
        choices = field(item, "choices") or []
        for choice in choices:
            delta = field(choice, "delta")
            if field(delta, "content") or field(delta, "tool_calls") or field(delta, "refusal"):
                seen.pieces += 1
        return bool(choices) or usage is None or self.show_usage


class ChatCompletions(_Endpoint):
    """``chat.completions``: ``create`` (whole or streamed) and ``parse`` recorded."""

    path = "chat.completions"

    def create(self, **kwargs: Any) -> Any:
        return self._send(self._inner.create, kwargs)

    def parse(self, **kwargs: Any) -> Any:
        return self._send(self._inner.parse, kwargs)

    def _prepared(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Reader | None]:
        if kwargs.get("stream") is not True:
            return kwargs, None
        options = kwargs.get("stream_options")
        options = dict(options) if isinstance(options, Mapping) else {}
        asked = options.get("include_usage") is True
        kwargs = {**kwargs, "stream_options": {**options, "include_usage": True}}
        return kwargs, _ChatReader(show_usage=asked)

    def _usage(self, answer: Any) -> tuple[int, int]:
        usage = field(answer, "usage")
        return count(usage, "prompt_tokens"), count(usage, "completion_tokens")


class Chat:
    def __init__(self, completions: ChatCompletions) -> None:
        self.completions = completions


class _ResponsesReader:
    """A response's events: usage from the final response (``response.completed``, or
    ``response.incomplete``/``response.failed``), a piece of output for each delta."""

    def read(self, item: Any, seen: Seen) -> bool:
        response = field(item, "response")
        if response is not None:
            seen.model = field(response, "model") or seen.model
            usage = field(response, "usage")
            if usage is not None:
                seen.usage = (count(usage, "input_tokens"), count(usage, "output_tokens"))
        if str(field(item, "type") or "").endswith(".delta"):
            seen.pieces += 1
        return True


class Responses(_Endpoint):
    """``responses``: ``create`` (whole or streamed), ``parse`` and ``compact`` recorded."""

    path = "responses"
    refused = {
        **_Endpoint.refused,
        "connect": "call create (a live connection's spend is not seen by fleet)",
    }

    def create(self, **kwargs: Any) -> Any:
        return self._send(self._inner.create, kwargs)

    def parse(self, **kwargs: Any) -> Any:
        return self._send(self._inner.parse, kwargs)

    def compact(self, **kwargs: Any) -> Any:
        return self._send(self._inner.compact, kwargs)

    def _prepared(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Reader | None]:
        if kwargs.get("background") is True:
            raise refusal(
                "responses.create(background=True)", "its spend comes after the step; call create"
            )
        return kwargs, (_ResponsesReader() if kwargs.get("stream") is True else None)

    def _usage(self, answer: Any) -> tuple[int, int]:
        usage = field(answer, "usage")
        return count(usage, "input_tokens"), count(usage, "output_tokens")
