"""The seeded fault injector: at random moments it SIGKILLs a worker (and starts a
replacement), freezes one with step bodies in flight until they are taken over (see
``tests.chaos.freeze``), FLUSHALLs Redis, restarts Redis, and restarts Postgres. Every
fault is recorded with its time."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.crew import Crew
from tests.chaos.faults import (
    FLUSHALL,
    FREEZE,
    KILL,
    PG_RESTART,
    REDIS_RESTART,
    WEIGHTS,
    Fault,
    fault_dicts,
)
from tests.chaos.freeze import Freezer
from tests.chaos.probe import StoreProbe
from tests.chaos.services import PrivatePostgres, PrivateRedis

__all__ = [
    "FLUSHALL",
    "FREEZE",
    "KILL",
    "PG_RESTART",
    "REDIS_RESTART",
    "WEIGHTS",
    "Fault",
    "Injector",
    "Plan",
    "fault_dicts",
]


@dataclass
class Plan:
    """``count`` faults, ``gap`` seconds apart (uniform), every kind at least once; a
    freeze lasts until its steps are taken over, ``freeze_cap`` seconds at most."""

    count: int
    gap: tuple[float, float]
    freeze_cap: float
    kinds: list[str] = field(default_factory=list)

    @classmethod
    def draw(
        cls,
        rng: random.Random,
        count: int,
        gap: tuple[float, float],
        freeze_cap: float,
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
        return cls(count, gap, freeze_cap, (everyone + rest)[:count])


class Injector(threading.Thread):
    def __init__(
        self,
        rng: random.Random,
        plan: Plan,
        crew: Crew,
        pg: PrivatePostgres,
        redis: PrivateRedis,
        log: Path,
        probe: StoreProbe,
        say: Callable[[str], None] = print,
    ) -> None:
        super().__init__(name="fault-injector", daemon=True)
        self.rng, self.plan, self.crew, self.pg, self.redis = rng, plan, crew, pg, redis
        self.say = say
        self.freezer = Freezer(crew, log, probe, rng, plan.freeze_cap, say)
        self.faults: list[Fault] = []
        self.done = threading.Event()  # set by the harness when every run has finished
        self.error: BaseException | None = None

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
        """Stop injecting; continue whatever is frozen and let its zombies write."""
        self.done.set()
        self.join(timeout=120)
        self.freezer.finish()

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
        return self.freezer.strike(self.done)

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
