"""``fleet`` commands that keep the fleet running: the long-lived processes (worker,
sweeper, metrics), the store's schema, dead letters, and retention. ``fleet.ops.cli``
names them.

The rule: a long-lived process checks every option before it starts anything, and
only a worker or a sweeper may create the embedded store.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import replace
from typing import Annotated, Any

import typer

from fleet import codec
from fleet.app import Fleet
from fleet.bounds import INT32, whole
from fleet.errors import BadInput
from fleet.logs import setup_logging
from fleet.ops.cli_common import (
    AppOpt,
    LogLevelOpt,
    actor,
    check_broker,
    check_loglevel,
    console,
    guard,
    open_fleet,
    positive,
    say,
)
from fleet.ops.loader import load_fleet
from fleet.ops.render import dead_letter_view, dead_letters_table
from fleet.records import DeadLetterInfo
from fleet.registry import check_queue_part
from fleet.worker.sweeper import run_sweeper

MIN_RATE, MAX_RATE = 0.01, 1000.0  # dead letters replayed a second with --all
MAX_CONCURRENCY = 10_000  # a worker's slots: threads, processes or greenlets


def _until_signalled() -> threading.Event:
    """An event set by SIGTERM or SIGINT: a process stops at its next tick."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


# --- processes --------------------------------------------------------------------------


def worker(
    app_: AppOpt = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c")] = 2,
    queues: Annotated[str | None, typer.Option("--queues", "-Q")] = None,
    pool: Annotated[str, typer.Option(help="prefork | threads | solo | gevent")] = "threads",
    loglevel: LogLevelOpt = "INFO",
    task_events: Annotated[
        bool,
        typer.Option(
            "--task-events",
            "-E",
            help="send Celery task events from the start (Flower turns them on when it watches)",
        ),
    ] = False,
) -> None:
    """Start a Celery worker that advances runs and executes steps."""
    guard(lambda: check_worker_options(concurrency, pool, loglevel, queues))
    fleet = guard(lambda: _started(open_fleet(app_, schema=False)))
    setup_logging(loglevel, fleet.settings.log_format)
    argv = [
        "worker",
        f"--loglevel={loglevel}",
        f"--concurrency={concurrency}",
        f"--pool={pool}",
        f"--queues={queues or ','.join(worker_queues(fleet))}",
        "--without-mingle",
        "--without-gossip",
    ]
    if task_events:
        argv.append("--task-events")
    if fleet.settings.worker_name:
        argv.append(f"--hostname={fleet.settings.worker_name}@%h")
    raise typer.Exit(run_celery(fleet, argv))


def worker_queues(fleet: Fleet) -> list[str]:
    """The default queue and one per registered workflow version (see WorkflowDef.queue)."""
    return fleet.registry.queues(fleet.settings.queue)


def run_celery(fleet: Fleet, argv: list[str]) -> int:
    """``celery ARGV`` on the fleet's app, and its exit code. Not ``worker_main`` (nor
    ``Celery.start``), which drop it: a worker ended by an unrecoverable error must
    exit non-zero so that its supervisor restarts it."""
    from celery.bin.celery import celery as celery_command

    celery_command.params[0].default = fleet.celery  # what Celery.start does
    try:
        code = celery_command.main(args=argv, standalone_mode=False)
    finally:
        celery_command.params[0].default = None
    return code if isinstance(code, int) else 0


def check_worker_options(
    concurrency: int, pool: str, loglevel: str, queues: str | None = None
) -> None:
    from celery.concurrency import get_available_pool_names

    whole(concurrency, "--concurrency", low=1, high=MAX_CONCURRENCY)
    for queue in (queues or "").split(",") if queues else ():
        check_queue_part(queue.strip(), "--queues names a queue:", 255)
    pools = get_available_pool_names()
    if pool not in pools:
        raise BadInput(f"--pool {pool!r}: one of {', '.join(pools)}")
    check_loglevel(loglevel)


def sweeper(
    app_: AppOpt = None,
    interval: Annotated[float | None, typer.Option(help="seconds between sweeps")] = None,
    loglevel: LogLevelOpt = "INFO",
) -> None:
    """Re-derive lost wake-ups, expired leases and due retries from the store."""
    if interval is not None:
        guard(lambda: positive(interval, "--interval"))
    guard(lambda: check_loglevel(loglevel))
    fleet = guard(lambda: _sweeper_fleet(app_, interval))
    setup_logging(loglevel, fleet.settings.log_format)
    run_sweeper(fleet.runtime, _until_signalled())


def _sweeper_fleet(target: str | None, interval: float | None) -> Fleet:
    """The app's Fleet; with ``--interval``, its workflows bound to settings that say
    so, built here once (nothing downstream holds a copy to rebind). Long-running like
    a worker: it may create the embedded store."""
    fleet = load_fleet(target)
    if interval is not None:
        fleet = fleet.with_settings(replace(fleet.settings, sweep_interval=interval))
    return _started(fleet)


def _started(fleet: Fleet) -> Fleet:
    """A long-lived process's Fleet: its broker URL checked before anything is made, then
    its store checked, the embedded one created (only a worker or a sweeper may)."""
    check_broker(fleet)
    fleet.ensure_schema(create=True)
    return fleet


def metrics(
    port: Annotated[int, typer.Option(help="serve /metrics on this port")] = 9808,
    address: Annotated[
        str, typer.Option(help="listen address (0.0.0.0: every interface)")
    ] = "127.0.0.1",
    app_: AppOpt = None,
    loglevel: LogLevelOpt = "INFO",
) -> None:
    """Serve the fleet's figures in Prometheus format, read from the store at scrape time."""
    guard(lambda: check_port(port))
    guard(lambda: check_loglevel(loglevel))
    fleet = guard(lambda: open_fleet(app_))
    setup_logging(loglevel, fleet.settings.log_format)
    server = guard(lambda: _serve_metrics(fleet, address, port))
    logging.getLogger("fleet.metrics").info("serving /metrics on %s:%d", address, port)
    _until_signalled().wait()
    server.shutdown()


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise BadInput(f"--port must be 1-65535, got {port}")


