"""The ``fleet`` command line (Typer + Rich). Exit codes: 0 success; 1 the run or
command failed; 2 bad usage or bad input, with one line naming what was wrong."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from fleet import codec
from fleet.app import Fleet
from fleet.errors import BadInput
from fleet.logs import setup_logging
from fleet.ops.cli_common import AppOpt, console, err, guard
from fleet.ops.cli_messages import messages_app
from fleet.ops.loader import load_fleet
from fleet.ops.render import (
    as_json,
    clip,
    dead_letter_view,
    dead_letters_table,
    one_line,
    run_view,
    runs_table,
)
from fleet.records import DeadLetterInfo
from fleet.states import RunStatus
from fleet.worker.sweeper import run_sweeper

app = typer.Typer(
    help="fleet: durable execution for long, multi-step agent runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="The store's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
dlq_app = typer.Typer(help="Dead-lettered steps: list, show, replay.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")
app.add_typer(messages_app, name="messages")


def say(*parts: str | tuple[str, str], to: Console = console) -> None:
    """Print a message whose values are literal text (``(text, style)`` for a styled part)."""
    to.print(
        Text.assemble(
            *(one_line(p) if isinstance(p, str) else (one_line(p[0]), p[1]) for p in parts)
        ),
        soft_wrap=True,
    )


def _fleet(target: str | None, *, schema: bool = True, create: bool = False) -> Fleet:
    """The app's Fleet, its store checked. Only ``create`` (worker, sweeper) may create
    the embedded store; every read and operator command finds it as it is."""
    fleet = load_fleet(target)
    if schema:
        fleet.ensure_schema(create=create)
    return fleet


def positive(value: float, option: str) -> float:
    """A finite number above zero, or one line naming the option (NaN passes ``<= 0``)."""
    if not math.isfinite(value) or value <= 0:
        raise BadInput(f"{option} must be a positive number, got {value}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL")


def check_loglevel(loglevel: str) -> str:
    if loglevel.upper() not in LOG_LEVELS:
        raise BadInput(f"--loglevel {loglevel!r}: one of {', '.join(LOG_LEVELS)}")
    return loglevel


def worker_queues(fleet: Fleet) -> list[str]:
    """The default queue and one per registered workflow version (see WorkflowDef.queue)."""
    return fleet.registry.queues(fleet.settings.queue)


@app.command()
def demo(
    keep: Annotated[bool, typer.Option(help="keep the state in ./.fleet for `fleet runs`")] = False,
    database_url: Annotated[
        str | None, typer.Option(help="a Postgres URL instead of SQLite")
    ] = None,
    broker_url: Annotated[
        str | None, typer.Option(help="a Redis URL instead of the filesystem")
    ] = None,
) -> None:
    """The research agent end to end: a worker killed mid-run, the run resumed."""
    from fleet.ops.demo import run_demo

    code = guard(
        lambda: run_demo(console, keep=keep, database_url=database_url, broker_url=broker_url)
    )
    raise typer.Exit(code)


@app.command()
def worker(
    app_: AppOpt = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c")] = 2,
    queues: Annotated[str | None, typer.Option("--queues", "-Q")] = None,
    pool: Annotated[str, typer.Option(help="prefork | threads | solo | gevent")] = "threads",
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
) -> None:
    """Start a Celery worker that advances runs and executes steps."""
    guard(lambda: check_worker_options(concurrency, pool, loglevel))
    fleet = guard(lambda: _fleet(app_, create=True))
    setup_logging(loglevel)
    argv = [
        "worker",
        f"--loglevel={loglevel}",
        f"--concurrency={concurrency}",
        f"--pool={pool}",
        f"--queues={queues or ','.join(worker_queues(fleet))}",
        "--without-mingle",
        "--without-gossip",
    ]
    if fleet.settings.worker_name:
        argv.append(f"--hostname={fleet.settings.worker_name}@%h")
    raise typer.Exit(run_celery(fleet, argv))


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


def check_worker_options(concurrency: int, pool: str, loglevel: str) -> None:
    from celery.concurrency import get_available_pool_names

    if concurrency < 1:
        raise BadInput(f"--concurrency must be at least 1, got {concurrency}")
    pools = get_available_pool_names()
    if pool not in pools:
        raise BadInput(f"--pool {pool!r}: one of {', '.join(pools)}")
    check_loglevel(loglevel)


@app.command()
def sweeper(
    app_: AppOpt = None,
    interval: Annotated[float | None, typer.Option(help="seconds between sweeps")] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
) -> None:
    """Re-derive lost wake-ups, expired leases and due retries from the store."""
    if interval is not None:
        guard(lambda: positive(interval, "--interval"))
    guard(lambda: check_loglevel(loglevel))
    # Long-running like a worker: it may create the embedded store.
    fleet = guard(lambda: _fleet(app_, create=True))
    setup_logging(loglevel)
    if interval is not None:
        from dataclasses import replace

        fleet.runtime.settings = replace(fleet.runtime.settings, sweep_interval=interval)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_sweeper(fleet.runtime, stop)


@app.command()
def enqueue(
    workflow: Annotated[str, typer.Argument(help="registered workflow name")],
    args: Annotated[list[str] | None, typer.Argument(help="arguments, each one JSON value")] = None,
    app_: AppOpt = None,
    run_id: Annotated[str | None, typer.Option("--run-id")] = None,
) -> None:
    """Start a run; prints its id. The same --run-id twice is one run."""

    def body() -> str:
        # Fleet.enqueue checks (and may create) the store once the input is known good.
        fleet = _fleet(app_, schema=False)
        values = [
            codec.parse_json_arg(a, what=f"argument {i}") for i, a in enumerate(args or [], 1)
        ]
        return fleet.enqueue(workflow, *values, run_id=run_id).id

    print(guard(body))


@app.command()
def runs(
    status: Annotated[str | None, typer.Option(help="only runs in this status")] = None,
    limit: Annotated[int, typer.Option()] = 50,
    app_: AppOpt = None,
) -> None:
    """A table of runs, newest first."""

    def body() -> None:
        if status is not None and status not in {s.value for s in RunStatus}:
            raise BadInput(f"unknown status {status!r} (one of: {', '.join(RunStatus)})")
        if limit < 1:
            raise BadInput(f"--limit must be at least 1, got {limit}")
        q = _fleet(app_).runtime.queries
        rows = q.runs(status, limit)
        ids = [r.id for r in rows]
        console.print(runs_table(rows, {r: q.usage(r) for r in ids}, q.progress(ids)))

    guard(body)


@app.command()
def status(
    run_id: str, app_: AppOpt = None, json_: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """A run and its steps: status, attempts, epochs, workers, spend."""

    def body() -> int:
        fleet = _fleet(app_)
        q = fleet.runtime.queries
        run = fleet.run(run_id)._row()
        steps, attempts = q.steps(run_id), q.attempts(run_id)
        if json_:
            print(
                as_json(
                    {
                        "id": run.id,
                        "workflow": run.workflow,
                        "version": run.version,
                        "status": run.status,
                        "result": fleet.runtime.payloads.load(run.result),
                        "error": run.error,
                        "usage": q.usage(run_id),
                        "steps": [
                            {
                                "id": s.step_id,
                                "status": s.status,
                                "attempts": s.attempts,
                                "epoch": s.epoch,
                                "error": s.error,
                            }
                            for s in steps
                            if s.kind == "task"
                        ],
                    }
                )
            )
        else:
            console.print(
                run_view(
                    run,
                    steps,
                    attempts,
                    q.usage(run_id),
                    q.incident_counts(run_id),
                    q.intents(run_id),
                )
            )
        return 1 if run.status in (RunStatus.FAILED, RunStatus.CANCELLED) else 0

    raise typer.Exit(guard(body))


@app.command()
def watch(
    run_id: str,
    app_: AppOpt = None,
    timeout: Annotated[float | None, typer.Option(help="give up after seconds")] = None,
) -> None:
    """A live progress bar of steps done over steps recorded, until the run ends."""

    def body() -> int:
        fleet = _fleet(app_)
        handle = fleet.run(run_id)
        return follow(fleet, handle.id, timeout)

    raise typer.Exit(guard(body))


def follow(fleet: Fleet, run_id: str, timeout: float | None = None) -> int:
    """Show progress until the run ends; 0 if it succeeded, 1 otherwise."""
    q = fleet.runtime.queries
    deadline = None if timeout is None else time.monotonic() + timeout
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}", markup=False),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        # Both text columns are markup=False (see ``columns``): a run id is text.
        bar = progress.add_task(one_line(run_id), total=None, state="")
        while True:
            run = fleet.run(run_id)._row()
            steps = [s for s in q.steps(run_id) if s.kind == "task"]
            done = sum(1 for s in steps if s.status in ("done", "dead"))
            running = [s.step_id for s in steps if s.status == "running"]
            progress.update(
                bar,
                total=max(len(steps), 1),
                completed=done,
                state=one_line(f"{run.status} {' '.join(running)}".strip()),
            )
            if RunStatus(run.status).finished:
                break
            if deadline is not None and time.monotonic() > deadline:
                say(f"run {run_id} still {run.status} after {timeout}s", to=err)
                return 1
            time.sleep(0.2)
    if run.status == RunStatus.SUCCEEDED:
        say(("succeeded", "green"), f": {clip(run.result or '', 500)}")
        return 0
    say((run.status, "red"), f": {(run.error or '').splitlines()[0] if run.error else ''}")
    return 1


@app.command()
def metrics(
    port: Annotated[int, typer.Option(help="serve /metrics on this port")] = 9808,
    address: Annotated[
        str, typer.Option(help="listen address (0.0.0.0: every interface)")
    ] = "127.0.0.1",
    app_: AppOpt = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
) -> None:
    """Serve the fleet's figures in Prometheus format, read from the store at scrape time."""
    guard(lambda: check_port(port))
    guard(lambda: check_loglevel(loglevel))
    fleet = guard(lambda: _fleet(app_))
    setup_logging(loglevel)
    server = guard(lambda: _serve_metrics(fleet, address, port))
    logging.getLogger("fleet.metrics").info("serving /metrics on %s:%d", address, port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
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


@app.command("signal")
def signal_(
    run_id: str,
    name: str,
    data: Annotated[str | None, typer.Option(help="the payload, as JSON")] = None,
    app_: AppOpt = None,
) -> None:
    """Send a signal to a run's wait_for(NAME): now, or kept until it waits."""

    def body() -> None:
        payload = None if data is None else codec.parse_json_arg(data, what="--data")
        _fleet(app_).signal(run_id, name, payload)
        say(f"signal {name!r} sent to run {run_id}")

    guard(body)


@app.command()
def resolve(
    run_id: str,
    step_id: Annotated[str | None, typer.Argument(help="the in-doubt effect step")] = None,
    output: Annotated[
        str | None, typer.Option(help="it happened; this is what it returned (JSON)")
    ] = None,
    retry: Annotated[bool, typer.Option(help="it did not happen: run it again, same key")] = False,
    raise_budget: Annotated[
        str | None, typer.Option("--raise-budget", help="tokens=N or cost=X: let it go on")
    ] = None,
    app_: AppOpt = None,
) -> None:
    """Settle a run that needs a decision: an in-doubt effect, or a reached budget."""

    def body() -> None:
        if raise_budget is not None:
            if step_id is not None or output is not None or retry:
                raise BadInput("--raise-budget takes only the run id")
            limit = parse_budget(raise_budget)
            _fleet(app_).raise_budget(run_id, **limit)
            say(f"run {run_id}: budget raised to {raise_budget}; the run goes on")
            return
        if step_id is None or (output is None) == (not retry):
            raise BadInput("give STEP_ID and exactly one of --output JSON or --retry")
        fleet = _fleet(app_)
        if retry:
            fleet.resolve(run_id, step_id, retry=True)
        else:
            fleet.resolve(
                run_id, step_id, output=codec.parse_json_arg(output or "", what="--output")
            )
        say(f"step {step_id} of run {run_id} resolved; the run goes on")

    guard(body)


def parse_budget(raw: str) -> dict[str, Any]:
    """``tokens=N`` (a whole number) or ``cost=X``, positive and finite."""
    key, _, value = raw.partition("=")
    try:
        amount = float(value)
    except ValueError:
        amount = math.nan
    # NaN and infinity parse as floats; as a limit, neither means anything.
    if key not in ("tokens", "cost") or not math.isfinite(amount) or amount <= 0:
        raise BadInput(f"--raise-budget {raw!r}: expected tokens=N or cost=X, N and X above 0")
    if key == "tokens":
        if amount != int(amount):
            raise BadInput(f"--raise-budget {raw!r}: tokens must be a whole number")
        return {"tokens": int(amount)}
    return {"cost": amount}


@app.command()
def cancel(
    run_id: str,
    reason: Annotated[str, typer.Option(help="recorded with the run")] = "cancelled from the CLI",
    app_: AppOpt = None,
) -> None:
    """Cancel a run: no new step starts, a running step's commit is fenced."""

    def body() -> int:
        if _fleet(app_).cancel(run_id, reason):
            say(f"run {run_id} cancelled")
            return 0
        say(f"run {run_id} had already ended; nothing changed", to=err)
        return 1

    raise typer.Exit(guard(body))


@db_app.command("upgrade")
def db_upgrade(app_: AppOpt = None) -> None:
    """Create or migrate the schema to the newest revision."""

    def body() -> None:
        fleet = _fleet(app_, schema=False)
        fleet.upgrade_schema()
        console.print("schema is up to date")

    guard(body)


@dlq_app.command("list")
def dlq_list(
    workflow: Annotated[str | None, typer.Option(help="only this workflow's")] = None,
    run: Annotated[str | None, typer.Option(help="only this run's")] = None,
    replayed: Annotated[bool, typer.Option(help="include those already replayed")] = False,
    app_: AppOpt = None,
) -> None:
    """A table of dead letters, oldest first."""
    guard(
        lambda: console.print(
            dead_letters_table(_fleet(app_).dead_letters(run, workflow, replayed))
        )
    )


@dlq_app.command("show")
def dlq_show(letter_id: int, app_: AppOpt = None) -> None:
    """Everything about one dead letter: input, error, traceback, attempts, times."""

    def body() -> None:
        fleet = _fleet(app_)
        letter = fleet.runtime.queries.dead_letter(letter_id)
        if letter is None:
            raise BadInput(f"unknown dead letter {letter_id}")
        console.print(
            dead_letter_view(DeadLetterInfo.from_row(letter, fleet.runtime.payloads.load))
        )

    guard(body)


@dlq_app.command("replay")
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
        positive(rate, "--rate")
        fleet = _fleet(app_)
        if letter_id is not None:
            kwargs = (
                {} if input_ is None else {"input": codec.parse_json_arg(input_, what="--input")}
            )
            run = fleet.replay(letter_id, **kwargs)
            say(f"replayed dead letter {letter_id}; run {run.id} resumes")
            return
        letters = fleet.dead_letters(workflow=workflow)
        for i, letter in enumerate(letters):
            if i:
                time.sleep(1.0 / rate)
            fleet.replay(letter.id)
            say(f"replayed dead letter {letter.id} ({letter.run_id} {letter.step_id})")
        say(f"{len(letters)} dead letter(s) replayed")

    guard(body)


# --- retention ------------------------------------------------------------------------


@app.command()
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
        if batch < 1:
            raise BadInput(f"--batch must be at least 1, got {batch}")
        result = _fleet(app_).prune(age, dry_run=dry_run, batch=batch)
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


def main(argv: list[str] | None = None) -> Any:
    return app(args=argv)


if __name__ == "__main__":
    main()
