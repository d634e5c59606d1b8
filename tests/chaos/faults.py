"""The faults the chaos injector strikes, as recorded for the report: kinds, weights,
and one ``Fault`` per strike with its wall-clock times (comparable with the step log)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KILL, FREEZE, FLUSHALL, REDIS_RESTART, PG_RESTART, DUPLICATE, PG_CUT, BROKER_CUT = (
    "kill",
    "freeze",
    "flushall",
    "redis-restart",
    "postgres-restart",
    "duplicate",
    "pg-cut",
    "broker-cut",
)
# ``duplicate``: an advance delivered again for live runs, as an at-least-once broker
# may (a message redelivered after a visibility timeout, a re-send racing the original).
# ``pg-cut``/``broker-cut``: every connection of the workers and the sweeper to Postgres
# (or Redis) reset at once by the proxy they reach it through (tests/chaos/proxy.py),
# mid-transaction or not, the server staying up.
WEIGHTS = {
    KILL: 40,
    FREEZE: 15,
    FLUSHALL: 15,
    REDIS_RESTART: 15,
    PG_RESTART: 15,
    DUPLICATE: 15,
    PG_CUT: 15,
    BROKER_CUT: 10,
}

# (run id, step id, epoch): one attempt of one step.
Body = tuple[str, str, int]


@dataclass
class Fault:
    kind: str
    at: float  # wall clock (time.time()), comparable with the step log
    until: float = 0.0
    pid: int | None = None
    detail: str = ""
    # A freeze: the step bodies it caught in flight, and those of them a newer attempt
    # had taken over before the thaw (their writes, if any, must have been fenced).
    caught: list[Body] = field(default_factory=list)
    taken_over: list[Body] = field(default_factory=list)


def fault_dicts(faults: list[Fault]) -> list[dict[str, Any]]:
    return [asdict(f) for f in faults]
