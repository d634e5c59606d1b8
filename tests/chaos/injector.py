"""The seeded fault injector: at random moments it SIGKILLs a worker (and starts a
replacement), SIGSTOPs one past its lease and SIGCONTs it later, FLUSHALLs Redis,
restarts Redis, and restarts Postgres. Every fault is recorded with its time."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.crew import Crew
from tests.chaos.services import PrivatePostgres, PrivateRedis

KILL, FREEZE, FLUSHALL, REDIS_RESTART, PG_RESTART = (
    "kill",
    "freeze",
    "flushall",
    "redis-restart",
    "postgres-restart",
)
WEIGHTS = {KILL: 40, FREEZE: 15, FLUSHALL: 15, REDIS_RESTART: 15, PG_RESTART: 15}


@dataclass
class Fault:
    kind: str
    at: float  # wall clock (time.time()), comparable with the step log
    until: float = 0.0
    pid: int | None = None
    detail: str = ""


@dataclass
class Plan:
    """``count`` faults, ``gap`` seconds apart (uniform), every kind at least once."""

    count: int
    gap: tuple[float, float]
    freeze_for: float
    kinds: list[str] = field(default_factory=list)

    @classmethod
    def draw(
        cls,
        rng: random.Random,
        count: int,
        gap: tuple[float, float],
        freeze_for: float,
        kinds: list[str] | None = None,
    ) -> Plan:
        """Each of ``kinds`` (default: all) once in a random order, then drawn by weight."""
        chosen = kinds or list(WEIGHTS)
        unknown = set(chosen) - set(WEIGHTS)
        if unknown:
            raise ValueError(f"unknown fault kind(s) {sorted(unknown)}; known: {list(WEIGHTS)}")
        everyone = list(chosen)
        rng.shuffle(everyone)
        weights = [WEIGHTS[k] for k in chosen]
        rest = rng.choices(chosen, weights=weights, k=max(0, count - len(everyone)))
        return cls(count, gap, freeze_for, (everyone + rest)[:count])


def in_flight(log: Path, pid: int) -> list[dict[str, Any]]:
    """Step bodies ``pid`` has started and not ended, from the step log."""
    open_: dict[tuple[str, str, int], dict[str, Any]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            e = json.loads(line)
            if e["pid"] != pid:
                continue
            key = (e["run"], e["step"], e["epoch"])
            if e["event"] == "start":
                open_[key] = e
            else:
                open_.pop(key, None)
    return list(open_.values())


class Injector(threading.Thread):
    def __init__(
        self,
        rng: random.Random,
        plan: Plan,
        crew: Crew,
        pg: PrivatePostgres,
        redis: PrivateRedis,
        log: Path,
        say: Callable[[str], None] = print,
    ) -> None:
        super().__init__(name="fault-injector", daemon=True)
        self.rng, self.plan, self.crew, self.pg, self.redis, self.log = (
            rng,
            plan,
            crew,
            pg,
            redis,
            log,
        )
        self.say = say
        self.faults: list[Fault] = []
        self.done = threading.Event()  # set by the harness when every run has finished
        self.error: BaseException | None = None
        self._thaws: list[threading.Timer] = []

    def run(self) -> None:
        try:
            for kind in self.plan.kinds:
                if self.done.wait(self.rng.uniform(*self.plan.gap)):
                    return
                fault = getattr(self, "_" + kind.replace("-", "_"))()
                self.faults.append(fault)
                self.say(f"  fault {len(self.faults):>3} {fault.kind:<16} {fault.detail}")
        except BaseException as exc:  # reported by the harness: a fault it could not inject
            self.error = exc

    def finish(self) -> None:
        """Stop injecting and thaw whatever is still frozen."""
        self.done.set()
        self.join(timeout=120)
        for timer in self._thaws:
            timer.cancel()
        for slot in list(self.crew.frozen):
            self.crew.thaw(slot)

    def _slot(self) -> int:
        free = [i for i in range(len(self.crew.slots)) if i not in self.crew.frozen]
        return self.rng.choice(free or list(range(len(self.crew.slots))))

    def _kill(self) -> Fault:
        slot = self._slot()
        at = time.time()
        pid = self.crew.kill(slot)
        self.crew.frozen.discard(slot)
        time.sleep(self.rng.uniform(0.0, 1.0))
        new = self.crew.replace(slot)
        return Fault(KILL, at, time.time(), pid, f"worker pid {pid} killed; pid {new} started")

    def _freeze(self) -> Fault:
        # One worker frozen at a time: the others must be free to take its steps over,
        # or no takeover (and no zombie write to fence) can happen while it sleeps.
        deadline = time.monotonic() + self.plan.freeze_for + 10.0
        while self.crew.frozen and time.monotonic() < deadline:
            if self.done.wait(0.1):
                break
        busy = [
            i
            for i, p in enumerate(self.crew.slots)
            if i not in self.crew.frozen and in_flight(self.log, p.pid)
        ]
        slot = self.rng.choice(busy) if busy else self._slot()
        at = time.time()
        pid = self.crew.freeze(slot)
        timer = threading.Timer(self.plan.freeze_for, self.crew.thaw, args=(slot,))
        timer.daemon = True
        timer.start()
        self._thaws.append(timer)
        steps = len(in_flight(self.log, pid))
        return Fault(
            FREEZE,
            at,
            at + self.plan.freeze_for,
            pid,
            f"worker pid {pid} frozen for {self.plan.freeze_for:.1f}s "
            f"with {steps} step(s) in flight",
        )

    def _flushall(self) -> Fault:
        at = time.time()
        self.redis.flushall()
        return Fault(FLUSHALL, at, time.time(), None, "every queued and unacked message lost")

    def _redis_restart(self) -> Fault:
        at = time.time()
        down = self.rng.uniform(0.2, 2.0)
        self.redis.restart(down)
        return Fault(REDIS_RESTART, at, time.time(), None, f"Redis down {down:.1f}s, back empty")

    def _postgres_restart(self) -> Fault:
        at = time.time()
        self.pg.restart()
        until = time.time()
        return Fault(PG_RESTART, at, until, None, f"Postgres restarted in {until - at:.1f}s")


def fault_dicts(faults: list[Fault]) -> list[dict[str, Any]]:
    return [asdict(f) for f in faults]
