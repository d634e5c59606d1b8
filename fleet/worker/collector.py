"""The cyclic garbage collector of a worker process: what start-up built is frozen, and
the young generations are collected less often than the interpreter's default.

Why: a worker holding hundreds of attempts at once (parked greenlets, their coroutines,
live runs' workflows, the caches of histories and messages) has a large heap of
long-lived objects, and the interpreter's default thresholds (700, 10, 10) walk all of
it in a full collection every few seconds. At 500 awaiting ``async def`` steps in one
process (``bench.async_steps``) those collections took 120 ms each, every 2 to 3 s: a
seventh of the process's time, with every thread stopped meanwhile (an attempt of a
1 s await took 1.16 to 1.49 s). ``gc.freeze()`` moves what start-up built (modules,
Celery, SQLAlchemy, the registry) out of every collection's walk, and the thresholds
(``FLEET_GC_THRESHOLD``, 5000, 20, 100 by default) make the young collections rarer
and the full ones rarer still. Nothing is switched off: reference counting frees what
it always did, and cycles are still collected.

Set once per process, in the worker's main process before its pool starts (a prefork
child inherits both the frozen generation and the thresholds).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("fleet.tasks")


def tune(threshold: tuple[int, int, int] | None) -> None:
    """Collect what start-up left, freeze what survives, and set ``threshold`` (None:
    the interpreter's own thresholds are left as they are)."""
    if threshold is None:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*threshold)
    log.info(
        "garbage collector: %d objects of start-up frozen, thresholds %s",
        gc.get_freeze_count(),
        threshold,
    )
