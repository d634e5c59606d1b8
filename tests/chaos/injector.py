"""The seeded fault injector: at random moments it SIGKILLs a worker (and starts a
replacement), freezes one with step bodies in flight until they are taken over (see
``tests.chaos.freeze``), FLUSHALLs Redis, restarts Redis, restarts Postgres, resets
every connection of the workers to Postgres or Redis (through the proxies,
tests/chaos/proxy.py), and delivers advances again to running runs. Every
fault is recorded with its time."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.crew import Crew
from tests.chaos.faults import (
    BROKER_CUT,
    DUPLICATE,
    FLUSHALL,
    FREEZE,
    KILL,
    PG_CUT,
    PG_RESTART,
    REDIS_RESTART,
    WEIGHTS,
    Fault,
    fault_dicts,
)
from tests.chaos.freeze import Freezer
from tests.chaos.probe import StoreProbe
from tests.chaos.proxy import Proxy
from tests.chaos.services import EmbeddedBroker, EmbeddedStore, PrivatePostgres, PrivateRedis

__all__ = [
    "BROKER_CUT",
    "DUPLICATE",
    "FLUSHALL",
    "FREEZE",
    "KILL",
    "PG_CUT",
    "PG_RESTART",
    "REDIS_RESTART",
    "WEIGHTS",
    "Fault",
    "Injector",
    "Plan",
    "fault_dicts",
]


DUPLICATES = 20  # runs a duplicate delivery sends an advance to, at most


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
        pg: PrivatePostgres | EmbeddedStore,
        redis: PrivateRedis | EmbeddedBroker,
        log: Path,
        probe: StoreProbe,
        say: Callable[[str], None] = print,
        proxies: Mapping[str, Proxy] | None = None,
    ) -> None:
        super().__init__(name="fault-injector", daemon=True)
        self.rng, self.plan, self.crew, self.pg, self.redis = rng, plan, crew, pg, redis
        self.say, self.probe = say, probe
        self.proxies = dict(proxies or {})  # "postgres", "redis": what the workers reach
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
        return Fault(FLUSHALL, at, time.time(), None, self.redis.FLUSHED)

    def _redis_restart(self) -> Fault:
        at = time.time()
        down = self.rng.uniform(0.2, 2.0)
        self.redis.restart(down)
        return Fault(REDIS_RESTART, at, time.time(), None, f"Redis down {down:.1f}s, back empty")

    def _duplicate(self) -> Fault:
        """Deliver an advance again to some running runs (those mid-fan-out, parked on a
        step, or being advanced right now): fleet must treat it as the no-op it is."""
        at = time.time()
        runs = self.probe.running(DUPLICATES) or []
        sent = 0
        for run_id, queue in runs:
            with contextlib.suppress(Exception):  # the broker restarting: fewer sent
                sent += bool(self.probe.client.runtime.dispatcher.advance(run_id, queue))
        return Fault(DUPLICATE, at, time.time(), None, f"an advance sent again to {sent} run(s)")

    def _cut(self, kind: str, what: str) -> Fault:
        proxy = self.proxies.get(what)
        if proxy is None:
            raise RuntimeError(f"{kind}: the workers do not reach {what} through a proxy")
        at = time.time()
        n = proxy.cut()
        return Fault(kind, at, time.time(), None, f"{n} connection(s) to {what} reset")

    def _pg_cut(self) -> Fault:
        return self._cut(PG_CUT, "postgres")

    def _broker_cut(self) -> Fault:
        return self._cut(BROKER_CUT, "redis")

    def _postgres_restart(self) -> Fault:
        at = time.time()
        self.pg.restart()
        until = time.time()
        return Fault(PG_RESTART, at, until, None, f"Postgres restarted in {until - at:.1f}s")
