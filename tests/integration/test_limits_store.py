"""The limiters themselves, called directly: the store's (SQLite, Postgres) and Redis's
give the same answers. All-or-none across limits, one slot per step whatever the
deliveries, lapse unless renewed, first come first served, windows of a minute,
tokens settled with what was reported, a pause closes a limit for everyone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.limits import NO_REQUEST, Throttled, Want, pace
from fleet.store import migrate
from fleet.store.engine import Database
from fleet.store.limits import LimitStore
from fleet.worker.limiter import RedisLimits
from tests.harness import REDIS_DB, REDIS_HOST, REDIS_PORT, make_backend, poll

TTL = 30.0


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def lim(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    backend = make_backend("sqlite" if request.param == "sqlite" else "postgres", tmp_path)
    db = Database(backend.database_url)
    migrate.upgrade(db)
    if request.param == "redis":
        yield RedisLimits(f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
    else:
        yield LimitStore(db)
    db.dispose()
    for undo in backend.cleanup:
        undo()


def conc(key: str, n: int) -> Want:
    return Want(key, n, None, None)


def take(lim: Any, wants: list[Want], step: str, token: str | None = None, **kw: Any) -> Any:
    kw.setdefault("jitter", 0.0)
    kw.setdefault("cap", 10.0)
    ttl = kw.pop("ttl", TTL)
    return lim.acquire(wants, "run", step, token or f"tok-{step}", ttl, **kw)


def test_room_is_taken_in_every_limit_or_in_none(lim: Any) -> None:
    a, b = conc("a", 2), conc("b", 1)
    assert take(lim, [a, b], "s1") is None
    no = take(lim, [a, b], "s2")
    assert isinstance(no, Throttled) and no.key == "b" and no.why == "concurrency"
    # s2 took nothing in a: a still has one slot free for a step that needs only a.
    assert take(lim, [a], "s3") is None
    assert isinstance(take(lim, [a], "s4"), Throttled)
    assert {u.key: u.running for u in lim.uses(["a", "b"])} == {"a": 2, "b": 1}


def test_a_released_slot_is_free_again_and_only_its_holder_releases_it(lim: Any) -> None:
    one = conc("one", 1)
    assert take(lim, [one], "s1") is None
    lim.release(["one"], [], "run", "s1", "someone-else", None)  # not the holder: no effect
    assert isinstance(take(lim, [one], "s2"), Throttled)
    lim.release(["one"], [], "run", "s1", "tok-s1", None)
    assert take(lim, [one], "s2", jitter=0.0) is None


def test_a_second_delivery_of_a_holding_step_takes_no_second_slot(lim: Any) -> None:
    two = conc("two", 2)
    assert take(lim, [two], "s1", token="first") is None
    dup = take(lim, [two], "s1", token="second")
    assert isinstance(dup, Throttled) and dup.why == "held"
    assert lim.uses(["two"])[0].running == 1
    assert lim.uses(["two"])[0].waiting == 0, "a duplicate is not a step waiting for room"
    lim.release(["two"], [], "run", "s1", "second", None)  # the duplicate gives back nothing
    assert lim.uses(["two"])[0].running == 1


def test_a_slot_not_renewed_lapses_and_a_renewed_one_stays(lim: Any) -> None:
    one = conc("lapse", 1)
    assert take(lim, [one], "s1", ttl=1.0) is None
    assert isinstance(take(lim, [one], "s2"), Throttled)
    poll(lambda: take(lim, [one], "s2") is None, 10, "the unrenewed slot to lapse")
    # s2 holds it now and renews it: it outlives its first lease.
    for _ in range(3):
        time.sleep(0.4)
        assert lim.renew(["lapse"], "run", "s2", "tok-s2", 1.0) == 1
    assert isinstance(take(lim, [one], "s3"), Throttled)


def test_waiting_steps_go_first_in_order_of_arrival(lim: Any) -> None:
    one = conc("line", 1)
    assert take(lim, [one], "holder") is None
    first = take(lim, [one], "first", jitter=1.0)
    assert isinstance(first, Throttled) and not first.redundant
    assert isinstance(take(lim, [one], "second", jitter=1.0), Throttled)
    # The slot given back wakes the first in line (only it), not at its countdown.
    assert lim.release(["line"], [], "run", "holder", "tok-holder", None) == [("run", "first")]
    # A newcomer finds the slot free but "first" has waited longer and still looks.
    assert isinstance(take(lim, [one], "newcomer"), Throttled)
    assert take(lim, [one], "first") is None
    assert lim.uses(["line"])[0].waiting == 2  # the second and the newcomer
    # Woken once: the next slot given back wakes the second, not the newcomer.
    assert lim.release(["line"], [], "run", "first", "tok-first", None) == [("run", "second")]


def test_a_step_waiting_on_concurrency_sleeps_until_woken(lim: Any) -> None:
    one = conc("sleep", 1)
    assert take(lim, [one], "holder") is None
    no = take(lim, [one], "w", ttl=TTL, cap=1000.0)
    assert isinstance(no, Throttled) and no.why == "concurrency" and no.wait >= TTL
    assert lim.release(["sleep"], [], "run", "holder", "tok-holder", None) == [("run", "w")]


def test_slots_given_back_at_once_each_wake_another_sleeper(lim: Any) -> None:
    """The first woken has not come yet when the second slot is given back: the second
    wakes the next asleep, so no slot waits for a sleeper's lease-long countdown."""
    two = conc("pair", 2)
    assert take(lim, [two], "h1") is None and take(lim, [two], "h2") is None
    for w in ("w1", "w2", "w3"):
        assert isinstance(take(lim, [two], w, cap=1000.0), Throttled)
    assert lim.release(["pair"], [], "run", "h1", "tok-h1", None) == [("run", "w1")]
    assert lim.release(["pair"], [], "run", "h2", "tok-h2", None) == [("run", "w2")]
    assert take(lim, [two], "w2") is None and take(lim, [two], "w1") is None
    assert isinstance(take(lim, [two], "w3", token="early"), Throttled)


