"""Fleet-wide limits kept in the store: the embedded default's limiter (and any fleet
whose broker is not Redis). The only writer of the limit tables.

A step that names limits asks for room in all of them in one transaction: it locks
each limit's row (``fleet_limit_state``, in key order, so two steps never wait on each
other), drops what has lapsed (slots not renewed, events older than a minute), and
either takes a slot in each concurrency limit and an event in each rated one, or, if
any has no room, takes nothing and records that it waits (``fleet_limit_waits``).
SQLite serializes the transaction whole (BEGIN IMMEDIATE); Postgres by the row locks.
Waiting steps go first (a limit grants a newcomer room only beyond the steps ahead of it
that still look for it): in order of arrival; on a rated limit, those of the tenant that
used less of its window first. A step waits in one line at a time. A rated limit is
paced: besides its window, a bucket draining at its rate (``fleet.limits.no_rated_room``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Float, Integer, String, bindparam, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from fleet.limits import (
    EARLY,
    FRESH,
    NO_REQUEST,
    WINDOW,
    LimitUse,
    Throttled,
    Want,
    held_for,
    look_again,
    no_rated_room,
)
from fleet.store.engine import Database
from fleet.store.predicates import now
from fleet.store.schema import limit_events, limit_slots, limit_state, limit_waits
from fleet.store.transitions import DIALECTS

# A waiting step that has not looked again for this long has given up (its run ended):
# its row is deleted by the next step that looks at the limit.
STALE = 600.0
HELD = held_for(WINDOW)  # how long a call counts in a rated limit: the window, its margin

KEY = bindparam("b_key", type_=String)
KEYS: Any = bindparam("b_keys", expanding=True)
RUN = bindparam("b_run", type_=String)
STEP = bindparam("b_step", type_=String)
TOKEN = bindparam("b_token", type_=String)
TTL = bindparam("b_ttl", type_=Float)
AT = bindparam("b_at", type_=Float)
AMOUNT = bindparam("b_tokens", type_=Integer)

_ENSURE = {
    name: dialect.insert(limit_state).values(limit_key=KEY).on_conflict_do_nothing()
    for name, dialect in DIALECTS.items()
}
_LOCK = (
    select(limit_state.c.limit_key, limit_state.c.paused_until)
    .where(limit_state.c.limit_key.in_(KEYS))
    .order_by(limit_state.c.limit_key)
    .with_for_update()
)
_LAPSED_SLOTS = delete(limit_slots).where(
    limit_slots.c.limit_key.in_(KEYS), limit_slots.c.expires_at <= AT
)
_OLD_EVENTS = delete(limit_events).where(
    limit_events.c.limit_key.in_(KEYS), limit_events.c.at <= AT - HELD
)
_STALE_WAITS = delete(limit_waits).where(
    limit_waits.c.limit_key.in_(KEYS), limit_waits.c.seen_at <= AT - STALE
)
_SLOTS = select(
    limit_slots.c.limit_key,
    limit_slots.c.run_id,
    limit_slots.c.step_id,
    limit_slots.c.token,
    limit_slots.c.expires_at,
).where(limit_slots.c.limit_key.in_(KEYS))
_EVENTS = (
    select(
        limit_events.c.limit_key,
        func.count(),
        func.coalesce(func.sum(limit_events.c.tokens), 0),
        func.min(limit_events.c.at),
    )
    .where(limit_events.c.limit_key.in_(KEYS))
    .group_by(limit_events.c.limit_key)
)
_EVENT_LIST = (
    select(limit_events.c.at, limit_events.c.tokens, limit_events.c.tenant)
    .where(limit_events.c.limit_key == KEY)
    .order_by(limit_events.c.at)
)
_WAITS = select(
    limit_waits.c.limit_key,
    limit_waits.c.run_id,
    limit_waits.c.step_id,
    limit_waits.c.since,
    limit_waits.c.seen_at,
    limit_waits.c.due_at,
    limit_waits.c.tenant,
).where(limit_waits.c.limit_key.in_(KEYS))
_TAKE_SLOT = insert(limit_slots).values(
    limit_key=KEY, run_id=RUN, step_id=STEP, token=TOKEN, acquired_at=AT, expires_at=AT + TTL
)
_RETAKE_SLOT = (
    update(limit_slots)
    .where(
        limit_slots.c.limit_key == KEY,
        limit_slots.c.run_id == RUN,
        limit_slots.c.step_id == STEP,
        limit_slots.c.token == TOKEN,
    )
    .values(expires_at=AT + TTL)
)
TENANT = bindparam("b_tenant", type_=String)
_EVENT = insert(limit_events).values(
    limit_key=KEY, token=TOKEN, at=AT, tokens=AMOUNT, tenant=TENANT
)
_WAIT = {
    name: dialect.insert(limit_waits)
    .values(
        limit_key=KEY,
        run_id=RUN,
        step_id=STEP,
        why=bindparam("b_why", type_=String),
        since=AT,
        seen_at=AT,
        due_at=AT + TTL,
        tenant=TENANT,
    )
    .on_conflict_do_update(
        index_elements=["limit_key", "run_id", "step_id"],
        set_={"seen_at": AT, "due_at": AT + TTL, "why": bindparam("b_why", type_=String)},
    )
    for name, dialect in DIALECTS.items()
}
_STARTED = delete(limit_waits).where(limit_waits.c.run_id == RUN, limit_waits.c.step_id == STEP)
_LEFT = delete(limit_waits).where(
    limit_waits.c.limit_key == KEY, limit_waits.c.run_id == RUN, limit_waits.c.step_id == STEP
)
_RENEW = (
    update(limit_slots)
    .where(
        limit_slots.c.limit_key.in_(KEYS),
        limit_slots.c.run_id == RUN,
        limit_slots.c.step_id == STEP,
        limit_slots.c.token == TOKEN,
    )
    .values(expires_at=now() + TTL)
)
_RELEASE = delete(limit_slots).where(
    limit_slots.c.limit_key.in_(KEYS),
    limit_slots.c.run_id == RUN,
    limit_slots.c.step_id == STEP,
    limit_slots.c.token == TOKEN,
)
# The first in line for a key still asleep (not woken already nor about to come): woken
# for a slot given back.
_FIRST_IN_LINE = (
    select(limit_waits.c.run_id, limit_waits.c.step_id, limit_waits.c.due_at)
    .where(limit_waits.c.limit_key == KEY, limit_waits.c.due_at > AT + EARLY)
    .order_by(limit_waits.c.since)
    .limit(1)
)
_WAKE = (
    update(limit_waits)
    .where(
        limit_waits.c.limit_key == KEY, limit_waits.c.run_id == RUN, limit_waits.c.step_id == STEP
    )
    .values(due_at=AT)
)
_SETTLE = (
    update(limit_events)
    .where(limit_events.c.limit_key.in_(KEYS), limit_events.c.token == TOKEN)
    .values(tokens=AMOUNT)
)
_UNSENT = delete(limit_events).where(
    limit_events.c.limit_key.in_(KEYS), limit_events.c.token == TOKEN
)
_PAUSE = update(limit_state).where(limit_state.c.limit_key == KEY).values(paused_until=AT + TTL)
_PAUSED = select(limit_state.c.limit_key, limit_state.c.paused_until).where(
    limit_state.c.limit_key.in_(KEYS)
)
_WAITING_ON = select(limit_waits.c.step_id, limit_waits.c.limit_key, limit_waits.c.why).where(
    limit_waits.c.run_id == RUN, limit_waits.c.due_at > now() - FRESH
)
_KNOWN = select(limit_state.c.limit_key).where(limit_state.c.limit_key.like(bindparam("b_like")))


class LimitStore:
    """The limit tables' one writer; each method is one short transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def acquire(
        self,
        wants: Sequence[Want],
        run_id: str,
        step_id: str,
        token: str,
        ttl: float,
        *,
        jitter: float,
        cap: float,
    ) -> Throttled | None:
        """Room in every limit of ``wants`` for the step, taken all at once (None), or
        none of it taken and the first limit without room named (``Throttled``), with
        when to look again (``countdown`` of ``jitter`` and ``cap``), recorded."""
        keys = sorted({w.key for w in wants})
        with self.db.begin() as conn:
            at = self._lock(conn, keys)
            paused = {k: p for k, p in conn.execute(_LOCK, {"b_keys": keys}).all()}
            conn.execute(_LAPSED_SLOTS, {"b_keys": keys, "b_at": at})
            conn.execute(_OLD_EVENTS, {"b_keys": keys, "b_at": at})
            conn.execute(_STALE_WAITS, {"b_keys": keys, "b_at": at})
            slots = conn.execute(_SLOTS, {"b_keys": keys}).all()
            events = {r[0]: r[1:] for r in conn.execute(_EVENTS, {"b_keys": keys}).all()}
            waits = conn.execute(_WAITS, {"b_keys": keys}).all()
            mine = (run_id, step_id)

            def listed(key: str) -> list[Any]:
                return list(conn.execute(_EVENT_LIST, {"b_key": key}))

            for i, want in enumerate(wants):
                no = _no_room(
                    want, at, paused.get(want.key), slots, events, waits, mine, token, listed
                )
                if no is not None:
                    after = look_again(no.why, no.wait, ttl, jitter, cap)
                    no = self._wait(conn, no, at, waits, mine, after, want.tenant)
                    if no.redundant or no.why == "held":
                        return no
                    passed = [w.key for w in wants[:i] if w.concurrency is not None]
                    others = [w.key for w in wants if w.key != no.key]
                    return self._pass_on(conn, no, others, passed, mine)
            for want in wants:
                params = {"b_key": want.key, "b_run": run_id, "b_step": step_id, "b_token": token}
                if want.concurrency is not None:
                    held = any(s[0] == want.key and s[1:3] == mine for s in slots)
                    stmt = _RETAKE_SLOT if held else _TAKE_SLOT
                    conn.execute(stmt, {**params, "b_at": at, "b_ttl": ttl})
                if want.requests_per_minute is not None or want.tokens_per_minute is not None:
                    amount = {"b_tokens": want.tokens, "b_tenant": want.tenant}
                    conn.execute(_EVENT, {**params, "b_at": at, **amount})
            conn.execute(_STARTED, {"b_run": run_id, "b_step": step_id})
            return None

    @staticmethod
    def _wait(
        conn: Connection,
        no: Throttled,
        at: float,
        waits: Sequence[Any],
        mine: tuple[str, str],
        after: float,
        tenant: str,
    ) -> Throttled:
        """Record that the step waits, to look again ``after`` seconds from now; or, if
        a message of it is already due sooner, that this one is redundant."""
        due = [w[5] for w in waits if tuple(w[1:3]) == mine]
        if due and max(due) > at + EARLY:
            return Throttled(no.key, max(due) - at, no.why, redundant=True)
        if no.why != "held":  # a duplicate of a running step waits on nobody's room
            params = {"b_key": no.key, "b_run": mine[0], "b_step": mine[1], "b_why": no.why}
            params["b_tenant"] = tenant
            conn.execute(_WAIT[conn.dialect.name], {**params, "b_at": at, "b_ttl": after})
        return Throttled(no.key, after, no.why)

    def _pass_on(
        self,
        conn: Connection,
        no: Throttled,
        others: list[str],
        passed: list[str],
        mine: tuple[str, str],
    ) -> Throttled:
        """The step waits in one line, ``no.key``'s: it leaves the lines of its other
        limits (holding no place it would not use), and in each concurrency limit it had
        room in (``passed``) the next in line is woken to use the room it leaves."""
        for key in others:
            conn.execute(_LEFT, {"b_key": key, "b_run": mine[0], "b_step": mine[1]})
        woken = [w for w in self._first_in_line(conn, passed) if w != mine] if passed else []
        return Throttled(no.key, no.wait, no.why, woken=tuple(woken))

    def _lock(self, conn: Connection, keys: list[str]) -> float:
        """Each key's row made if new, then locked in key order; the store's time."""
        for key in keys:
            conn.execute(_ENSURE[conn.dialect.name], {"b_key": key})
        at: float = conn.execute(select(now())).scalar_one()
        return at

    def renew(self, keys: Sequence[str], run_id: str, step_id: str, token: str, ttl: float) -> int:
        """Push the step's slots' lapse out by ``ttl``; how many it still held."""
        params = {"b_keys": list(keys), "b_run": run_id, "b_step": step_id, "b_token": token}
        with self.db.begin() as conn:
            return conn.execute(_RENEW, {**params, "b_ttl": ttl}).rowcount

    def release(
        self,
        keys: Sequence[str],
        rated: Sequence[str],
        run_id: str,
        step_id: str,
        token: str,
        used_tokens: int | None,
    ) -> list[tuple[str, str]]:
        """Give the step's slots back; settle its reserved tokens with ``used_tokens``
        (``NO_REQUEST``: its call taken out of ``rated``, tokens and request). Returns the
        waiting steps to wake now (run id, step id): for each slot given back, the first
        in line still asleep (one woken already, or about to come, has a slot)."""
        woken: list[tuple[str, str]] = []
        with self.db.begin() as conn:
            if keys:
                params = {"b_keys": list(keys), "b_run": run_id, "b_step": step_id}
                if conn.execute(_RELEASE, {**params, "b_token": token}).rowcount:
                    woken = self._first_in_line(conn, keys)
            if rated and used_tokens == NO_REQUEST:
                conn.execute(_UNSENT, {"b_keys": list(rated), "b_token": token})
            elif rated and used_tokens is not None:
                settled = {"b_keys": list(rated), "b_token": token, "b_tokens": used_tokens}
                conn.execute(_SETTLE, settled)
        return woken

    @staticmethod
    def _first_in_line(conn: Connection, keys: Sequence[str]) -> list[tuple[str, str]]:
        at: float = conn.execute(select(now())).scalar_one()
        woken: list[tuple[str, str]] = []
        for key in keys:
            first = conn.execute(_FIRST_IN_LINE, {"b_key": key, "b_at": at}).first()
            if first is None:
                continue
            waiter = {"b_key": key, "b_run": first.run_id, "b_step": first.step_id, "b_at": at}
            conn.execute(_WAKE, waiter)
            woken.append((first.run_id, first.step_id))
        return list(dict.fromkeys(woken))

    def pause(self, key: str, seconds: float) -> None:
        """Close the limit for everyone for ``seconds`` (never shortening a pause)."""
        with self.db.begin() as conn:
            at = self._lock(conn, [key])
            row = conn.execute(_LOCK, {"b_keys": [key]}).first()
            until = at + seconds
            if row is not None and row.paused_until is not None and row.paused_until >= until:
                return
            conn.execute(_PAUSE, {"b_key": key, "b_at": at, "b_ttl": seconds})

    def uses(self, keys: Sequence[str]) -> list[LimitUse]:
        """Each key's use now, for ``fleet limits`` and the metrics (a read)."""
        keys = sorted(set(keys))
        with self.db.begin() as conn:
            at: float = conn.execute(select(now())).scalar_one()
            paused = {k: p for k, p in conn.execute(_PAUSED, {"b_keys": keys}).all()}
            slots = conn.execute(_SLOTS, {"b_keys": keys}).all()
            events = conn.execute(
                _EVENTS.where(limit_events.c.at > at - HELD), {"b_keys": keys}
            ).all()
            waits = conn.execute(_WAITS, {"b_keys": keys}).all()
        counted = {r[0]: (int(r[1]), int(r[2])) for r in events}
        return [
            LimitUse(
                key,
                running=sum(1 for s in slots if s[0] == key and s[4] > at),
                requests=counted.get(key, (0, 0))[0],
                tokens=counted.get(key, (0, 0))[1],
                waiting=sum(1 for w in waits if w[0] == key and w[5] > at - FRESH),
                paused_for=max(0.0, (paused.get(key) or 0.0) - at),
            )
            for key in keys
        ]

    def waiting_on(self, run_id: str) -> dict[str, tuple[str, str]]:
        """The run's steps waiting for room now: step id → (limit key, why)."""
        with self.db.begin() as conn:
            return {r[0]: (r[1], r[2]) for r in conn.execute(_WAITING_ON, {"b_run": run_id})}

    def keys_like(self, prefix: str) -> list[str]:
        """The keys in use of a per-tenant limit (``name#...``)."""
        with self.db.begin() as conn:
            return [r[0] for r in conn.execute(_KNOWN, {"b_like": f"{prefix}#%"})]


