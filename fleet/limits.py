"""Fleet-wide limits' vocabulary: ``Limit``, a provider's limit declared once per fleet
(``fleet.limit("openai", requests_per_minute=500, tokens_per_minute=200_000,
concurrency=50)``), the key each run's use of it is counted under (one per tenant with
``per_tenant``), and ``Throttled``, what a gate answers when a limit has no room.

Enforced by the worker's gate (``fleet/worker/gate.py``): a step that names limits
starts only once every one of them has room, decided atomically across the fleet.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fleet.errors import BadInput

MAX_LIMIT_NAME = 100
WINDOW = 60.0  # the window, in seconds, that requests and tokens per minute count over
# The fleet counts a call when its step is admitted, the provider when the request
# arrives, a little later: an event stays in the fleet's window this share of the window
# longer than the provider's, so a step admitted as an old call leaves the fleet's
# window never reaches the provider before that call has left the provider's too.
MARGIN = 0.02
# Pacing: besides the window, a rated limit is a bucket holding a PIECES-th of the
# window's requests and tokens (never fewer than BURST requests), draining at the
# limit's rate (GCRA), so no tenant spends the window's budget in its first seconds and
# room comes back steadily for a step arriving later (a provider quantizes its limits
# too). A tenant that used more of the window leaves places to those that used less and
# are still calling (``spared``).
PIECES = 6
BURST = 4
# The key of a per-tenant limit for a run without a tenant.
NO_TENANT = "-"
# A limiter's ``release`` given this for the tokens used: the attempt made no request,
# so its call is taken out of each rated limit named (its reserved tokens and its
# request given back): it never reached the provider.
NO_REQUEST = -2


def _positive(name: str, what: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInput(f"limit {name!r}: {what} must be a whole number of 1 or more, got {value!r}")


@dataclass(frozen=True)
class Limit:
    """A named limit shared by every worker of the fleet. ``concurrency``: at most this
    many steps naming it run at once; ``requests_per_minute``: at most this many start
    in any 60 seconds; ``tokens_per_minute``: the tokens they reserve (the step's
    ``tokens=`` estimate) and then report (``ctx.record_usage``) in any 60 seconds stay
    under it (an attempt that reports none and sent no request through
    ``fleet.llm.recording`` never reached the provider: its tokens and its request are
    given back). Both are paced: a sixth of each at once, then at their rate (``pace``).
    ``per_tenant``: each run's tenant has a limit of its own."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrency: int | None = None
    per_tenant: bool = False

    def __post_init__(self) -> None:
        name = self.name
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= MAX_LIMIT_NAME
            or not name.isprintable()
            or any(c in name for c in "#{} ")
        ):
            raise BadInput(
                f"limit name {name!r:.120} must be 1-{MAX_LIMIT_NAME} printable characters "
                "without spaces, '#', '{' or '}'"
            )
        _positive(name, "requests_per_minute", self.requests_per_minute)
        _positive(name, "tokens_per_minute", self.tokens_per_minute)
        _positive(name, "concurrency", self.concurrency)
        if not isinstance(self.per_tenant, bool):
            raise BadInput(f"limit {name!r}: per_tenant must be True or False")
        if (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and (self.concurrency is None)
        ):
            raise BadInput(
                f"limit {name!r} limits nothing: give requests_per_minute, "
                "tokens_per_minute and/or concurrency"
            )

    def key(self, tenant: str | None) -> str:
        """What its use is counted under: the name, or ``name#tenant`` per tenant."""
        if not self.per_tenant:
            return self.name
        return f"{self.name}#{tenant or NO_TENANT}"

    @property
    def rated(self) -> bool:
        """Whether it counts requests or tokens over a window (not only concurrency)."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Want:
    """One limit a starting step needs room in: its key and bounds, the tokens the step
    reserves (its estimate, settled later with what it reports) and its run's tenant
    (steps waiting on a rated limit go first by their tenant's use of it: the least)."""

    key: str
    concurrency: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    tokens: int = 0
    tenant: str = NO_TENANT


# A step waiting on a limit is sent again after its countdown; waiting steps that looked
# within FRESH seconds of now keep their place in line (those that stopped looking do not).
FRESH = 3.0
# A delivery of a waiting step more than this ahead of its countdown's due time is a
# duplicate (the sweeper's, a redelivery): dropped, so one message per step circulates.
EARLY = 0.25
# A wait of no known length (none left: a duplicate, a request's turn already come) is
# looked at again after about this long.
POLL = 0.5


def held_for(window: float) -> float:
    """How long an event counts in a rated limit: the window and its safety ``MARGIN``."""
    return window * (1.0 + MARGIN)


def look_again(why: str, wait: float, lease: float, jitter: float, cap: float) -> float:
    """The countdown of a step that found no room. A concurrency limit cannot say when
    a holder leaves, but a slot given back wakes the first step in line for it, so a
    step waiting on one sleeps long: the lease (when a killed holder's slot lapses) is
    only the safety against a lost wake-up. Any other wait is known: ``countdown``."""
    return countdown(lease if why == "concurrency" else wait, jitter, cap)


def countdown(wait: float, jitter: float, cap: float) -> float:
    """When a step that found no room looks again: after ``wait`` (or a poll, for a
    concurrency limit), spread by ``jitter`` (0 to 1) so waiting steps never all come
    back at once, and never later than ``cap`` (the sweeper covers longer waits)."""
    if wait <= 0:
        return min(cap, POLL * (0.5 + 1.5 * jitter))
    return min(cap, wait + min(wait * 0.25, 2.0) * jitter + 0.01)


@dataclass(frozen=True)
class Throttled:
    """No room: ``key`` is the first limit found full (or paused); ``wait`` when the
    step is to look again (its countdown); ``redundant``: another message of the same
    step is already due sooner, so this one is dropped rather than sent again."""

    key: str
    wait: float
    why: str  # "concurrency", "requests", "tokens", "paused", or "held" (a duplicate)
    redundant: bool = False
    # Steps to send now (run id, step id): the step had room in a concurrency limit but
    # waits on another, so it leaves that limit's line and the next in it is woken.
    woken: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LimitUse:
    """A limit's use as ``fleet limits`` shows it: the steps holding it now, the
    requests and tokens counted in the last minute, the steps waiting for room and
    until when it is paused (a provider's 429, ``Retry(limit=...)``)."""

    key: str
    running: int
    requests: int
    tokens: int
    waiting: int
    paused_for: float


# The step attempt's rated limit (its first naming requests or tokens per minute), for
# an OpenAI-compatible client's 429 to name (``fleet/llm``); None outside a step.
_rated: ContextVar[str | None] = ContextVar("fleet_rated_limit", default=None)


@contextmanager
def rated_limit_of_step(name: str | None) -> Iterator[None]:
    """While a step's body runs: its first rated limit is ``name``."""
    token = _rated.set(name)
    try:
        yield
    finally:
        _rated.reset(token)


def rated_limit() -> str | None:
    """The running step's first limit naming requests or tokens per minute, if any."""
    return _rated.get()


def freed(evs: Sequence[Sequence[Any]], need: int, at: float, hold: float | None = None) -> float:
    """When ``need`` tokens have left the span: ``evs`` its calls, (time, tokens, ...)
    oldest first, each counting ``hold`` seconds (the window and its margin unless
    given; the store's limiter: the Redis one does the same in its script)."""
    hold = held_for(WINDOW) if hold is None else hold
    got = 0
    for e in evs:
        got += int(e[1])
        if got >= need:
            return max(0.0, float(e[0]) + hold - at)
    return max(0.0, float(evs[-1][0]) + hold - at)


def turn(
    times: list[float],
    place: int,
    per_minute: int,
    at: float,
    span: float = WINDOW,
    hold: float | None = None,
) -> float:
    """When the ``place``-th request past the limit (0: the first) may start: when the
    span's ``place``-th oldest request leaves it (``hold``: the window's margin past);
    past the span's requests, one more every ``span / per_minute`` after the newest
    leaves. So waiting steps look again in their order, spread out, never all at once."""
    hold = held_for(span) if hold is None else hold
    step = span / per_minute
    if not times:
        return step * (place + 1)
    if place < len(times):
        return max(0.0, times[place] + hold - at)
    return max(0.0, times[-1] + hold - at) + (place - len(times) + 1) * step


@dataclass(frozen=True)
class Pace:
    """A rated limit's pace: a bucket of at most ``requests`` calls and ``tokens``
    tokens (None where the limit sets no rate), draining at the limit's rate; and
    ``span``, a piece of the window (how recent a lighter tenant's calls count)."""

    span: float
    requests: int | None
    tokens: int | None


def pace(want: Want, window: float = WINDOW) -> Pace:
    """The pace of ``want``'s rated limit: a burst of a ``PIECES``-th of the window,
    never fewer than ``BURST`` requests (of the step's tokens), so a limit of a few
    requests a minute is not split, and a step reserving more than a piece's share of
    tokens still starts when the bucket is empty."""
    rpm, tpm = want.requests_per_minute, want.tokens_per_minute
    return Pace(
        window / PIECES,
        None if rpm is None else max(math.ceil(rpm / PIECES), BURST),
        None if tpm is None else max(math.ceil(tpm / PIECES), BURST * want.tokens),
    )


def level(evs: Sequence[Sequence[Any]], tokens: bool, rate: float, at: float) -> float:
    """What ``evs`` (oldest first) leave in a bucket draining ``rate`` a second at
    ``at``: each call adds 1 (or its tokens) and the bucket never drains below empty."""
    filled, last = 0.0, None
    for e in evs:
        if last is not None:
            filled = max(0.0, filled - (float(e[0]) - last) * rate)
        filled += int(e[1]) if tokens else 1
        last = float(e[0])
    return 0.0 if last is None else max(0.0, filled - (at - last) * rate)


def no_rated_room(
    want: Want, evs: Sequence[Sequence[Any]], ahead: int, at: float, window: float = WINDOW
) -> tuple[float, str] | None:
    """Why a rated limit has no room for the step now: (its turn, "requests" or
    "tokens"), or None. ``evs``: the window's calls, (time, tokens, tenant) oldest
    first; ``ahead``: the steps waiting before it, whose places count as taken, as do
    those its tenant leaves to lighter ones (``spared``). These hold it back but do not
    put its turn off: it looks again when it would have had room without them."""
    recent = [e for e in evs if float(e[0]) > at - window / PIECES]
    spare = spared(want.tenant, evs, recent)
    no = _full(want, evs, ahead + spare, at, window)
    if no is None or spare == 0:
        return no
    return _full(want, evs, ahead, at, window) or (0.0, no[1])


def _full(
    want: Want, evs: Sequence[Sequence[Any]], ahead: int, at: float, window: float
) -> tuple[float, str] | None:
    """First the window (the provider's limit), then its pace: a bucket of a burst
    draining at the limit's rate, so room comes back steadily, a call at a time, not in
    the bursts that filled it."""
    rpm, tpm = want.requests_per_minute, want.tokens_per_minute
    rate = pace(want, window)
    hold = held_for(window)
    if rpm is not None and len(evs) + 1 + ahead > rpm:
        times = [float(e[0]) for e in evs]
        return turn(times, len(evs) + ahead - rpm, rpm, at, window, hold), "requests"
    spent = sum(int(e[1]) for e in evs)
    need = spent + want.tokens * (1 + ahead)
    if tpm is not None and spent > 0 and need > tpm:
        return freed(evs, need - tpm, at, hold), "tokens"
    if rpm is not None and rate.requests is not None:
        over = level(evs, False, rpm / window, at) + 1 + ahead - rate.requests
        if over > 0:
            return over * window / rpm, "requests"
    if tpm is not None and rate.tokens is not None:
        filled = level(evs, True, tpm / window, at)
        over = filled + want.tokens * (1 + ahead) - rate.tokens
        if filled > 0 and over > 0:
            return over * window / tpm, "tokens"
    return None


def spared(tenant: str, evs: Sequence[Sequence[Any]], recent: Sequence[Sequence[Any]]) -> int:
    """The places (of its own size) a step leaves free in a rated limit: as many as the
    tenants that used less of the window took in its last piece. Their next calls (their
    runs' next steps, not yet waiting) then find room at once rather than each waiting
    for a place the heavier tenant would take first; the places are kept about as long
    as they keep calling, a piece after they stop."""
    use: dict[str, int] = {}
    for e in evs:
        use[str(e[2])] = use.get(str(e[2]), 0) + 1
    mine = use.get(tenant, 0)
    return sum(1 for e in recent if use[str(e[2])] < mine)