def test_a_step_with_room_in_one_limit_but_not_the_next_hands_its_place_on(lim: Any) -> None:
    """Woken for a slot, it finds the rated limit full: it leaves the concurrency line
    (it waits on the other limit now) and the next in that line is woken to use the
    slot, so a slot is never left idle while steps sleep waiting for it."""
    pool, rate = conc("pool", 1), Want("rate", None, 1, None)
    assert take(lim, [rate], "first-call") is None  # the rate limit is full for a minute
    assert take(lim, [pool], "holder") is None
    assert isinstance(take(lim, [pool, rate], "w1", cap=1000.0), Throttled)
    assert isinstance(take(lim, [pool, rate], "w2", cap=1000.0), Throttled)
    assert lim.release(["pool"], [], "run", "holder", "tok-holder", None) == [("run", "w1")]
    no = take(lim, [pool, rate], "w1", cap=1000.0)
    assert isinstance(no, Throttled) and no.key == "rate" and no.woken == (("run", "w2"),)
    assert {u.key: u.waiting for u in lim.uses(["pool", "rate"])} == {"pool": 1, "rate": 1}
    assert lim.waiting_on("run") == {"w1": ("rate", "requests"), "w2": ("pool", "concurrency")}


def test_a_delivery_ahead_of_the_steps_countdown_is_redundant(lim: Any) -> None:
    one = conc("dup", 1)
    assert take(lim, [one], "holder") is None
    waited = take(lim, [one], "w", jitter=1.0)
    assert isinstance(waited, Throttled) and not waited.redundant and waited.wait > 0.3
    again = take(lim, [one], "w", token="other-delivery")
    assert isinstance(again, Throttled) and again.redundant


