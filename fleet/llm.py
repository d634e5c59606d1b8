"""Usage recorded automatically from an OpenAI-compatible client (optional extra
``fleet[openai]``; any client with ``chat.completions.create`` returning a ``usage``
with ``prompt_tokens`` and ``completion_tokens`` works, the official one included).

    @fleet.step
    def summarise(ctx, text: str) -> str:
        llm = recording(OpenAI(base_url=..., api_key=...), ctx, prices=PRICES)
        reply = llm.chat.completions.create(model="gpt-x", messages=[...])
        return reply.choices[0].message.content

The run's pinned model is enforced here, where the call is made: when the run pins a
``model`` (``ctx.pins``, from the workflow's ``pins=``), a request naming no model is
sent with the pin, and a request naming another model is refused before it reaches
the client with ``NonRetryable`` (the step is dead-lettered at once, its spend so far
still counted): resuming a history into another model is not a resume, and a
deliberate change of model is a new workflow version, on its own queue. Only the
request is checked; a provider answering with a dated name ("gpt-4o-2024-08-06" for
"gpt-4o") is fine, and usage is recorded under the name the response gives. An
asyncio client (``AsyncOpenAI``) works the same way: ``await`` the call.

A provider's 429 that says when to come back (``Retry-After`` or ``retry-after-ms``)
is raised as ``Retry(delay=that, limit=...)``, naming the step's first limit of
requests or tokens per minute if it has one: that limit is closed for every worker
for the delay (the attempt counts against the step's cap as any retry does).
"""

from __future__ import annotations

import email.utils
import inspect
import time
from collections.abc import Mapping
from typing import Any, Protocol

from fleet.errors import NonRetryable, Retry
from fleet.limits import rated_limit


class UsageSink(Protocol):
    """Where usage goes (a ``StepContext``). A sink may also have ``pins`` (the run's
    pins) and ``run_id``; without ``pins`` no model is enforced."""

    def record_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None: ...


# Prices per token: {"model": (input, output)}.
Prices = Mapping[str, tuple[float, float]]


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _pinned_request(ctx: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request as it may be sent under the run's pins: the pinned model filled in
    when none is named; ``NonRetryable`` (one line naming both) when another is."""
    pins = getattr(ctx, "pins", None) or {}
    pinned = pins.get("model") if isinstance(pins, Mapping) else None
    if pinned is None:
        return kwargs
    asked = kwargs.get("model")
    if not asked:  # absent, None, "" or the official client's NOT_GIVEN
        return {**kwargs, "model": pinned}
    if asked != pinned:
        run_id = getattr(ctx, "run_id", "?")
        raise NonRetryable(
            f"request for model {asked!r} refused: run {run_id} is pinned to {pinned!r}"
            " (a change of model is a new workflow version)"
        )
    return kwargs


def _retry_after(exc: BaseException) -> float | None:
    """The wait a provider's 429 asks for, in seconds; None if ``exc`` is no 429 or
    names no wait. ``retry-after-ms`` first, else ``Retry-After`` (seconds or a date)."""
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None) or getattr(response, "status_code", None)
    headers = getattr(response, "headers", None)
    if status != 429 or headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return max(0.0, float(ms) / 1000)
        after = headers.get("retry-after")
        if after is None:
            return None
        try:
            return max(0.0, float(after))
        except ValueError:
            when = email.utils.parsedate_to_datetime(str(after))
            return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):  # a header that is not a wait: not ours to read
        return None


def _as_retry(exc: Exception) -> Exception:
    """A 429 naming its wait as ``Retry`` (closing the step's rated limit); else ``exc``."""
    delay = _retry_after(exc)
    if delay is None:
        return exc
    return Retry(delay, f"429 from the provider: {type(exc).__name__}", limit=rated_limit())


class _Completions:
    def __init__(self, inner: Any, ctx: UsageSink, prices: Prices) -> None:
        self._inner, self._ctx, self._prices = inner, ctx, prices

    def create(self, **kwargs: Any) -> Any:
        kwargs = _pinned_request(self._ctx, kwargs)
        try:
            response = self._inner.create(**kwargs)
        except Exception as exc:
            retry = _as_retry(exc)
            if retry is exc:
                raise
            raise retry from exc
        # The asyncio client's create returns an awaitable (its decorator hides that
        # the method is a coroutine function, so the result is what tells).
        if inspect.isawaitable(response):
            return self._recorded_later(response, kwargs)
        self._record(response, kwargs)
        return response

    async def _recorded_later(self, pending: Any, kwargs: dict[str, Any]) -> Any:
        try:
            response = await pending
        except Exception as exc:
            retry = _as_retry(exc)
            if retry is exc:
                raise
            raise retry from exc
        # In an async def step: the write on a thread, not on the loop every step shares.
        arecord = getattr(self._ctx, "arecord_usage", None)
        if arecord is not None:
            await arecord(**self._usage(response, kwargs))
        else:
            self._record(response, kwargs)
        return response

    def _record(self, response: Any, kwargs: dict[str, Any]) -> None:
        self._ctx.record_usage(**self._usage(response, kwargs))

    def _usage(self, response: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        usage = _field(response, "usage")
        model = _field(response, "model") or kwargs.get("model")
        tin = int(_field(usage, "prompt_tokens", 0) or 0) if usage is not None else 0
        tout = int(_field(usage, "completion_tokens", 0) or 0) if usage is not None else 0
        price_in, price_out = self._prices.get(str(model), (0.0, 0.0))
        return {
            "model": model,
            "input_tokens": tin,
            "output_tokens": tout,
            "cost": tin * price_in + tout * price_out,
        }


class _Chat:
    def __init__(self, completions: _Completions) -> None:
        self.completions = completions


class RecordingClient:
    """The client, with every chat completion's usage recorded on the step attempt
    and its model held to the run's pin."""

    def __init__(self, client: Any, ctx: UsageSink, prices: Prices | None = None) -> None:
        self._client = client
        self.chat = _Chat(_Completions(client.chat.completions, ctx, prices or {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def recording(client: Any, ctx: UsageSink, prices: Prices | None = None) -> RecordingClient:
    """``client`` with usage recorded on ``ctx`` and the run's pinned model enforced."""
    return RecordingClient(client, ctx, prices)
