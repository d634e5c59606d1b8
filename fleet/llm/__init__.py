"""Usage recorded automatically from an OpenAI-compatible client (optional extra
``fleet[openai]``; any client with ``chat.completions.create`` returning a ``usage``
with ``prompt_tokens`` and ``completion_tokens`` works, the official one included).

    @fleet.step
    def summarise(ctx, text: str) -> str:
        llm = recording(OpenAI(base_url=..., api_key=...), ctx, prices=PRICES)
        reply = llm.chat.completions.create(model="gpt-x", messages=[...])
        return reply.choices[0].message.content

Recorded: ``chat.completions.create`` and ``parse``, ``responses.create``, ``parse`` and
``compact``, each answered whole or streamed (``stream=True``: the stream is passed on
item by item and recorded when it ends, ``fleet/llm/streams.py``), with the sync and the
asyncio client (``AsyncOpenAI``: ``await`` the call, ``async for`` the stream). Forms
whose spend fleet would not see (the legacy ``completions``, ``embeddings``, ``audio``,
``images``, ``videos``, ``realtime``, ``live``, ``beta``, raw responses, the ``stream``
helpers, background responses) are refused in one line (``NonRetryable``) rather than
passed through unrecorded; ``with_options`` and ``copy`` give a recording client again.

The run's pinned model is enforced here, where the call is made: when the run pins a
``model`` (``ctx.pins``, from the workflow's ``pins=``), a request naming no model is
sent with the pin, and a request naming another model is refused before it reaches
the client with ``NonRetryable`` (the step is dead-lettered at once, its spend so far
still counted): resuming a history into another model is not a resume, and a
deliberate change of model is a new workflow version, on its own queue. Only the
request is checked; a provider answering with a dated name ("gpt-4o-2024-08-06" for
"gpt-4o") is fine, and usage is recorded under the name the response gives.

A provider's 429 that says when to come back (``Retry-After`` or ``retry-after-ms``)
is raised as ``Retry(delay=that, limit=...)``, naming the step's first limit of
requests or tokens per minute if it has one: that limit is closed for every worker
for the delay (the attempt counts against the step's cap as any retry does).
"""

from __future__ import annotations

from typing import Any

from fleet.llm.endpoints import Chat, ChatCompletions, Responses
from fleet.llm.sending import Prices, Recorder, UsageSink, refusal

__all__ = ["Prices", "RecordingClient", "UsageSink", "recording"]

# The client's parts that spend without fleet seeing it: refused, not passed through.
_UNRECORDED = (
    "completions",
    "embeddings",
    "audio",
    "images",
    "videos",
    "realtime",
    "live",
    "beta",
    "with_raw_response",
    "with_streaming_response",
)


class RecordingClient:
    """The client, with every model call's usage recorded on the step attempt and its
    model held to the run's pin."""

    def __init__(self, client: Any, ctx: UsageSink, prices: Prices | None = None) -> None:
        self._client, self._ctx, self._prices = client, ctx, prices or {}
        self._rec = Recorder(ctx, self._prices)
        self.chat = Chat(ChatCompletions(client.chat.completions, self._rec))

    @property
    def responses(self) -> Responses:
        return Responses(self._client.responses, self._rec)

    def with_options(self, **options: Any) -> RecordingClient:
        return RecordingClient(self._client.with_options(**options), self._ctx, self._prices)

    def copy(self, **options: Any) -> RecordingClient:
        return RecordingClient(self._client.copy(**options), self._ctx, self._prices)

    def __getattr__(self, name: str) -> Any:
        if name in _UNRECORDED:
            raise refusal(
                f"client.{name}",
                "call the unwrapped client and report what it spent with ctx.record_usage",
            )
        return getattr(self._client, name)


def recording(client: Any, ctx: UsageSink, prices: Prices | None = None) -> RecordingClient:
    """``client`` with usage recorded on ``ctx`` and the run's pinned model enforced."""
    return RecordingClient(client, ctx, prices)