def test_requests_per_minute_count_over_the_last_minute(lim: Any) -> None:
    rpm = Want("rpm", None, 2, None)
    assert take(lim, [rpm], "s1") is None
    assert take(lim, [rpm], "s2") is None
    no = take(lim, [rpm], "s3", cap=100.0)
    # Its turn is when s1 leaves the window, and the margin after (the provider counts
    # s1 a little later than the fleet did).
    assert isinstance(no, Throttled) and no.why == "requests" and 60.5 < no.wait <= 61.5
    assert lim.uses(["rpm"])[0].requests == 2


def test_steps_waiting_on_requests_look_again_in_turn_not_all_at_once(lim: Any) -> None:
    rpm = Want("turns", None, 2, None)
    assert take(lim, [rpm], "s1") is None
    assert take(lim, [rpm], "s2") is None
    waits = [take(lim, [rpm], f"w{i}", cap=1000.0) for i in range(4)]
    assert all(isinstance(w, Throttled) and w.why == "requests" for w in waits)
    # w0 and w1 take the places of s1 and s2 as they leave the window (a minute after
    # them); w2 and w3 a further 30 s apart each (two a minute).
    at = [w.wait for w in waits]
    assert 55 < at[0] <= 61.5 and 55 < at[1] <= 61.5
    assert 85 < at[2] <= 92 and 115 < at[3] <= 122
    # A newcomer does not jump the line: it waits behind all four.
    late = take(lim, [rpm], "late", cap=1000.0)
    assert isinstance(late, Throttled) and late.wait > at[3]


def test_a_burst_is_paced_and_room_comes_back_at_the_limits_rate(lim: Any) -> None:
    """60 a minute: a burst takes a sixth of it at once (10), not the minute's 60; the
    next has room a second later (the limit's rate), not when the window's oldest call
    leaves it. A tenant arriving then goes first, and big's next after both."""
    big = Want("paced", None, 60, None, 0, "big")
    burst = pace(big).requests
    assert burst == 10
    for i in range(burst):
        assert take(lim, [big], f"b{i}") is None
    nxt = take(lim, [big], "b10", cap=1000.0)
    assert isinstance(nxt, Throttled) and nxt.why == "requests" and 0.0 < nxt.wait <= 1.01
    late = take(lim, [Want("paced", None, 60, None, 0, "small")], "s0", cap=1000.0)
    assert isinstance(late, Throttled) and late.why == "requests" and late.wait <= 1.01
    after = take(lim, [big], "b11", cap=1000.0)  # behind b10 and s0: its turn in 3 s
    assert isinstance(after, Throttled) and 2.0 < after.wait <= 3.01
    assert lim.uses(["paced"])[0].requests == burst


def test_a_heavier_tenant_leaves_a_place_to_a_lighter_one_still_calling(lim: Any) -> None:
    """While small (fewer calls in the window) has a call in the last piece, big leaves
    a place free: small's next call finds it at once instead of waiting behind big."""

    def rpm(tenant: str) -> Want:
        return Want("spare", None, 60, None, 0, tenant)

    for i in range(7):
        assert take(lim, [rpm("big")], f"b{i}") is None
    assert take(lim, [rpm("small")], "s0") is None
    assert take(lim, [rpm("big")], "b7") is None  # 9 of the burst's 10: one left, small's
    no = take(lim, [rpm("big")], "b8", cap=1000.0)
    assert isinstance(no, Throttled) and no.why == "requests"
    assert take(lim, [rpm("small")], "s1") is None


def test_tokens_are_paced_yet_a_large_request_starts_in_an_empty_bucket(lim: Any) -> None:
    def tpm(tokens: int, key: str = "tpaced") -> Want:
        return Want(key, None, None, 6000, tokens, "a")

    for i in range(5):  # a burst of 1,000 of the minute's 6,000, then 100 a second
        assert take(lim, [tpm(200)], f"s{i}") is None
    no = take(lim, [tpm(200)], "s5", cap=1000.0)
    assert isinstance(no, Throttled) and no.why == "tokens" and 1.0 < no.wait <= 2.01
    # More than a burst's share, in an empty bucket: it starts, never stuck waiting.
    assert take(lim, [tpm(2500, "tlarge")], "l0") is None


