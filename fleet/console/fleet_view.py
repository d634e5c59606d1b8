"""The fleet page (GET ``/fleet``): each queue and its depth, each worker with the steps
it runs and their leases, limits' use (``fleet.worker.gate.uses``, as ``fleet limits``),
and incidents over the last hour by 5 minutes.

The queues are the ones this app's workers consume: the default queue and one per
registered workflow version (``Registry.queues``; the runs are not scanned for them,
so a queue only another app's workflows use is not listed). Depth is the broker's
(``fleet.worker.dispatch.queue_depths``). A broker that cannot be reached is said in
one line at the top, its depths (and the limits' use, when the limiter is on the
broker's Redis) show "unavailable"; the page still shows everything the store knows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response

from fleet.app import Fleet
from fleet.console.render import Console, first_line, page
from fleet.errors import FleetError
from fleet.worker import dispatch
from fleet.worker.gate import uses

log = logging.getLogger("fleet.console")

HOUR = 3600.0
BUCKET = 300.0


def queue_depths(fleet: Fleet, queues: Sequence[str]) -> tuple[dict[str, int | None], str]:
    """Messages waiting on each queue, and "" or, when the broker is unreachable, None
    for each and the line that says so."""
    try:
        return dict(dispatch.queue_depths(fleet.celery, queues)), ""
    except Exception as exc:  # the page shows what the store knows without it
        log.warning("console: the broker's queue depths are unavailable: %s", exc)
        return {queue: None for queue in queues}, unreachable(exc)


def unreachable(exc: Exception) -> str:
    """The one line the page opens with when the broker cannot be reached."""
    reason = first_line(str(exc)) or type(exc).__name__
    return f"the broker is unreachable ({reason}): what the store knows is shown"


def broker_reads(
    fleet: Fleet, queues: Sequence[str]
) -> tuple[dict[str, int | None], list[dict[str, str]] | None, str]:
    """Queue depths and limits' use (``queue_depths``, ``limit_rows``; None where the
    broker could not say) and the line saying the broker is unreachable ("" if not)."""
    depths, down = queue_depths(fleet, queues)
    try:
        limits: list[dict[str, str]] | None = limit_rows(fleet)
    except FleetError:  # the store's (the limiter in the store): its own page
        raise
    except Exception as exc:  # the limiter on the broker's Redis
        log.warning("console: the limits' use is unavailable: %s", exc)
        limits, down = None, down or unreachable(exc)
    return depths, limits, down


def first_bucket(now: float) -> float:
    """The start of the oldest column: the clock-aligned bucket an hour before ``now``."""
    return (now - HOUR) // BUCKET * BUCKET


def incident_table(
    rows: Sequence[tuple[float, str, int]], now: float
) -> tuple[list[float], dict[str, list[int]]]:
    """``(bucket_start, kind, count)`` rows (clock-aligned buckets,
    ``Browse.incidents_by_bucket``) as one row per kind, one column per bucket from
    ``first_bucket(now)`` to the one ``now`` is in (oldest first), zeros where nothing
    happened. A column is labelled by its start: an incident at 00:47:27 is in 00:45."""
    start = first_bucket(now)
    buckets = [start + i * BUCKET for i in range(int(HOUR // BUCKET) + 1)]
    index = {b: i for i, b in enumerate(buckets)}
    kinds: dict[str, list[int]] = {}
    for bucket_start, kind, count in rows:
        i = index.get(float(bucket_start))
        if i is not None:
            kinds.setdefault(str(kind), [0] * len(buckets))[i] += int(count)
    return buckets, dict(sorted(kinds.items()))


def limit_rows(fleet: Fleet) -> list[dict[str, str]]:
    """Each declared limit's use (a per-tenant one: one row per tenant seen): what is
    declared, what is used of it now, how many steps wait for room."""
    declared = fleet.registry.limits
    if not declared:
        return []
    rows = []
    for use in uses(fleet.runtime):
        limit = declared[use.key.partition("#")[0]]
        bounds = [
            (use.running, limit.concurrency, "running"),
            (use.requests, limit.requests_per_minute, "requests/min"),
            (use.tokens, limit.tokens_per_minute, "tokens/min"),
        ]
        rows.append(
            {
                "name": use.key,
                "declared": ", ".join(f"{n:,} {what}" for _, n, what in bounds if n),
                "use": ", ".join(f"{u:,}/{n:,} {what}" for u, n, what in bounds if n),
                "waiting": str(use.waiting),
                "paused": f"{use.paused_for:.0f}s" if use.paused_for > 0 else "",
            }
        )
    return rows


def show(c: Console, request: Request) -> Response:
    # The queues this app's workers consume (as ``fleet worker`` computes them): no
    # scan of the runs for the queues they are on.
    queues = c.fleet.registry.queues(c.fleet.settings.queue)
    now = c.browse.now()  # incidents are dated by the store's clock
    rows = c.browse.incidents_by_bucket(first_bucket(now), BUCKET)
    buckets, incidents = incident_table(rows, now)
    depths, limits, down = broker_reads(c.fleet, queues)
    return page(
        c,
        request,
        "fleet.html",
        broker_down=down,
        depths=depths,
        workers=c.browse.workers(),
        limits=limits,
        buckets=buckets,
        incidents=incidents,
    )
