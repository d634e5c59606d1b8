"""Declaring limits: ``fleet.limit`` and ``@fleet.step(limits=..., tokens=...)`` take
what makes sense and refuse the rest with one line naming what was wrong, at
definition; a per-tenant limit counts under one key per tenant; waiting steps look
again spread out, never later than the cap."""

from __future__ import annotations

import pytest

from fleet import Fleet, Retry, StepContext
from fleet.errors import BadInput
from fleet.limits import (
    BURST,
    MARGIN,
    POLL,
    Limit,
    Pace,
    Want,
    countdown,
    held_for,
    level,
    look_again,
    no_rated_room,
    pace,
    rated_limit,
    rated_limit_of_step,
    spared,
)
from fleet.llm import recording


def fresh() -> Fleet:
    return Fleet("limits-unit", database_url="sqlite:///:memory:", broker_url="memory://")


def test_a_limit_is_declared_once_and_returned() -> None:
    fleet = fresh()
    openai = fleet.limit(
        "openai", requests_per_minute=500, tokens_per_minute=200_000, concurrency=50
    )
    assert openai == Limit("openai", 500, 200_000, 50, False)
    assert (
        fleet.limit("openai", requests_per_minute=500, tokens_per_minute=200_000, concurrency=50)
        == openai
    )
    with pytest.raises(BadInput, match="'openai' is already declared"):
        fleet.limit("openai", concurrency=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "x"}, "limits nothing"),
        ({"name": "x", "concurrency": 0}, "concurrency must be a whole number of 1 or more"),
        ({"name": "x", "requests_per_minute": 2.5}, "requests_per_minute must be a whole"),
        ({"name": "x", "tokens_per_minute": True}, "tokens_per_minute must be a whole"),
        ({"name": "a#b", "concurrency": 1}, "must be 1-100 printable characters"),
        ({"name": "", "concurrency": 1}, "must be 1-100 printable characters"),
        ({"name": "x", "concurrency": 1, "per_tenant": "yes"}, "per_tenant must be True or False"),
    ],
)
def test_a_bad_declaration_is_one_line_naming_what_was_wrong(
    kwargs: dict[str, object], message: str
) -> None:
    fleet = fresh()
    with pytest.raises(BadInput, match=message) as info:
        fleet.limit(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert fleet.registry.limits == {}


def test_a_step_naming_an_undeclared_limit_fails_at_definition() -> None:
    fleet = fresh()
    with pytest.raises(BadInput, match=r"undeclared limit 'openai': declare it first"):

        @fleet.step(limits=["openai"])
        def call(ctx: StepContext) -> None: ...

    assert "call" not in fleet.registry.steps


def test_limits_and_tokens_are_checked() -> None:
    fleet = fresh()
    fleet.limit("openai", tokens_per_minute=1000)
    with pytest.raises(BadInput, match="limits= takes a list of limit names"):
        fleet.step(limits="openai")(lambda ctx: None)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="tokens= takes a function"):
        fleet.step(limits=["openai"], tokens=5)(lambda ctx: None)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="name them with limits="):
        fleet.step(tokens=lambda n: n)(lambda ctx, n: None)

    @fleet.step(limits=["openai", "openai"], tokens=lambda n: n * 2)
    def call(ctx: StepContext, n: int) -> None: ...

    assert call.limits == ("openai",)
    assert call.tokens is not None and call.tokens(4) == 8


def test_another_environment_keeps_the_limits() -> None:
    fleet = fresh()
    fleet.limit("api", concurrency=2)
    other = fleet.with_settings(fleet.settings)
    assert other.registry.limits == {"api": Limit("api", concurrency=2)}


def test_a_per_tenant_limit_counts_each_tenant_apart() -> None:
    shared = Limit("api", concurrency=3)
    mine = Limit("fair", concurrency=3, per_tenant=True)
    assert shared.key("acme") == shared.key(None) == "api"
    assert mine.key("acme") == "fair#acme"
    assert mine.key(None) == "fair#-"


def test_a_waiting_step_looks_again_spread_out_and_never_after_the_cap() -> None:
    polls = {countdown(0.0, j / 10, 60.0) for j in range(11)}
    assert len(polls) == 11 and min(polls) >= POLL * 0.5 and max(polls) <= POLL * 2
    assert 10.0 < countdown(10.0, 0.5, 60.0) <= 12.01
    assert countdown(300.0, 1.0, 60.0) == 60.0


def test_retry_names_the_limit_a_429_closes() -> None:
    r = Retry(2.5, "429", limit="openai")
    assert (r.delay, r.limit, str(r)) == (2.5, "openai", "429")
    assert Retry().limit is None


def test_an_event_counts_a_margin_longer_than_the_providers_window() -> None:
    assert 0 < MARGIN <= 0.05
    assert held_for(60.0) == pytest.approx(61.2)
    assert held_for(10.0) == pytest.approx(10.2)


def test_a_step_waiting_on_concurrency_sleeps_until_woken_with_the_lease_as_safety() -> None:
    # Woken by the release of a slot; its own countdown is only the safety net: the
    # lease (spread by jitter), not a poll.
    waits = [look_again("concurrency", 0.0, 30.0, j / 10, 300.0) for j in range(11)]
    assert min(waits) >= 30.0 and max(waits) <= 32.01 and len(set(waits)) == 11
    assert look_again("concurrency", 0.0, 30.0, 1.0, 20.0) == 20.0  # never past the cap
    # A known wait (the turn of a request, a pause) is that wait.
    assert look_again("requests", 5.0, 30.0, 0.0, 300.0) == pytest.approx(5.01)
    assert look_again("paused", 2.0, 30.0, 0.0, 300.0) == pytest.approx(2.01)