def test_a_tenant_that_used_less_of_a_rated_limit_waits_ahead(lim: Any) -> None:
    """Two of big's steps wait for the one request a minute; small, arriving later but
    having used none of the window, is next, not third."""

    def rpm(tenant: str) -> Want:
        return Want("fair", None, 1, None, 0, tenant)

    assert take(lim, [rpm("big")], "b0") is None
    b1 = take(lim, [rpm("big")], "b1", cap=1000.0)
    b2 = take(lim, [rpm("big")], "b2", cap=1000.0)
    s1 = take(lim, [rpm("small")], "s1", cap=1000.0)
    assert all(isinstance(w, Throttled) and w.why == "requests" for w in (b1, b2, s1))
    assert 60.5 < b1.wait <= 61.5 and 60.5 < s1.wait <= 61.5 and b2.wait > 120
    # Another of small's steps now waits behind the first (small has a step ahead).
    s2 = take(lim, [rpm("small")], "s2", cap=1000.0)
    assert isinstance(s2, Throttled) and s2.wait > 120


def test_tokens_kept_for_a_waiting_step_are_not_taken_by_a_newcomer(lim: Any) -> None:
    def tpm(tokens: int, tenant: str = "a") -> Want:
        return Want("kept", None, None, 100, tokens, tenant)

    assert take(lim, [tpm(50)], "first") is None
    big = take(lim, [tpm(60)], "big", cap=1000.0)
    assert isinstance(big, Throttled) and big.why == "tokens"
    # 30 would fit beside the 50 spent, but not beside the 60 the waiting step needs.
    small = take(lim, [tpm(30)], "small", cap=1000.0)
    assert isinstance(small, Throttled) and small.why == "tokens"
    # Another tenant's step, its tenant having used none of the window, goes first.
    assert take(lim, [tpm(30, "other")], "other") is None


def test_reserved_tokens_are_settled_with_what_was_reported(lim: Any) -> None:
    def tpm(tokens: int) -> Want:
        return Want("tpm", None, None, 100, tokens)

    assert take(lim, [tpm(80)], "s1") is None
    assert isinstance(take(lim, [tpm(30)], "s2"), Throttled)
    lim.release([], ["tpm"], "run", "s1", "tok-s1", 20)  # it used 20, not 80
    assert lim.uses(["tpm"])[0].tokens == 20
    assert take(lim, [tpm(30)], "s2", token="tok-s2b") is None
    assert lim.uses(["tpm"])[0].tokens == 50


def test_a_pause_closes_the_limit_for_everyone_and_is_never_shortened(lim: Any) -> None:
    one = conc("paused", 5)
    lim.pause("paused", 30.0)
    lim.pause("paused", 1.0)
    no = take(lim, [one], "s1", cap=100.0)
    assert isinstance(no, Throttled) and no.why == "paused" and no.wait > 20
    assert lim.uses(["paused"])[0].paused_for > 20


def test_a_short_pause_opens_again(lim: Any) -> None:
    one = conc("brief", 5)
    lim.pause("brief", 0.5)
    assert isinstance(take(lim, [one], "s1"), Throttled)
    poll(lambda: take(lim, [one], "s1", token=str(time.time())) is None, 10, "the pause to end")


def test_keys_of_a_per_tenant_limit_are_listed(lim: Any) -> None:
    assert take(lim, [conc("pt#acme", 1)], "s1") is None
    assert take(lim, [conc("pt#zeta", 1)], "s2") is None
    assert take(lim, [conc("ptx", 1)], "s3") is None
    assert lim.keys_like("pt") == ["pt#acme", "pt#zeta"]