def _serve_metrics(fleet: Fleet, address: str, port: int) -> Any:
    from prometheus_client import CollectorRegistry, start_http_server

    from fleet.ops.metrics import FleetCollector

    registry = CollectorRegistry()
    registry.register(FleetCollector(fleet))
    try:
        server, _thread = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:  # in use, not an address of this machine
        raise BadInput(
            f"cannot serve /metrics on {address}:{port}: {exc.strerror or exc}"
        ) from None
    return server


# --- the store's schema -----------------------------------------------------------------


def db_upgrade(app_: AppOpt = None) -> None:
    """Create or migrate the schema to the newest revision."""

    def body() -> None:
        fleet = open_fleet(app_, schema=False)
        fleet.upgrade_schema()
        console.print("schema is up to date")

    guard(body)


# --- dead letters -----------------------------------------------------------------------


def dlq_list(
    workflow: Annotated[str | None, typer.Option(help="only this workflow's")] = None,
    run: Annotated[str | None, typer.Option(help="only this run's")] = None,
    replayed: Annotated[bool, typer.Option(help="include those already replayed")] = False,
    app_: AppOpt = None,
) -> None:
    """A table of dead letters, oldest first."""
    guard(
        lambda: console.print(
            dead_letters_table(open_fleet(app_).dead_letters(run, workflow, replayed))
        )
    )


def dlq_show(letter_id: int, app_: AppOpt = None) -> None:
    """Everything about one dead letter: input, error, traceback, attempts, times."""

    def body() -> None:
        whole(letter_id, "dead letter id", low=1, high=INT32)
        fleet = open_fleet(app_)
        letter = fleet.runtime.queries.dead_letter(letter_id)
        if letter is None:
            raise BadInput(f"unknown dead letter {letter_id}")
        console.print(
            dead_letter_view(DeadLetterInfo.from_row(letter, fleet.runtime.payloads.load))
        )

    guard(body)


def dlq_replay(
    letter_id: Annotated[int | None, typer.Argument(help="the dead letter's id")] = None,
    input_: Annotated[
        str | None,
        typer.Option("--input", help='new input: JSON list of arguments or {"args":…, "kwargs":…}'),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="every outstanding dead letter")] = False,
    workflow: Annotated[str | None, typer.Option(help="with --all: only this workflow's")] = None,
    rate: Annotated[float, typer.Option(help="with --all: at most this many per second")] = 10.0,
    app_: AppOpt = None,
) -> None:
    """Re-run a dead-lettered step with a fresh attempt budget; its run resumes there."""

    def body() -> None:
        if all_ == (letter_id is not None):
            raise BadInput("give one dead letter id, or --all")
        if all_ and input_ is not None:
            raise BadInput("--input goes with one dead letter id, not --all")
        if letter_id is not None:
            whole(letter_id, "dead letter id", low=1, high=INT32)
        check_rate(rate)
        fleet = open_fleet(app_)
        if letter_id is not None:
            kwargs = (
                {} if input_ is None else {"input": codec.parse_json_arg(input_, what="--input")}
            )
            run = fleet.replay(letter_id, **kwargs, by=actor())
            say(f"replayed dead letter {letter_id}; run {run.id} resumes")
            return
        letters = fleet.dead_letters(workflow=workflow)
        for i, letter in enumerate(letters):
            if i:
                time.sleep(1.0 / rate)
            fleet.replay(letter.id, by=actor())
            say(f"replayed dead letter {letter.id} ({letter.run_id} {letter.step_id})")
        say(f"{len(letters)} dead letter(s) replayed")

    guard(body)


def check_rate(rate: float) -> float:
    """``--rate``: replays a second, from one a 100 seconds to a thousand a second (a
    rate below would leave the command sleeping for days between two replays)."""
    if not (MIN_RATE <= rate <= MAX_RATE):  # NaN fails both comparisons
        raise BadInput(f"--rate must be between {MIN_RATE} and {MAX_RATE} per second, got {rate}")
    return rate


# --- retention --------------------------------------------------------------------------


def prune(
    finished_before: Annotated[
        str,
        typer.Option(
            "--finished-before",
            help="delete runs finished longer ago than this: 30d, 12h, 90m, 45s",
        ),
    ],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="count what would go")] = False,
    batch: Annotated[int, typer.Option(help="runs per transaction")] = 200,
    app_: AppOpt = None,
) -> None:
    """Delete finished runs and everything of theirs; live runs are never touched."""
    from fleet.durations import parse_duration

    def body() -> None:
        age = parse_duration(finished_before, "--finished-before")
        whole(batch, "--batch", low=1, high=INT32)
        result = open_fleet(app_).prune(age, dry_run=dry_run, batch=batch)
        rows = ", ".join(
            f"{n} {name.replace('_', ' ')}"
            for name, n in result.counts().items()
            if name not in ("runs", "kept")
        )
        verb = "would prune" if dry_run else "pruned"
        say(f"{verb} {result.runs} run(s) finished over {finished_before.strip()} ago: {rows}")
        if result.kept:
            say(
                f"kept {result.kept} failed run(s) with a dead letter not yet replayed "
                "(`fleet dlq list`: replay or leave them)"
            )
        if dry_run:
            say("dry run: nothing was deleted")

    guard(body)
