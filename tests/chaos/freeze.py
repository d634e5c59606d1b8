"""The freeze fault, built so that every freeze tests the fence. A worker caught with
step bodies in flight is stopped (SIGSTOP) and continued (SIGCONT) only once a newer
attempt has taken every caught step over (or ``AFTER_FIRST`` after the first takeover),
so each caught body wakes as a zombie and writes after its lease has gone, while its
successor still runs: the write the epoch fence must refuse. A freeze whose steps are
not taken over within the cap is continued anyway.

A fixed-length freeze did not do that: behind a deep queue the re-sent step often
waited longer than the freeze (the zombie then committed legitimately), a worker frozen
between two step bodies held nothing to fence, and a worker still frozen when the runs
ended was killed by the harness before it could write. So: one worker is frozen at a
time (the others must be free to take its steps over), only with bodies in flight and
outside any transaction (a worker stopped inside one holds row locks that stall the
sweeper itself, so nothing is re-sent until the thaw), and before the harness stops
the crew ``finish`` continues every worker and waits until each caught body has
written or its process is gone.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from tests.chaos.checks import read_lines
from tests.chaos.crew import Crew
from tests.chaos.faults import FREEZE, Body, Fault
from tests.chaos.probe import UNREPORTED, StoreProbe
from tests.chaos.programs import CONC_LIMIT

CATCH_WITHIN = 15.0  # how long a freeze looks for a worker with a step body in flight
# …and for how much of that it waits for one with a body inside a concurrency limit
# (whose zombie's late release must not free the slot its successor holds), before it
# takes any worker with a body in flight.
HOLDER_FIRST = 5.0
REPORT_WITHIN = 20.0  # how long ``finish`` waits for the continued zombies to write
# Once one caught step has been taken over, how long the others have to follow before
# the thaw: a caught step may never be (its run cancelled meanwhile), and waiting for
# it out the cap lets every taken-over step's new attempt commit first, so the zombies
# would wake to settled steps instead of to running successors.
AFTER_FIRST = 0.2
# A caught body inside a concurrency limit may wait in the limit's line before it is
# taken over; once another caught step has been, it is waited for this long at most.
HOLDER_WAIT = 10.0


def in_flight(log: Path) -> dict[int, list[Body]]:
    """Each pid's step bodies started and not ended, from the step log."""
    open_: dict[int, dict[Body, None]] = defaultdict(dict)
    if log.exists():
        for line in log.read_text().splitlines():
            e = json.loads(line)
            body = (e["run"], e["step"], e["epoch"])
            if e["event"] == "start":
                open_[e["pid"]][body] = None
            elif e["event"] == "end":
                open_[e["pid"]].pop(body, None)
    return {pid: list(bodies) for pid, bodies in open_.items() if bodies}


def limit_bodies(path: Path, limit: str = CONC_LIMIT) -> dict[Body, int]:
    """The step bodies inside the concurrency ``limit`` now (entered, not left), each
    with its pid, from the limit log the program workload's limited steps write (none
    if there is none)."""
    inside: dict[tuple[Body, int], int] = defaultdict(int)
    for e in read_lines(path):
        if e.get("limit") == limit:
            inside[((e["run"], e["step"], e["epoch"]), e["pid"])] += (
                1 if e["event"] == "enter" else -1
            )
    return {body: pid for (body, pid), n in inside.items() if n > 0}


def inside_limits(path: Path, limit: str = CONC_LIMIT) -> set[int]:
    """The pids with a step body inside the concurrency ``limit`` now."""
    return set(limit_bodies(path, limit).values())


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped, or gone (the process or the thread)."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state not in ("T", "t", "Z", "X"):
                return False
    except OSError:
        return True
    return True


