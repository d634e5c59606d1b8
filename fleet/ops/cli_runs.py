"""``fleet`` commands on runs: start one, list them, show one, follow one, and steer
one (signal, resolve, cancel). Each is a thin shell over the same ``Fleet`` call a
program makes; ``fleet.ops.cli`` names them.

The rule: a run that failed or was cancelled exits 1 where a command reports on it
(``status``, ``watch``, ``cancel`` of an ended run); bad input exits 2 with one line.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleet import codec
from fleet.app import Fleet
from fleet.bounds import INT32, whole
from fleet.errors import BadInput
from fleet.ops.cli_common import (
    AppOpt,
    actor,
    broker_unreachable,
    console,
    err,
    guard,
    need_app,
    open_fleet,
    positive,
    say,
)
from fleet.ops.render import as_json, clip, one_line, open_waits, run_view, runs_table
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.worker import gate


def enqueue(
    workflow: Annotated[str, typer.Argument(help="registered workflow name")],
    args: Annotated[list[str] | None, typer.Argument(help="arguments, each one JSON value")] = None,
    app_: AppOpt = None,
    run_id: Annotated[str | None, typer.Option("--run-id")] = None,
    tenant: Annotated[str | None, typer.Option(help="whose run it is (kept on the run)")] = None,
) -> None:
    """Start a run; prints its id. The same --run-id twice is one run."""

    def body() -> str:
        need_app(app_, f"defines workflow {workflow!r}")
        # Fleet.enqueue checks (and may create) the store once the input is known good.
        fleet = open_fleet(app_, schema=False)
        values = [
            codec.parse_json_arg(a, what=f"argument {i}") for i, a in enumerate(args or [], 1)
        ]
        return fleet.enqueue(workflow, *values, run_id=run_id, tenant=tenant).id

    print(guard(body))


def runs(
    status: Annotated[str | None, typer.Option(help="only runs in this status")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's runs")] = None,
    limit: Annotated[int, typer.Option()] = 50,
    children: Annotated[
        bool, typer.Option("--children/--no-children", help="list child runs too")
    ] = True,
    app_: AppOpt = None,
) -> None:
    """A table of runs, newest first."""

    def body() -> None:
        if status is not None and status not in {s.value for s in RunStatus}:
            raise BadInput(f"unknown status {status!r} (one of: {', '.join(RunStatus)})")
        whole(limit, "--limit", low=1, high=INT32)
        q = open_fleet(app_).runtime.queries
        rows = q.runs(status, limit, children=children, tenant=tenant)
        ids = [r.id for r in rows]
        console.print(runs_table(rows, {r: q.usage(r) for r in ids}, q.progress(ids)))

    guard(body)


def status(
    run_id: str, app_: AppOpt = None, json_: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """A run and its steps: status, attempts, epochs, workers, spend; its child runs."""

    def body() -> int:
        fleet = open_fleet(app_)
        q = fleet.runtime.queries
        run = fleet.run(run_id).row()
        steps, attempts = q.steps(run_id), q.attempts(run_id)
        limited = _waiting_on_limits(fleet, run)
        if json_:
            print(as_json(_status_document(fleet, run, steps, limited)))
        else:
            console.print(
                run_view(
                    run,
                    steps,
                    attempts,
                    q.usage(run_id),
                    q.incident_counts(run_id),
                    q.intents(run_id),
                    q.descendants(run_id),
                    limited,
                )
            )
        return 1 if run.status in (RunStatus.FAILED, RunStatus.CANCELLED) else 0

    raise typer.Exit(guard(body))


def _waiting_on_limits(fleet: Fleet, run: Any) -> dict[str, tuple[str, str]]:
    """A live run's steps waiting for room in a limit: step id → (limit, why). Asked
    only where limits are declared and the run is live (no limiter otherwise)."""
    if not fleet.registry.limits or run.status not in (RunStatus.QUEUED, RunStatus.RUNNING):
        return {}
    down = broker_unreachable(fleet)
    if down is not None:  # the limiter's Redis: the rest of the status still shows
        say(f"{down}: not shown which steps wait on a limit", to=err)
        return {}
    return gate.waiting_on(fleet.runtime, run.id)


def _status_document(
    fleet: Fleet, run: Any, steps: Sequence[Any], limited: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    """``fleet status --json``: the run, its result loaded, and its task steps (a step
    waiting for room in a limit says which, and why: concurrency, requests, tokens ...)."""
    made = Counter(a.step_id for a in fleet.runtime.queries.attempts(run.id))
    return {
        "id": run.id,
        "workflow": run.workflow,
        "version": run.version,
        "status": run.status,
        "result": fleet.runtime.payloads.load(run.result),
        "error": run.error,
        "usage": fleet.runtime.queries.usage(run.id),
        "steps": [
            {
                "id": s.step_id,
                "status": s.status,
                "attempts": s.attempts,  # since a replay reset it: what the cap counts
                "attempts_total": max(s.attempts, made[s.step_id]),  # every one made
                "epoch": s.epoch,
                "error": s.error,
                "waiting_on": (
                    {"limit": limited[s.step_id][0], "why": limited[s.step_id][1]}
                    if s.step_id in limited
                    else None
                ),
            }
            for s in steps
            if s.kind == StepKind.TASK
        ],
        "waits": open_waits(run.id, steps),
        "parent": run.parent_id,
        "children": [
            {"id": c.id, "parent": c.parent_id, "workflow": c.workflow, "status": c.status}
            for c in fleet.runtime.queries.descendants(run.id)
        ],
    }


def watch(
    run_id: str,
    app_: AppOpt = None,
    timeout: Annotated[float | None, typer.Option(help="give up after seconds")] = None,
) -> None:
    """A live progress bar of steps done over steps recorded, until the run ends."""

    def body() -> int:
        if timeout is not None:
            positive(timeout, "--timeout")
        fleet = open_fleet(app_)
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
            run = fleet.run(run_id).row()
            steps = [s for s in q.steps(run_id) if s.kind == StepKind.TASK]
            done = sum(1 for s in steps if StepStatus(s.status).finished)
            running = [s.step_id for s in steps if s.status == StepStatus.RUNNING]
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


def signal_(
    run_id: str,
    name: str,
    data: Annotated[str | None, typer.Option(help="the payload, as JSON")] = None,
    wait_id: Annotated[
        str | None,
        typer.Option(
            "--wait-id",
            help="answer this open wait only (its id from `fleet status`), or send nothing",
        ),
    ] = None,
    app_: AppOpt = None,
) -> None:
    """Send a signal to a run's wait_for(NAME): now, or kept until it waits."""

    def body() -> None:
        payload = None if data is None else codec.parse_json_arg(data, what="--data")
        open_fleet(app_).signal(run_id, name, payload, wait_id=wait_id, by=actor())
        to = f"wait {wait_id} of run {run_id}" if wait_id else f"run {run_id}"
        say(f"signal {name!r} sent to {to}")

    guard(body)


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
            open_fleet(app_).raise_budget(run_id, **limit, by=actor())
            say(f"run {run_id}: budget raised to {raise_budget}; the run goes on")
            return
        if step_id is None or (output is None) == (not retry):
            raise BadInput("give STEP_ID and exactly one of --output JSON or --retry")
        fleet = open_fleet(app_)
        if retry:
            fleet.resolve(run_id, step_id, retry=True, by=actor())
        else:
            value = codec.parse_json_arg(output or "", what="--output")
            fleet.resolve(run_id, step_id, output=value, by=actor())
        say(f"step {step_id} of run {run_id} resolved; the run goes on")

    guard(body)


def parse_budget(raw: str) -> dict[str, Any]:
    """``tokens=N`` (a whole number the store can keep) or ``cost=X``, positive and finite."""
    key, _, value = raw.partition("=")
    if key == "tokens" and value.strip().isdigit():
        # As text, not through float: 10**23 must be refused as itself, not rounded.
        return {"tokens": whole(value, f"--raise-budget {key}", low=1)}
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


def cancel(
    run_id: str,
    reason: Annotated[str, typer.Option(help="recorded with the run")] = "cancelled from the CLI",
    app_: AppOpt = None,
) -> None:
    """Cancel a run: no new step starts, a running step's commit is fenced."""

    def body() -> int:
        if open_fleet(app_).cancel(run_id, reason, by=actor(), why=reason):
            say(f"run {run_id} cancelled")
            return 0
        say(f"run {run_id} had already ended; nothing changed", to=err)
        return 1

    raise typer.Exit(guard(body))
