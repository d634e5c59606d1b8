"""The two Celery tasks. Thin: they check the message's shape and call the engine."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import Celery
from celery.app import trace
from celery.app.trace import LOG_SUCCESS
from celery.signals import celeryd_after_setup, worker_shutdown, worker_shutting_down

from fleet.states import Incident
from fleet.worker import collector, process
from fleet.worker.dispatch import ADVANCE, EXECUTE
from fleet.worker.envelope import Malformed, check_ids, one_line
from fleet.worker.inline import advance_steps, run_steps
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.tasks")


def _ids(args: tuple[Any, ...], task: str) -> tuple[str, ...] | None:
    """The ids a task was sent, or None. The broker's channels have checked this before
    Celery saw the message (fleet.envelope); a task called some other way is checked
    here, by the same limits."""
    try:
        check_ids(task, args)
    except Malformed:
        return None
    return tuple(args)


def _on_shutdown(**_: Any) -> None:
    """Celery's warm shutdown stops taking work and waits for running tasks; they get
    until the soft deadline, then their leases are released and the process leaves."""
    proc = process.current()
    proc.stopping.set()
    runtimes = proc.runtimes()
    if not runtimes:
        return
    grace = min(rt.settings.shutdown_grace for rt in runtimes)

    def deadline() -> None:
        released = proc.release_leases()
        log.warning(
            "shutdown deadline (%.1fs) passed: %d lease(s) released; exiting", grace, released
        )
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(grace, deadline)
    timer.daemon = True
    timer.start()


def _add_workflow_queues(sender: Any, instance: Any, **_: Any) -> None:
    """A plain ``celery -A app worker`` (no ``-Q``) consumes only the default queue, but
    runs go to one queue per workflow version: add those, as ``fleet worker`` does. A
    worker given its own ``-Q`` list keeps it."""
    rt = process.current().runtime_of(instance.app)
    if rt is None:
        return
    queues = instance.app.amqp.queues
    consumed = set(queues.consume_from or queues)
    if consumed == {rt.settings.queue}:
        for name in rt.registry.queues(rt.settings.queue):
            queues.select_add(name)


# The pools that run a worker's tasks in its own process, as threads or greenlets, all
# of them sharing its store connections; prefork's children run one task at a time.
_THREADS_POOL = "celery.concurrency.thread"
_SHARED_POOLS = frozenset(
    {"celery.concurrency.thread", "celery.concurrency.gevent", "celery.concurrency.eventlet"}
)


def _size_store_pool(sender: Any, instance: Any, **_: Any) -> None:
    """A worker running ``--concurrency`` tasks in this process keeps that many store
    connections open, up to ``FLEET_DB_POOL_MAX`` (and a few for its own threads; the
    rest wait their turn in the pool's queue), instead of opening and closing
    connections past the default pool at every peak. On a threads pool whose async
    attempts go on off their slots, one more for each strand: a strand committing
    while every slot holds a connection would otherwise wait for one of theirs."""
    rt = process.current().runtime_of(instance.app)
    pool = getattr(instance.pool_cls, "__module__", None)
    if rt is None or pool not in _SHARED_POOLS:
        return
    size = min(int(instance.concurrency), rt.settings.db_pool_max)
    if pool == _THREADS_POOL and rt.settings.async_awaiting:
        size += rt.settings.async_strands
    rt.db.size_pool(size)
    log.info("store connections: %d for %d concurrent tasks", size, instance.concurrency)


def _start_strands(sender: Any, instance: Any, **_: Any) -> None:
    """On a threads pool, async steps' attempts go on off their slots, as greenlets on
    a few strand threads (fleet/worker/strands.py): an awaiting step holds no thread."""
    rt = process.current().runtime_of(instance.app)
    if rt is None or getattr(instance.pool_cls, "__module__", None) != _THREADS_POOL:
        return
    awaiting, threads = rt.settings.async_awaiting, rt.settings.async_strands
    proc = process.current()
    # On Postgres, on the loop's own thread (fleet/worker/on_loop.py); SQLite's calls
    # cannot wait on the loop: strand threads.
    on_loop = rt.settings.async_on_loop and rt.db.cooperative
    proc.strands.configure(threads, awaiting, proc.loop.current() if on_loop else None)
    if awaiting:
        where = (
            f"on the event loop's thread, {threads} in the store at once"
            if on_loop
            else (f"on {threads} strands")
        )
        log.info("async steps: up to %d awaiting off the slots, %s", awaiting, where)


def _tune_collector(sender: Any, instance: Any, **_: Any) -> None:
    """Once the worker is set up (before a prefork pool forks): freeze what start-up
    built and collect cycles less often (fleet/worker/collector.py)."""
    rt = process.current().runtime_of(instance.app)
    if rt is not None:
        collector.tune(rt.settings.gc_threshold)


def _drain_strands(**_: Any) -> None:
    """Once the pool has stopped (its slots' tasks done), a warm shutdown waits for the
    attempts on the strands too, within the same grace (whose deadline releases the
    leases still held and exits, ``_on_shutdown``)."""
    proc = process.current()
    runtimes = proc.runtimes()
    if not runtimes or not proc.strands.held():
        return
    grace = min(rt.settings.shutdown_grace for rt in runtimes)
    log.info("waiting for %d async attempt(s) off the slots", proc.strands.held())
    proc.strands.drain(grace)


class QuietSuccess(logging.Filter):
    """Rewords Celery's "Task … succeeded in …s: None" line for fleet's tasks as "Task …
    ended in …s". A fleet task returns None however the attempts it ran ended (a failure
    is retried or dead-lettered by fleet itself), so the line called a failed attempt a
    success; fleet logs each attempt's outcome (done, retry, dead letter, fenced), and
    the task's own line says only that the delivery was handled. Another app's tasks in
    the same process keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg is not LOG_SUCCESS:
            return True
        data = getattr(record, "data", None)
        name = data.get("name") if isinstance(data, dict) else None
        if isinstance(name, str) and _fleets(name):
            record.msg = TASK_ENDED
        return True


TASK_ENDED = "Task %(name)s[%(id)s] ended in %(runtime)ss"


def _fleets(task: str) -> bool:
    """Whether ``task`` (a name or the shadow a message gave it) is one of fleet's."""
    if task in (ADVANCE, EXECUTE) or task.startswith("advance:"):
        return True
    return any(
        task.startswith(f"{workflow}.")
        for rt in process.current().runtimes()
        for workflow in rt.registry.workflows
    )


_QUIET = QuietSuccess()


def register(celery: Celery, rt: Runtime) -> None:
    """Bind the tasks to this app only (``shared=False``): Celery's default would bind
    them to every app in the process, so a second Fleet's tasks would reach the first
    Fleet's store."""

    def malformed(task: str, args: tuple[Any, ...]) -> None:
        detail = f"{task} with arguments {one_line(repr(args)[:1000], 200)}"
        log.error("malformed message dropped: %s", detail)
        rt.ledger.incident(Incident.MALFORMED_MESSAGE, None, detail=detail)

    process.current().register(rt, celery)
    process.current().loop.watch(rt.settings.loop_watchdog)
    trace_log = logging.getLogger(trace.__name__)
    if _QUIET not in trace_log.filters:
        trace_log.addFilter(_QUIET)
    # One handler each per process, whatever the number of Fleets (``dispatch_uid``).
    worker_shutting_down.connect(_on_shutdown, weak=False, dispatch_uid="fleet.shutdown")
    celeryd_after_setup.connect(
        _add_workflow_queues, weak=False, dispatch_uid="fleet.workflow_queues"
    )
    celeryd_after_setup.connect(_size_store_pool, weak=False, dispatch_uid="fleet.store_pool")
    celeryd_after_setup.connect(_start_strands, weak=False, dispatch_uid="fleet.strands")
    celeryd_after_setup.connect(_tune_collector, weak=False, dispatch_uid="fleet.collector")
    worker_shutdown.connect(_drain_strands, weak=False, dispatch_uid="fleet.drain_strands")

    @celery.task(name=ADVANCE, ignore_result=True, shared=False)
    def advance_task(*args: Any) -> None:
        ids = _ids(args, ADVANCE)
        if ids is None:
            return malformed(ADVANCE, args)
        advance_steps(rt, ids[0])

    @celery.task(name=EXECUTE, ignore_result=True, shared=False)
    def execute_task(*args: Any) -> None:
        ids = _ids(args, EXECUTE)
        if ids is None:
            return malformed(EXECUTE, args)
        run_steps(rt, ids[0], ids[1])