class Freezer:
    def __init__(
        self,
        crew: Crew,
        log: Path,
        probe: StoreProbe,
        rng: random.Random,
        cap: float,
        say: Callable[[str], None] = print,
    ) -> None:
        self.crew, self.log, self.probe, self.rng, self.cap, self.say = (
            crew,
            log,
            probe,
            rng,
            cap,
            say,
        )
        self.freezes: list[Fault] = []
        self.let_go_in_transaction = 0  # workers stopped inside a transaction, let go
        self._finishing = threading.Event()
        self._watchers: list[threading.Thread] = []

    def strike(self, stop: threading.Event) -> Fault:
        """Freeze a worker with step bodies in flight (after the previous freeze has
        thawed); a watcher thread continues it after the takeover."""
        deadline = time.monotonic() + self.cap + 10.0
        while self.crew.frozen and time.monotonic() < deadline:
            if stop.wait(0.1):
                break
        at, let_go = time.time(), self.let_go_in_transaction
        caught = self._catch(stop)
        let_go = self.let_go_in_transaction - let_go
        note = f" ({let_go} caught inside a transaction let go first)" if let_go else ""
        if caught is None:
            return Fault(
                FREEZE, at, at, None, f"no worker had a step body in flight: none frozen{note}"
            )
        slot, pid, bodies = caught
        holding = set(limit_bodies(self.log.parent / "limits.jsonl")) & set(bodies)
        fault = Fault(
            FREEZE,
            time.time(),
            pid=pid,
            detail=f"worker pid {pid} frozen with {len(bodies)} step(s) in flight{note}",
            caught=sorted(bodies),
        )
        self.freezes.append(fault)
        watcher = threading.Thread(
            target=self._watch, args=(slot, fault, holding), name=f"thaw-{pid}", daemon=True
        )
        self._watchers.append(watcher)
        watcher.start()
        return fault

    def _catch(self, stop: threading.Event) -> tuple[int, int, list[Body]] | None:
        """SIGSTOP a worker that has step bodies in flight and no open transaction; the
        slot, pid and bodies."""
        start = time.monotonic()
        deadline = start + CATCH_WITHIN
        while time.monotonic() < deadline and not stop.is_set():
            open_ = in_flight(self.log)
            busy = [
                i
                for i, p in enumerate(self.crew.slots)
                if i not in self.crew.frozen and open_.get(p.pid)
            ]
            # A worker holding a limit's slot first: its zombie's late release must not
            # free the slot its successor holds (the limiter's token).
            limited = inside_limits(self.log.parent / "limits.jsonl")
            holding = [i for i in busy if self.crew.slots[i].pid in limited]
            if not holding and time.monotonic() < start + HOLDER_FIRST:
                busy = []  # look again for a limit's holder a while first
            if busy:
                slot = self.rng.choice(holding or busy)
                pid = self.crew.freeze(slot)
                settle = time.monotonic() + 2.0
                while not _stopped(pid) and time.monotonic() < settle:
                    time.sleep(0.005)
                bodies = in_flight(self.log).get(pid)
                # A worker stopped inside a transaction keeps the rows it wrote locked,
                # and every transaction touching them waits for it, the sweeper's too:
                # nothing is re-sent, so no takeover happens until the thaw. Let it go
                # and look again.
                sessions = self.probe.in_transaction(self.crew.slots[slot].name) if bodies else None
                if bodies and sessions == 0:
                    return slot, pid, bodies
                if sessions:
                    self.let_go_in_transaction += 1
                self.crew.thaw(slot)
            stop.wait(0.05)
        return None

    def _watch(self, slot: int, fault: Fault, holding: set[Body]) -> None:
        """Continue the worker as soon as every caught step has been taken over (the
        zombie whose step was taken last then writes while the new attempt still runs:
        only the epoch can refuse that write), after the cap, or when the harness
        finishes. A caught body ``holding`` a concurrency slot is waited for first: its
        successor holds the slot then, and the zombie's late release must not free it."""
        give_up = time.monotonic() + self.cap
        seen: set[Body] = set()
        first: float | None = None  # when the first caught step was seen taken over
        while not self._finishing.is_set() and time.monotonic() < give_up:
            seen = self.probe.taken_over(fault.caught) or seen
            if len(seen) == len(fault.caught):
                break
            if seen:  # the rest have AFTER_FIRST seconds to follow (a holder, longer)
                first = first or time.monotonic()
                if holding <= seen:
                    give_up = min(give_up, time.monotonic() + AFTER_FIRST)
                else:
                    give_up = min(give_up, first + HOLDER_WAIT)
            self._finishing.wait(0.05)
        # Read last thing before the SIGCONT. Epochs only grow, so a step seen taken
        # over here was taken over before the zombie could write.
        seen = self.probe.taken_over(fault.caught) or seen
        fault.taken_over = sorted(seen)
        self.crew.thaw(slot)
        fault.until = time.time()
        self.say(
            f"      thawed pid {fault.pid} after {fault.until - fault.at:.1f}s: "
            f"{len(seen)} of {len(fault.caught)} caught step(s) taken over"
        )

    def finish(self) -> None:
        """Continue every frozen worker now, then wait until each body a freeze caught
        has written (its attempt is closed in the store) or its process is gone: the
        harness's stop kills the workers, and a zombie killed before writing proves
        nothing about the fence."""
        self._finishing.set()
        for watcher in self._watchers:
            watcher.join(timeout=30)
        for slot in list(self.crew.frozen):
            self.crew.thaw(slot)
        deadline = time.monotonic() + REPORT_WITHIN
        waiting: list[Body] = []
        while time.monotonic() < deadline:
            bodies = [b for f in self.freezes if self.crew.alive(f.pid) for b in f.caught]
            outcomes = self.probe.outcomes(bodies)
            waiting = bodies
            if outcomes is not None:
                waiting = [b for b, outcome in outcomes.items() if outcome in UNREPORTED]
                if not waiting:
                    return
            time.sleep(0.1)
        self.say(
            f"  {len(waiting)} caught step(s) had not written {REPORT_WITHIN:.0f}s "
            f"after the thaw: {waiting[:3]}"
        )
