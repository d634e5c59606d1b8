"""How a recording client sends one request: held to the run's pinned model, marked as
sent on the attempt (``Calls``), a provider's 429 that names its wait raised as
``Retry(limit=)``, and what it spent written on the step attempt (``Recorder``).

``Calls`` is what one step attempt's recording clients did, for the limits' gate to
settle the attempt's reservation by: whether a request was sent at all (an attempt that
sent none and reported no usage never reached the provider), whether a stream ended
without the provider's count of it, and the streams not ended yet, which are recorded as
they stand when the attempt ends, before its reservation is settled.
"""

from __future__ import annotations

import email.utils
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from fleet.errors import NonRetryable, Retry
from fleet.limits import rated_limit

log = logging.getLogger("fleet.llm")


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


def field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` or ``obj[name]``: responses are objects, fakes often dicts."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def count(obj: Any, name: str) -> int:
    """A token count of a usage object, 0 when absent."""
    return int(field(obj, name, 0) or 0) if obj is not None else 0


class Calls:
    """What one step attempt's recording clients did (see the module's docstring)."""

    def __init__(self) -> None:
        self.sent = False  # a request went to the provider (or was about to)
        self.uncounted = False  # a stream ended before the provider's count of it came
        self._open: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def opened(self, stream: object, end: Callable[[], None]) -> None:
        with self._lock:
            self._open[id(stream)] = end

    def closed(self, stream: object) -> None:
        with self._lock:
            self._open.pop(id(stream), None)

    def finish(self) -> None:
        """Record every stream not ended yet as it stands (the attempt is ending)."""
        with self._lock:
            ends = list(self._open.values())
        for end in ends:
            end()

    @property
    def open(self) -> bool:
        return bool(self._open)


_calls: ContextVar[Calls | None] = ContextVar("fleet_llm_calls", default=None)


@contextmanager
def attempt_calls() -> Iterator[Calls]:
    """While a step attempt runs: what its recording clients do is kept in the ``Calls``
    given (clients wrapped in it keep reporting there, from any thread)."""
    calls = Calls()
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def pinned_request(ctx: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
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


def refusal(what: str, instead: str) -> NonRetryable:
    """One line refusing a form of the client that fleet does not record."""
    return NonRetryable(
        f"fleet.llm.recording does not record {what}: its spend and the run's model pin "
        f"would go unchecked; {instead}"
    )


def retry_after(exc: BaseException) -> float | None:
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


def as_retry(exc: Exception) -> Exception:
    """A 429 naming its wait as ``Retry`` (closing the step's rated limit); else ``exc``."""
    delay = retry_after(exc)
    if delay is None:
        return exc
    return Retry(delay, f"429 from the provider: {type(exc).__name__}", limit=rated_limit())


class Recorder:
    """One recording client's ends: the sink its usage goes to, the prices it is costed
    at and the attempt's ``Calls``."""

    def __init__(self, ctx: UsageSink, prices: Prices) -> None:
        self.ctx, self.prices = ctx, prices
        self._made_in = _calls.get() or Calls()

    @property
    def calls(self) -> Calls:
        """The ``Calls`` of the attempt running here, else of the one it was made in
        (a thread the step started does not carry the attempt's context)."""
        return _calls.get() or self._made_in

    def sending(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request held to the run's pin, and the attempt marked as having sent."""
        kwargs = pinned_request(self.ctx, kwargs)
        self.calls.sent = True
        return kwargs

    def spent(self, model: Any, tin: int, tout: int) -> dict[str, Any]:
        price_in, price_out = self.prices.get(str(model), (0.0, 0.0))
        cost = tin * price_in + tout * price_out
        return {"model": model, "input_tokens": tin, "output_tokens": tout, "cost": cost}

    def record(self, model: Any, tin: int, tout: int) -> None:
        self.ctx.record_usage(**self.spent(model, tin, tout))

    async def arecord(self, model: Any, tin: int, tout: int) -> None:
        """In an async def step: the write on a thread, not on the loop every step shares."""
        arecord = getattr(self.ctx, "arecord_usage", None)
        if arecord is None:
            self.record(model, tin, tout)
        else:
            await arecord(**self.spent(model, tin, tout))


def call(method: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``method(**kwargs)``, a 429 that names its wait raised as ``Retry``. The asyncio
    client's methods return an awaitable (a decorator hides that they are coroutine
    functions, so the result is what tells): awaited the same way, later."""
    try:
        result = method(**kwargs)
    except Exception as exc:
        retry = as_retry(exc)
        if retry is exc:
            raise
        raise retry from exc
    if inspect.isawaitable(result):
        return _awaited(result)
    return result


async def _awaited(pending: Any) -> Any:
    try:
        return await pending
    except Exception as exc:
        retry = as_retry(exc)
        if retry is exc:
            raise
        raise retry from exc
