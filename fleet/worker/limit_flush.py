"""The Redis limiter after its Redis lost its keys (FLUSHDB, FLUSHALL, a restart without
persistence): the concurrency slots held then are made again from the store's leases
before anyone else is let in (``fleet/worker/limiter.py``).

The rule: a concurrency slot is given only while Redis holds the key ``SENTINEL``. Its
absence (a flush, or a Redis the fleet never used) makes the acquire script answer
"restore" instead of deciding. The worker then reads from the store every step running
under a live lease whose definition names a concurrency limit (``Queries.leased_steps``:
the store's clock, so a lapsed lease counts for nothing) and, in one script, gives each
its slot again, owned by ``RESTORED`` (the delivery holding it claims it at its next
renewal; any delivery of that step may give it back), and sets the sentinel; then it
asks again. A step's slot outlives a flush as its lease does: at most a lease, if its
worker is gone.

Not made again: the calls of rated limits' last minute (their windows start afresh, so
up to one more window's worth may pass just after a flush), a 429's pause (it ends
early), the waiting lines (each waiting step comes back at its countdown). A step whose
room was taken before the flush but whose lease is written only after the store was
read (a few milliseconds) runs without its slot; so do the steps of an app whose
workflows the restoring worker does not have registered (they hold no slot until their
next attempt).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from fleet.worker.runtime import Runtime

SENTINEL = "fleet:limits:alive"
# The owner of a slot made again, until the delivery holding it renews it.
RESTORED = "?"

# ARGV: ttl ms, then (key, holder) pairs: each holder's slot on key, unless it has one.
RESTORE = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, n = tonumber(ARGV[1]), 0
for i = 2, #ARGV, 2 do
  local key, holder = ARGV[i], ARGV[i + 1]
  if redis.call('HSETNX', 'fleet:limit:' .. key .. ':owners', holder, '{RESTORED}') == 1 then
    redis.call('ZADD', 'fleet:limit:' .. key .. ':slots', now + ttl, holder)
    redis.call('SADD', 'fleet:limits', key)
    n = n + 1
  end
end
redis.call('SET', '{SENTINEL}', '1')
return n
"""

# Held slots: (limit key, run id, step id) of each.
Held = Callable[[], Iterable[tuple[str, str, str]]]


def holder(run_id: str, step_id: str) -> str:
    """Who holds a slot, in Redis: the step (each delivery of it has its own token)."""
    return f"{run_id}\x1f{step_id}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def held_slots(rt: Runtime) -> list[tuple[str, str, str]]:
    """(limit key, run id, step id) of each concurrency slot the steps running under a
    live lease hold, as the store says: each step's limits by its definition here."""
    limits = rt.registry.limits
    named = {
        name: [limits[n] for n in sd.limits if n in limits and limits[n].concurrency]
        for name, sd in rt.registry.steps.items()
        if sd.limits
    }
    rows = rt.queries.leased_steps([name for name, held in named.items() if held])
    return [
        (limit.key(tenant), run_id, step_id)
        for run_id, step_id, name, tenant in rows
        for limit in named.get(name, [])
    ]


def held_by(rt: Runtime) -> Held:
    """``held_slots`` of ``rt``, for as long as it lives (the limiter is kept per runtime,
    weakly: it must not keep its runtime alive)."""
    ref = weakref.ref(rt)

    def held() -> list[tuple[str, str, str]]:
        found = ref()
        return held_slots(found) if found is not None else []

    return held


def restore(script: Any, held: Held | None, ttl_ms: int) -> int:
    """Give every held slot back its place (none known without ``held``) and set the
    sentinel, in one script; how many slots were made again."""
    args: list[Any] = [ttl_ms]
    for key, run_id, step_id in held() if held is not None else ():
        args += [key, holder(run_id, step_id)]
    return int(script(args=args))


def answered(ask: Callable[[], Any], script: Any, held: Held | None, ttl_ms: int) -> Any:
    """The acquire script's answer (``ask``), once the held slots are restored if it
    said "restore" (again, at most twice more, if Redis was flushed again meanwhile)."""
    found = ask()
    for _ in range(3):
        if found == 0 or text(found[2]) != "restore":
            break
        restore(script, held, ttl_ms)
        found = ask()
    return found