def _no_room(
    want: Want,
    at: float,
    paused_until: float | None,
    slots: Sequence[Any],
    events: dict[str, Any],
    waits: Sequence[Any],
    mine: tuple[str, str],
    token: str,
    listed: Callable[[str], list[Any]],
) -> Throttled | None:
    """Why ``want`` has no room for the step now, or None. Steps that wait ahead of it
    (and still look) go first: their places are counted as taken."""
    key = want.key
    if paused_until is not None and paused_until > at:
        return Throttled(key, paused_until - at, "paused")
    if want.concurrency is not None:
        held = [s for s in slots if s[0] == key and s[4] > at]
        other = [s for s in held if tuple(s[1:3]) == mine and s[3] != token]
        if other:  # another delivery of this very step holds it: a duplicate
            return Throttled(key, other[0][4] - at, "held")
        running = sum(1 for s in held if tuple(s[1:3]) != mine)
        if running + _ahead(key, waits, mine, at, None) >= want.concurrency:
            return Throttled(key, 0.0, "concurrency")
    if want.requests_per_minute is None and want.tokens_per_minute is None:
        return None
    evs = listed(key) if key in events else []  # (at, tokens, tenant), oldest first
    use: dict[str, int] = {}
    for e in evs:
        use[e[2]] = use.get(e[2], 0) + 1
    ahead = _ahead(key, waits, mine, at, (use, want.tenant))
    no = no_rated_room(want, evs, ahead, at)
    return None if no is None else Throttled(key, no[0], no[1])


def _ahead(
    key: str,
    waits: Sequence[Any],
    mine: tuple[str, str],
    at: float,
    fair: tuple[dict[str, int], str] | None,
) -> int:
    """How many steps wait on ``key`` ahead of this one and still look for room (their
    countdown fell due within FRESH seconds, or is ahead). Ahead: since before it (a
    new step: all); on a rated limit (``fair``: each tenant's calls in the window, and
    the step's tenant), first those of a tenant that used less, then since before it."""
    since = next((w[3] for w in waits if w[0] == key and tuple(w[1:3]) == mine), math.inf)
    use, tenant = fair if fair is not None else ({}, "")
    mine_place = (use.get(tenant, 0), since)
    return sum(
        1
        for w in waits
        if w[0] == key
        and tuple(w[1:3]) != mine
        and w[5] > at - FRESH
        and (use.get(w[6], 0), w[3]) < mine_place
    )
