"""Keeping a running attempt's lease: one heartbeat thread per process renews them all.

A lease expires unless renewed; an attempt that renews it keeps its step from being
taken over. Each attempt holds a ``Heartbeat`` while it runs; the process's ``Beater``
renews every held one when due, and stops renewing one the store says is lost (another
attempt took the step over: the epoch moved on). At shutdown ``release_leases`` gives
the held leases up so another worker takes their steps at once. An attempt parked on
the event loop's own thread (fleet/worker/on_loop.py) lives only as long as that
thread: if it ends with the attempt parked, the attempt can never go on, so its lease
is given up at its next renewal instead of being kept alive by a worker that will
never finish it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from fleet.errors import FleetError
from fleet.store.ledger import Lease
from fleet.worker import strands
from fleet.worker.on_loop import OnLoop
from fleet.worker.replay import step_shadow
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.attempt")

# How often (seconds) a process looks, in one read, for revoked leases of the attempts
# that want to know at once (an async step's task is cancelled then), between renewals.
REVOKE_CHECK = 1.0


class Heartbeat:
    """Keeps one attempt's lease: ``beater`` renews it every third of the lease while
    the attempt runs (one thread for all of a process's attempts, not one per attempt)."""

    def __init__(self, rt: Runtime, lease: Lease, beater: Beater) -> None:
        self.rt = rt
        self.lease = lease
        self._beater = beater
        self.lost = threading.Event()
        self.interval = rt.settings.lease_seconds / 3
        self.due = 0.0  # monotonic time of the next renewal
        # Held while renewing: leaving the attempt waits for a renewal in flight, so
        # none is written after the attempt's own commit.
        self._lock = threading.Lock()
        self._held = False
        # Called once when the store says the lease is lost (an async step's task is
        # cancelled by one); not on ``release``, after which the attempt may still commit.
        self._on_lost: list[Callable[[], object]] | None = []
        self._on_lost_lock = threading.Lock()
        self._on_loop: OnLoop | None = None  # the loop's thread the attempt runs on

    def beat(self) -> bool:
        if self.lost.is_set():
            return False
        try:
            ok = self.rt.ledger.heartbeat(
                self.lease.run_id,
                self.lease.step_id,
                self.lease.epoch,
                self.rt.settings.lease_seconds,
            )
        except FleetError as exc:  # store briefly unreachable: try again next beat
            log.warning("heartbeat for %s failed: %s", self.lease.step_id, exc)
            return True
        if not ok:
            self.lost.set()
            self._fire_lost()
            log.warning(
                "step %s of run %s lost its lease (epoch %d)",
                self.lease.step_id,
                self.lease.run_id,
                self.lease.epoch,
            )
        return ok

    def when_lost(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` as soon as a renewal finds the lease lost (from the thread that
        renewed it), or now if one already has."""
        with self._on_lost_lock:
            waiting = self._on_lost
            if waiting is not None:
                waiting.append(fn)
        if waiting is not None:
            self._beater.watch(self)  # it now looks for a revoked lease every second
        else:
            fn()

    def revoked(self) -> None:
        """The store says the lease is gone (the run cancelled, the step taken over),
        found between renewals: lost, as a failed renewal would have found it."""
        with self._lock:
            if not self._held or self.lost.is_set():
                return
            self.lost.set()
        self._fire_lost()
        log.warning(
            "step %s of run %s lost its lease (epoch %d): revoked",
            self.lease.step_id,
            self.lease.run_id,
            self.lease.epoch,
        )

    def _fire_lost(self) -> None:
        with self._on_lost_lock:
            callbacks, self._on_lost = self._on_lost or [], None
        self._beater.unwatch(self)
        for fn in callbacks:
            try:
                fn()
            except Exception:  # the lease is lost either way; the others still run
                log.exception("acting on the lost lease of %s failed", self.lease.step_id)

    def renew_if_held(self) -> None:
        """The beater's renewal: skipped once the attempt has left; the lease given up
        if the attempt's thread ended with it parked there."""
        if self._on_loop is not None and not self._on_loop.alive and self._held:
            log.error(
                "step %s of run %s: the worker's event loop stopped with the attempt "
                "parked on it; its lease (epoch %d) is given up for another worker",
                self.lease.step_id,
                self.lease.run_id,
                self.lease.epoch,
            )
            self.release()
            return
        with self._lock:
            if self._held and not self.beat():
                self._beater.remove(self)

    def __enter__(self) -> Heartbeat:
        on = strands.current()
        self._on_loop = on if isinstance(on, OnLoop) else None
        self._held = True
        self._beater.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._beater.remove(self)
        with self._lock:
            self._held = False

    def release(self) -> bool:
        """Give the lease up now (shutdown): stop renewing it and let it expire in the
        store, so another worker takes the step at once instead of after the lease."""
        self.lost.set()
        self._beater.remove(self)
        with self._lock:  # a renewal in flight lands before the release, not after
            pass
        return self.rt.ledger.release_lease(self.lease.run_id, self.lease.step_id, self.lease.epoch)


class Beater:
    """One thread per process renews every lease its attempts hold, each when due;
    it is started on first use, and again in a forked child (threads do not survive
    fork). The attempts it holds are also what ``release_leases`` gives up.

    Its work per wake-up does not grow with the attempts held: renewals are kept in a
    heap by when they are due, the watched attempts apart, and an attempt added wakes
    it only if due before it would wake anyway (a worker with 500 steps awaiting adds
    and watches hundreds of attempts a second)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[int, Heartbeat] = {}
        self._watched: dict[int, Heartbeat] = {}
        # (due, n, attempt): an entry whose attempt has left, or was rescheduled, is
        # dropped when it comes up.
        self._queue: list[tuple[float, int, Heartbeat]] = []
        self._n = itertools.count()
        self._pid = 0
        self._next_check = 0.0  # when watched attempts' leases are next looked at
        self._wakes_at = math.inf  # when the waiting thread wakes by itself

    def add(self, hb: Heartbeat) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: a thread of its own
                self._pid = os.getpid()
                self._held.clear()
                self._watched.clear()
                self._queue.clear()
                self._wakes_at = math.inf
                threading.Thread(target=self._loop, name="fleet-heartbeat", daemon=True).start()
            hb.due = time.monotonic() + hb.interval
            self._held[id(hb)] = hb
            heapq.heappush(self._queue, (hb.due, next(self._n), hb))
            if hb.due < self._wakes_at:
                self._cond.notify()

    def watch(self, hb: Heartbeat) -> None:
        """Look for ``hb``'s lease revoked every ``REVOKE_CHECK`` while it is held
        (something waits to hear at once that it is lost: an async step's task)."""
        with self._cond:
            if not self._watched:  # the first: checks begin a second from now
                self._next_check = time.monotonic() + REVOKE_CHECK
                if self._next_check < self._wakes_at:
                    self._cond.notify()
            self._watched[id(hb)] = hb

    def unwatch(self, hb: Heartbeat) -> None:
        with self._cond:
            self._watched.pop(id(hb), None)

    def remove(self, hb: Heartbeat) -> None:
        with self._cond:
            self._held.pop(id(hb), None)
            self._watched.pop(id(hb), None)
            if len(self._queue) > 2 * len(self._held) + 64:  # mostly attempts gone: rebuilt
                self._queue = [(h.due, next(self._n), h) for h in self._held.values()]
                heapq.heapify(self._queue)

    def held(self) -> list[Heartbeat]:
        with self._cond:
            return list(self._held.values())

    def _due(self) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """Wait until some lease is due for renewal, or watched ones for their check;
        those that are, rescheduled."""
        with self._cond:
            while True:
                now = time.monotonic()
                due = []
                queue = self._queue
                while queue and queue[0][0] <= now:
                    when, _, hb = heapq.heappop(queue)
                    if self._held.get(id(hb)) is hb and hb.due == when:
                        due.append(hb)
                check = []
                if self._watched and self._next_check <= now:
                    check = [hb for hb in self._watched.values() if id(hb) in self._held]
                    self._next_check = now + REVOKE_CHECK
                if due or check:
                    for hb in due:
                        hb.due = now + hb.interval
                        heapq.heappush(queue, (hb.due, next(self._n), hb))
                    self._wakes_at = math.inf  # busy: anything added wakes it after
                    return due, check
                soonest = queue[0][0] if queue else now + 60.0
                if self._watched:
                    soonest = min(soonest, self._next_check)
                self._wakes_at = soonest
                self._cond.wait(soonest - now)
                self._wakes_at = math.inf

    def _loop(self) -> None:
        while True:
            due, check = self._due()
            for hb in due:
                try:
                    hb.renew_if_held()
                except Exception:  # never let one renewal stop the others
                    log.exception("renewing the lease of %s failed", hb.lease.step_id)
            try:
                _revoked(check)
            except Exception:  # the next renewal finds it anyway
                log.exception("looking for revoked leases failed")


def _revoked(watched: list[Heartbeat]) -> None:
    """Tell each watched attempt whose lease the store has revoked: one read per store."""
    by_store: dict[int, list[Heartbeat]] = {}
    for hb in watched:
        if not hb.lost.is_set():
            by_store.setdefault(id(hb.rt), []).append(hb)
    for group in by_store.values():
        keys = {hb: (hb.lease.run_id, hb.lease.step_id, hb.lease.epoch) for hb in group}
        held = group[0].rt.queries.leases_held(list(keys.values()))
        for hb, key in keys.items():
            if key not in held:
                hb.revoked()


def release_leases(rt: Runtime, held: Iterable[Heartbeat]) -> int:
    """Release the leases of ``rt``'s running attempts among ``held`` and send their
    steps straight back to the queue. Their own commits, if they still come, are
    accepted only if nobody took over meanwhile (the epoch decides)."""
    released = 0
    for hb in [hb for hb in held if hb.rt is rt]:
        lease = hb.lease
        if hb.release():
            released += 1
            run = rt.queries.run(lease.run_id)
            if run is not None:
                rt.dispatcher.execute(
                    lease.run_id,
                    lease.step_id,
                    run.queue,
                    shadow=step_shadow(run.workflow, lease.name),
                )
            log.warning(
                "released the lease of step %s of run %s (epoch %d) at shutdown",
                lease.step_id,
                lease.run_id,
                lease.epoch,
            )
    return released
