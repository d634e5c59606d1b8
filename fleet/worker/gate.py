"""The limits' gate around an attempt (invariant 12): a step that names limits starts
only once every one of them has room, decided atomically across the fleet; one that
finds no room holds no worker.

``admit``, before the lease is taken: asks the limiter for room in every limit the step
names (keyed by the run's tenant for a per-tenant limit). No room: nothing is taken,
the step's status is untouched (no attempt is spent), the limiter records that it
waits, and the step is sent again with a countdown (the time until room, with jitter;
on a concurrency limit, the lease: it is woken when a slot is given back); the task
returns at once. A step waits in one line: one that had room in a concurrency limit
but not in another leaves the first's line and wakes the next in it.

``holding``, around the attempt's body: the slots are renewed while it runs (by one
thread per process, every third of the lease) and given back however the body ends
(output, failure, retry, dead letter, lost lease), with the tokens it reported settling
its reservation; each slot given back sends the step first in line for it at once (one
per slot, never every waiting step). What its recording clients did (``fleet.llm``'s
``Calls``) settles the rest: streams left open are recorded first; an attempt that
reported no usage and sent no request never reached the provider, so its call is taken
out of each tokens limit (its tokens and its request given back; a requests-only limit
keeps it, as fleet cannot see a request made otherwise); a stream that ended before the
provider's count keeps at least its reservation. A lease refused after ``admit`` gives
back its call in every rated limit: no body ran. A worker killed while holding a slot
stops renewing it: it lapses a lease later, and the steps waiting for it come back at
their countdown. A step that names no limit costs nothing here.

The limiter is Redis when the broker is (``fleet/worker/limiter.py``), the store
otherwise (``fleet/store/limits.py``); each slot is held by one delivery (a random
token), so a duplicate delivery of the same step can neither take a second slot nor
give back the one another delivery holds. For an attempt on the event loop's own thread
(an async step, fleet/worker/on_loop.py), the limiter's calls and the sends they lead to
run on a thread of their own (``strands.off_the_loop``): a Redis that does not answer
stalls that attempt, never the loop and every step awaiting on it.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from fleet.errors import FleetError, Retry
from fleet.limits import NO_REQUEST, NO_TENANT, LimitUse, Throttled, Want, rated_limit_of_step
from fleet.llm.sending import Calls, attempt_calls
from fleet.registry import StepDef
from fleet.store.limits import LimitStore
from fleet.store.rows import RunRow, StepRow
from fleet.worker import strands
from fleet.worker.context import Attempt
from fleet.worker.failures import countdown_limit
from fleet.worker.limit_flush import held_by
from fleet.worker.limiter import RedisLimits
from fleet.worker.replay import step_shadow
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.limits")


class Limiter(Protocol):
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
    ) -> Throttled | None: ...

    def renew(
        self, keys: Sequence[str], run_id: str, step_id: str, token: str, ttl: float
    ) -> int: ...

    def release(
        self,
        keys: Sequence[str],
        rated: Sequence[str],
        run_id: str,
        step_id: str,
        token: str,
        used_tokens: int | None,
    ) -> list[tuple[str, str]]: ...

    def pause(self, key: str, seconds: float) -> None: ...

    def uses(self, keys: Sequence[str]) -> list[LimitUse]: ...

    def keys_like(self, prefix: str) -> list[str]: ...

    def waiting_on(self, run_id: str) -> dict[str, tuple[str, str]]: ...


_limiters: weakref.WeakKeyDictionary[Runtime, Limiter] = weakref.WeakKeyDictionary()
_made = threading.Lock()


def limiter(rt: Runtime) -> Limiter:
    """The fleet's limiter: on the broker's Redis if it is one, else in the store."""
    found = _limiters.get(rt)
    if found is None:
        with _made:
            found = _limiters.get(rt)
            if found is None:
                url = rt.settings.broker_url
                redis = url.startswith(("redis://", "rediss://"))
                found = RedisLimits(url, held_by(rt)) if redis else LimitStore(rt.db)
                _limiters[rt] = found
    return found


@dataclass(frozen=True)
class Held:
    """Room a delivery took for a step: its concurrency slots (``keys``), its events in
    rated limits (``rated``; in those counting tokens, ``counted``, it reserved
    ``reserved``, settled with the tokens it reports) and whose they are."""

    rt: Runtime
    run_id: str
    step_id: str
    token: str
    keys: tuple[str, ...]
    rated: tuple[str, ...]
    counted: tuple[str, ...]
    reserved: int

    def release(self, used_tokens: int | None = None, rated: Sequence[str] | None = None) -> None:
        """Give the room back (settling the calls in ``rated``, all by default, with
        ``used_tokens``), and send at once each waiting step first in line for a slot
        given back (one per slot: never all waiting steps at once)."""
        rated = self.rated if rated is None else rated
        try:
            woken = limiter(self.rt).release(
                self.keys, rated, self.run_id, self.step_id, self.token, used_tokens
            )
        except Exception as exc:  # the slots lapse a lease later anyway
            log.warning("giving back the limits of step %s failed: %s", self.step_id, exc)
            return
        for run_id, step_id in woken:
            _wake(self.rt, run_id, step_id)


def _wake(rt: Runtime, run_id: str, step_id: str) -> None:
    """Send a waiting step now: a slot it waits for was given back."""
    try:
        run, step = rt.queries.run_and_step(run_id, step_id)
    except FleetError as exc:  # its own countdown brings it back anyway
        log.warning("waking step %s of run %s failed: %s", step_id, run_id, exc)
        return
    if run is None or step is None or run.status.finished or step.status.finished:
        return
    rt.dispatcher.execute(
        run.id,
        step_id,
        run.queue,
        countdown=random.uniform(0.0, 0.05),
        shadow=step_shadow(run.workflow, step.name),
    )


# What ``admit`` took, until the attempt's body picks it up: by (runtime, run, step).
_admitted: dict[tuple[int, str, str], Held] = {}
_admitted_lock = threading.Lock()


def wants(rt: Runtime, run: RunRow, step: StepRow, sd: StepDef) -> list[Want]:
    """The room the step needs: one ``Want`` per limit it names."""
    limits = [rt.registry.limits[name] for name in sd.limits]
    reserve = _estimate(rt, step, sd) if any(lim.tokens_per_minute for lim in limits) else 0
    return [
        Want(
            lim.key(run.tenant),
            lim.concurrency,
            lim.requests_per_minute,
            lim.tokens_per_minute,
            reserve if lim.tokens_per_minute else 0,
            run.tenant or NO_TENANT,
        )
        for lim in limits
    ]


def _estimate(rt: Runtime, step: StepRow, sd: StepDef) -> int:
    """The tokens the step reserves: its ``tokens=`` of its arguments (0 without one, or
    if it fails: logged; the usage it reports settles the reservation either way)."""
    if sd.tokens is None:
        return 0
    try:
        args, kwargs = rt.payloads.load_call(step.input, f"input of step {step.step_id}")
        return max(0, int(sd.tokens(*args, **kwargs)))
    except Exception as exc:
        log.warning("tokens= of step %s failed (%s): reserving none", sd.name, exc)
        return 0


def admit(rt: Runtime, run: RunRow, step: StepRow, sd: StepDef) -> bool:
    """Take room in every limit the step names, for the delivery about to take its
    lease; False: no room, and the step is sent again when there may be (or, if another
    message of it is due sooner, this one is dropped)."""
    return strands.off_the_loop(_admit, rt, run, step, sd)


def _admit(rt: Runtime, run: RunRow, step: StepRow, sd: StepDef) -> bool:
    needed = wants(rt, run, step, sd)
    token = uuid.uuid4().hex
    ttl = rt.settings.lease_seconds
    cap = countdown_limit(rt)
    no = limiter(rt).acquire(
        needed, run.id, step.step_id, token, ttl, jitter=random.random(), cap=cap
    )
    if no is not None:
        _deferred(rt, run, step, no)
        return False
    held = Held(
        rt,
        run.id,
        step.step_id,
        token,
        tuple(w.key for w in needed if w.concurrency is not None),
        tuple(w.key for w in needed if w.requests_per_minute or w.tokens_per_minute),
        tuple(w.key for w in needed if w.tokens_per_minute),
        max((w.tokens for w in needed), default=0),
    )
    with _admitted_lock:
        _admitted[(id(rt), run.id, step.step_id)] = held
    return True


def _deferred(rt: Runtime, run: RunRow, step: StepRow, no: Throttled) -> None:
    for run_id, step_id in no.woken:  # next in line for the room this step leaves
        _wake(rt, run_id, step_id)
    if no.redundant:
        log.info(
            "step %s of run %s waits on limit %s; already due again in %.2fs: dropped",
            step.step_id,
            run.id,
            no.key,
            no.wait,
        )
        return
    log.info(
        "step %s of run %s waits on limit %s (%s): again in %.2fs",
        step.step_id,
        run.id,
        no.key,
        no.why,
        no.wait,
    )
    rt.dispatcher.execute(
        run.id,
        step.step_id,
        run.queue,
        countdown=no.wait,
        shadow=step_shadow(run.workflow, step.name),
    )


def refused(rt: Runtime, run_id: str, step_id: str) -> None:
    """The lease was not taken after all: give back what ``admit`` took (its calls too:
    no request was made)."""
    with _admitted_lock:
        held = _admitted.pop((id(rt), run_id, step_id), None)
    if held is not None:
        strands.off_the_loop(held.release, NO_REQUEST)


@contextmanager
def holding(att: Attempt) -> Iterator[None]:
    """Around the attempt's body: keep its slots while it runs, give them back after;
    a stream its recording clients left open is recorded before (every step's)."""
    with attempt_calls() as calls:
        if not att.sd.limits:
            try:
                yield
            finally:
                if calls.open:
                    strands.off_the_loop(_finish, att, calls)
            return
        with _admitted_lock:
            held = _admitted.pop((id(att.rt), att.run_id, att.step_id), None)
        rated = next((n for n in att.sd.limits if att.rt.registry.limits[n].rated), None)
        if held is None:  # taken without ``admit`` (cannot happen: see attempt._claimed)
            with rated_limit_of_step(rated):
                yield
            return
        _renewer.add(held)
        try:
            with rated_limit_of_step(rated):
                yield
        finally:
            _renewer.remove(held)
            strands.off_the_loop(_settle, att, held, calls)


def _finish(att: Attempt, calls: Calls) -> None:
    """Record the streams the attempt left open as they stand."""
    try:
        calls.finish()
    except Exception as exc:  # the room is given back all the same
        log.warning("recording the open streams of step %s failed: %s", att.step_id, exc)


def _settle(att: Attempt, held: Held, calls: Calls) -> None:
    """Give the attempt's room back, its reservation settled by what it did (above)."""
    _finish(att, calls)
    if not held.counted:
        held.release()
        return
    used = _used_tokens(att)
    if used is None and not calls.sent:  # it never reached the provider
        held.release(NO_REQUEST, held.counted)
        return
    used = used or 0
    if calls.uncounted:  # a stream ended before the provider counted it
        used = max(used, held.reserved)
    held.release(used)


def _used_tokens(att: Attempt) -> int | None:
    """The tokens the attempt reported (``ctx.record_usage``); None if it reported none."""
    try:
        rows = att.rt.queries.attempts(att.run_id)
    except FleetError:
        return None
    for row in rows:
        if row.step_id == att.step_id and row.epoch == att.lease.epoch and row.calls:
            return int(row.input_tokens + row.output_tokens)
    return None


def on_failure(att: Attempt, exc: BaseException) -> None:
    """A step that raised ``Retry(delay, limit=name)`` (the provider's 429) closes that
    limit for everyone for the delay; the retry itself is the policy's, as any."""
    if not isinstance(exc, Retry) or exc.limit is None:
        return
    limit = att.rt.registry.limits.get(exc.limit)
    if limit is None:
        log.warning("step %s: Retry(limit=%r) names no declared limit", att.sd.name, exc.limit)
        return
    delay = exc.delay if exc.delay is not None and exc.delay > 0 else 1.0
    key = limit.key(att.run.tenant)
    try:
        strands.off_the_loop(limiter(att.rt).pause, key, delay)
        log.warning("limit %s paused for %.1fs (step %s: %s)", key, delay, att.step_id, exc)
    except Exception as exc2:
        log.warning("pausing limit %s failed: %s", key, exc2)


def uses(rt: Runtime) -> list[LimitUse]:
    """Every declared limit's use (a per-tenant one: each tenant's key seen so far)."""
    lim = limiter(rt)
    keys: list[str] = []
    for limit in rt.registry.limits.values():
        keys += lim.keys_like(limit.name) if limit.per_tenant else [limit.name]
    return lim.uses(keys)


def waiting_on(rt: Runtime, run_id: str) -> dict[str, tuple[str, str]]:
    """The run's steps waiting for room now: step id → (limit key, why: concurrency,
    requests, tokens, paused or held), for ``fleet status`` to say which."""
    return limiter(rt).waiting_on(run_id)


class _Renewer:
    """One thread per process renewing every held slot, each third of its lease."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[int, Held] = {}
        self._pid = 0

    def add(self, held: Held) -> None:
        if not held.keys:
            return
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child
                self._pid = os.getpid()
                self._held.clear()
                threading.Thread(target=self._loop, name="fleet-limits", daemon=True).start()
            self._held[id(held)] = held

    def remove(self, held: Held) -> None:
        with self._cond:
            self._held.pop(id(held), None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                held = list(self._held.values())
            interval = min((h.rt.settings.lease_seconds for h in held), default=3.0) / 3
            deadline = time.monotonic() + interval
            for h in held:
                try:
                    ttl = h.rt.settings.lease_seconds
                    limiter(h.rt).renew(h.keys, h.run_id, h.step_id, h.token, ttl)
                except Exception as exc:  # next round; it lapses only a lease later
                    log.warning("renewing the limits of step %s failed: %s", h.step_id, exc)
            time.sleep(max(0.0, deadline - time.monotonic()))


_renewer = _Renewer()
