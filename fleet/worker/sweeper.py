"""Re-derives lost wake-ups from the store alone, fires due timers, and hands a kept
signal to its pending wait where both hand-overs missed it.

The broker is a hint: any message may be lost (FLUSHALL, a restart without
persistence, the filesystem transport's worker dying mid-delivery). Each tick claims,
with conditional writes, the steps that are takeable but unanswered (never sent,
lease expired, retry due) and the runs with an unanswered wake-up, and sends them
again. Several sweepers may run; a claim is taken by one of them.

A step whose lease expired while it ran (its worker died or froze) has no message
left in any queue: the worker that died took it. Its re-send is urgent
(``fleet/worker/dispatch.py``: taken before the routine backlog), so a crash stalls
its run for about a lease, however deep the queue. Every other re-send (a step never
taken, a retry due, a run's wake-up) most likely re-sends a message still in line
behind a backlog: it takes its place at the end of the line, as routine, or the
duplicates of a deep backlog would crowd out the crash recoveries.

With ``FLEET_RETENTION`` set, each tick also prunes at most one batch of runs finished
longer ago than that (``fleet/retention.py``): a backlog drains a batch per tick, and
once it is gone the runs table is looked at again only every minute or so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from fleet.errors import FleetError
from fleet.worker.replay import step_shadow
from fleet.worker.retention import RetentionSweep
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.sweeper")


@dataclass
class SweepResult:
    steps: int = 0
    runs: int = 0
    timers: int = 0
    signals: int = 0  # kept signals handed to the pending waits no hand-over met


def sweep_once(rt: Runtime) -> SweepResult:
    result = SweepResult()
    for s in rt.ledger.claim_stalled_steps():
        shadow = step_shadow(s.workflow, s.name)
        rt.dispatcher.execute(s.run_id, s.step_id, s.queue, shadow=shadow, urgent=s.abandoned)
        result.steps += 1
    for run_id, queue in rt.ledger.fire_due_waits():
        rt.dispatcher.advance(run_id, queue)
        result.timers += 1
    for run_id, queue in rt.ledger.stranded_signals():
        if rt.ledger.deliver_signals(run_id):  # a concurrent hand-over may be first
            rt.dispatcher.advance(run_id, queue)
            result.signals += 1
    for run_id, queue in rt.ledger.claim_stalled_runs():
        rt.dispatcher.advance(run_id, queue)
        result.runs += 1
    if result.steps or result.runs or result.timers or result.signals:
        log.info(
            "sweeper re-sent %d step and %d run wake-up(s); %d timer(s) fired; "
            "%d kept signal(s) handed over",
            result.steps,
            result.runs,
            result.timers,
            result.signals,
        )
    return result


def run_sweeper(rt: Runtime, stop: threading.Event | None = None) -> None:
    """Sweep every ``sweep_interval`` seconds until ``stop`` is set."""
    stop = stop or threading.Event()
    interval = rt.settings.sweep_interval
    log.info("sweeper started: every %.2fs, grace %.2fs", interval, rt.settings.sweep_grace)
    retention = None
    if rt.settings.retention is not None:
        retention = RetentionSweep(rt, rt.settings.retention)
        log.info("retention: pruning runs finished over %.0fs ago", rt.settings.retention)
    while not stop.is_set():
        try:
            sweep_once(rt)
            if retention is not None:
                retention.tick()
        except FleetError as exc:  # store restarting: keep going, it is the only truth
            log.warning("sweep failed: %s", exc)
        stop.wait(interval)