def test_a_rated_limit_is_paced_by_a_burst_of_a_piece_and_a_few_requests_at_least() -> None:
    # A bucket of a sixth of the window: 50 requests, 10,000 tokens of a minute's 6x.
    assert pace(Want("k", None, 300, 60_000, 200)) == Pace(10.0, 50, 10_000)
    assert pace(Want("k", None, 50, 10_000, 210), window=10.0) == Pace(10 / 6, 9, 1667)
    # A limit too small to split is not split: a bucket holds BURST requests at least
    # (of the step's own tokens), more than the window's.
    assert pace(Want("k", None, 2, 100, 30)) == Pace(10.0, BURST, BURST * 30)
    assert pace(Want("k", 5, None, None)) == Pace(10.0, None, None)


def test_the_bucket_drains_at_the_limits_rate_and_never_below_empty() -> None:
    calls = [(0.0, 100, "a"), (0.0, 100, "a"), (10.0, 100, "a")]
    assert level(calls, False, 0.1, 10.0) == pytest.approx(2.0)  # 2 - 1 + 1
    assert level(calls, True, 10.0, 12.0) == pytest.approx(180.0)  # 200-100 +100, -20
    assert level(calls, False, 1.0, 100.0) == 0.0
    assert level([], True, 1.0, 5.0) == 0.0


def _ask_every_tick(want: Want, evs: list[tuple[float, int, str]], ticks: range) -> int:
    """``want`` asks ten times a second over ``ticks``, taking room whenever it has some."""
    took = 0
    for tick in ticks:
        if no_rated_room(want, evs, 0, tick / 10) is None:
            evs.append((tick / 10, want.tokens, want.tenant))
            took += 1
    return took


def test_a_burst_is_spread_so_a_late_tenant_gets_in_before_the_window_empties() -> None:
    """Big asks for 60 a minute's room ten times a second: paced, it takes a burst of
    10, then one a second, not the minute's 60 in its first 6 s (which would shut the
    window until its oldest calls left, a minute later). Small, arriving at 20 s, is
    next within a second; even behind five others, within seconds."""
    big, small = Want("p", None, 60, None, 0, "big"), Want("p", None, 60, None, 0, "small")
    evs: list[tuple[float, int, str]] = []
    assert _ask_every_tick(big, evs, range(0, 60)) == 15
    assert _ask_every_tick(big, evs, range(60, 200)) == 14
    wait, why = no_rated_room(small, evs, 0, 20.0) or (0.0, "")
    assert why in ("", "requests") and wait <= 1.0
    wait, why = no_rated_room(small, evs, 5, 20.0) or (0.0, "")
    assert why == "requests" and wait == pytest.approx(5.0)


def test_a_large_request_is_never_stuck_behind_the_pace() -> None:
    """A step reserving more than the window's tokens starts when nothing else counts;
    one reserving more than a piece's share fits a bucket of BURST of its size."""
    assert no_rated_room(Want("t", None, None, 600, 900), [], 0, 0.0) is None
    evs = [(0.0, 100, "a")]
    assert no_rated_room(Want("t", None, None, 600, 120), evs, 0, 1.0) is None
    assert no_rated_room(Want("t", None, None, 6000, 900), [(0.0, 900, "a")], 0, 1.0) is None


def test_a_heavier_tenant_leaves_as_many_places_as_lighter_ones_took_lately() -> None:
    evs = [(0.0, 0, "big")] * 5 + [(1.0, 0, "small"), (15.0, 0, "small"), (16.0, 0, "mid")]
    evs += [(17.0, 0, "mid")]
    # Small (2 calls) and mid (2) used less than big (5): their calls of the last 10 s.
    assert spared("big", evs, [e for e in evs if e[0] > 20.0 - 10.0]) == 3
    assert spared("mid", evs, [e for e in evs if e[0] > 10.0]) == 0  # small: as many
    assert spared("small", evs, evs) == 0


class _Http429(Exception):
    """Shaped like openai.RateLimitError: ``status_code`` and ``response.headers``."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"Error code: {status}")
        self.status_code = status
        self.response = type("Response", (), {"status_code": status, "headers": headers})()


class _Refusing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.chat = self
        self.completions = self

    def create(self, **kwargs: object) -> object:
        raise self.exc


class _Sink:
    def record_usage(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a refused call records no usage")


def test_a_429_with_retry_after_is_a_retry_closing_the_steps_rated_limit() -> None:
    llm = recording(_Refusing(_Http429(429, {"retry-after-ms": "1500"})), _Sink())
    with rated_limit_of_step("openai"), pytest.raises(Retry) as info:
        llm.chat.completions.create(model="m", messages=[])
    assert (info.value.delay, info.value.limit) == (1.5, "openai")
    assert isinstance(info.value.__cause__, _Http429)
    assert rated_limit() is None  # only while the step's body runs
    # Retry-After in seconds; outside a step with a rated limit it names none.
    llm = recording(_Refusing(_Http429(429, {"retry-after": "7"})), _Sink())
    with pytest.raises(Retry) as info:
        llm.chat.completions.create(model="m", messages=[])
    assert (info.value.delay, info.value.limit) == (7.0, None)


@pytest.mark.parametrize(
    "exc",
    [_Http429(429, {}), _Http429(500, {"retry-after": "3"}), ValueError("not http")],
)
def test_other_failures_of_the_client_pass_through_unchanged(exc: Exception) -> None:
    llm = recording(_Refusing(exc), _Sink())
    with rated_limit_of_step("openai"), pytest.raises(type(exc)) as info:
        llm.chat.completions.create(model="m", messages=[])
    assert info.value is exc