def test_the_steps_a_run_waits_with_are_named_with_their_limit(lim: Any) -> None:
    one = conc("named", 1)
    assert take(lim, [one], "holder") is None
    assert isinstance(take(lim, [one], "w", cap=30.0, jitter=1.0), Throttled)
    assert lim.waiting_on("run") == {"w": ("named", "concurrency")}
    assert lim.waiting_on("another run") == {}
    lim.release(["named"], [], "run", "holder", "tok-holder", None)
    assert take(lim, [one], "w") is None
    assert lim.waiting_on("run") == {}


def test_racing_takers_never_hold_more_slots_than_the_limit(lim: Any) -> None:
    """Eight threads take and give back slots of a limit of two as fast as they can
    (each its own connection), a step that finds no room asking again, as its message
    would: the decision is atomic, so never three at once, and every step gets in."""
    import threading

    inside, most, granted = 0, 0, 0
    count = threading.Lock()
    errors: list[BaseException] = []

    def hammer(worker: int) -> None:
        nonlocal inside, most, granted
        try:
            for n in range(5):
                step, token = f"w{worker}-{n}", f"t{worker}-{n}"
                deadline = time.monotonic() + 60
                while take(lim, [conc("race", 2)], step, token=token, cap=0.01) is not None:
                    assert time.monotonic() < deadline, f"{step} never got in"
                    time.sleep(0.002)
                with count:
                    inside += 1
                    granted += 1
                    most = max(most, inside)
                # Held long enough that two takers overlap even on a loaded host (at
                # 5 ms, one full-suite run saw no overlap at all: most == 1).
                time.sleep(0.05)
                with count:
                    inside -= 1
                lim.release(["race"], [], "run", step, token, None)
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert most == 2 and granted == 40
    assert lim.uses(["race"])[0].running == 0


def test_a_call_that_never_reached_the_provider_is_taken_out(lim: Any) -> None:
    """Released with NO_REQUEST (issue 48, item 16): its request and its reserved tokens
    leave the limit, and only its; a call settled with its usage stays."""

    def both(tokens: int) -> Want:
        return Want("both", None, 60, 100, tokens)

    assert take(lim, [both(30)], "sent") is None
    assert take(lim, [both(30)], "unsent") is None
    lim.release([], ["both"], "run", "sent", "tok-sent", 10)
    lim.release([], ["both"], "run", "unsent", "tok-unsent", NO_REQUEST)
    use = lim.uses(["both"])[0]
    assert (use.requests, use.tokens) == (1, 10)
    lim.release([], ["both"], "run", "unsent", "tok-unsent", NO_REQUEST)  # twice: nothing
    assert (lim.uses(["both"])[0].requests, lim.uses(["both"])[0].tokens) == (1, 10)


def test_redis_flushed_under_a_held_slot_restores_it_before_anyone_is_let_in() -> None:
    """Issue 48, item 14: the slots the store says are held come back before the next
    decision; the holder's delivery claims its restored slot, renews and gives it back."""
    import redis

    r = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
    r.flushdb()
    held: list[tuple[str, str, str]] = []
    lim = RedisLimits(f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}", lambda: list(held))
    one = conc("flushed", 1)
    assert take(lim, [one], "s1") is None
    held.append(("flushed", "run", "s1"))  # s1 runs under its lease, as the store says
    r.flushdb()
    no = take(lim, [one], "s2")
    assert isinstance(no, Throttled) and no.why == "concurrency", "s1's slot came back first"
    dup = take(lim, [one], "s1", token="another delivery")
    assert isinstance(dup, Throttled) and dup.why == "held"
    lim.renew(["flushed"], "run", "s1", "tok-s1", TTL)  # s1's delivery claims its slot
    lim.release(["flushed"], [], "run", "s1", "another delivery", None)  # not its: nothing
    assert isinstance(take(lim, [one], "s2"), Throttled)
    lim.release(["flushed"], [], "run", "s1", "tok-s1", None)
    held.clear()
    assert take(lim, [one], "s2") is None
    assert lim.uses(["flushed"])[0].running == 1
