"""``fleet demo``: the research agent on the embedded default, a worker killed with
SIGKILL partway through, and the run resuming at that step on the other worker."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fleet.app import Fleet
from fleet.config import Settings
from fleet.errors import BadInput
from fleet.ops.render import status_text
from fleet.records import attempts_by_step, saved_by_resume
from fleet.states import AttemptOutcome, RunStatus, StepKind, StepStatus
from fleet.testing import SWEEPER_READY, WORKER_READY, FleetProcess, sweeper_argv, worker_argv

APP = "tasks"
WORKFLOW = "research_deep"
TOPIC = "durable execution for AI agents"
KILL_STEP = "critique#2"  # a sequential step, late in the run: exactly one step in flight
LEASE_SECONDS = 3.0
MODEL_LATENCY = 0.6
TIMEOUT = 120.0
# An attempt whose worker died, or that was fenced when another took over.
_CRASHED = (AttemptOutcome.LOST, AttemptOutcome.FENCED)


@dataclass
class Story:
    events: list[str] = field(default_factory=list)
    killed_worker: str = ""
    resumed: bool = False

    def say(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')}  {text}")


def example_fleet() -> Fleet:
    """The example agents' Fleet (``APP.fleet``), found by module name: the library
    does not depend on them, they ship beside it."""
    try:
        module = importlib.import_module(APP)
    except ModuleNotFoundError as exc:
        if exc.name != APP:
            raise
        raise BadInput(
            f"fleet demo runs the example agents (the {APP!r} package), which are not "
            "installed: run it from a checkout of fleet, or pip install it from there"
        ) from None
    found = getattr(module, "fleet", None)
    if not isinstance(found, Fleet):
        raise BadInput(f"module {APP!r} has no fleet.Fleet named 'fleet'")
    return found


@dataclass(frozen=True)
class DemoHome:
    """Where a demo keeps its store, broker and process logs: ``.fleet`` with ``--keep``,
    else a temporary folder, removed at the end only if the story went as it should."""

    path: Path
    logs: Path
    keep: bool

    @classmethod
    def make(cls, keep: bool, prefix: str) -> DemoHome:
        path = Path(".fleet").resolve() if keep else Path(tempfile.mkdtemp(prefix=prefix))
        path.mkdir(parents=True, exist_ok=True)
        logs = path / "demo-logs"
        logs.mkdir(exist_ok=True)
        return cls(path, logs, keep)

    def close(self, console: Console, ok: bool, try_next: str) -> None:
        """Say where the state is (``try_next``: commands to read it), or remove it."""
        if self.keep:
            console.print(f"State kept in {self.path}: try {try_next} from {self.path.parent}.")
        elif not ok:
            console.print(
                f"[red]The story did not go as it should.[/red] State and process "
                f"logs are kept in {self.path} (logs in {self.logs})."
            )
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def demo_env(home: Path, database_url: str | None, broker_url: str | None) -> dict[str, str]:
    """The demo's processes' environment: the user's, without their FLEET_* settings,
    and a short lease so that the takeover is seen within seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(
        FLEET_DATABASE_URL=database_url or f"sqlite:///{home}/fleet.db",
        FLEET_BROKER_URL=broker_url or f"filesystem:///{home}/broker",
        FLEET_LEASE_SECONDS=str(LEASE_SECONDS),
        FLEET_SWEEP_INTERVAL="0.5",
        FLEET_SWEEP_GRACE="2",
        FLEET_MODEL_LATENCY=str(MODEL_LATENCY),
    )
    return env


def run_demo(
    console: Console, *, keep: bool, database_url: str | None, broker_url: str | None
) -> int:
    """Tell the crash-and-resume story; 0 only if the run succeeded and no completed
    step ran twice."""
    example = example_fleet()  # first: without the examples, nothing to set up or clean
    demo_home = DemoHome.make(keep, "fleet-demo-")
    home, logdir = demo_home.path, demo_home.logs
    env = demo_env(home, database_url, broker_url)
    where = "Postgres + Redis" if database_url else f"the embedded store in {home}"
    console.print(
        Panel.fit(
            f"[bold]fleet demo[/bold]: the research agent ({WORKFLOW}) on {where}.\n"
            f"Two workers and a sweeper start; partway through, the worker running "
            f"[cyan]{KILL_STEP}[/cyan] is killed with SIGKILL.\nThe run should resume at that "
            f"step on the other worker, re-running nothing that had finished.",
        )
    )
    client = example.with_settings(Settings.from_env(env))
    client.upgrade_schema()
    procs: list[FleetProcess] = []
    story = Story()
    ok = False
    try:
        for name in ("worker-1", "worker-2"):
            procs.append(
                FleetProcess(name, worker_argv(APP, 2), {**env, "FLEET_WORKER_NAME": name}, logdir)
            )
        procs.append(FleetProcess("sweeper", sweeper_argv(APP), env, logdir))
        for proc, ready in zip(procs, (WORKER_READY, WORKER_READY, SWEEPER_READY), strict=True):
            if not proc.wait_for_output(ready, 60):
                console.print(f"[red]{proc.name} did not start[/red]; its log: {proc.log}")
                return 1
        story.say("worker-1, worker-2 and the sweeper are up")
        run = client.enqueue(WORKFLOW, TOPIC)
        story.say(f"enqueued run {run.id}")
        ok = _follow(console, client, run.id, procs, story)
        _summary(console, client, run.id, story)
        ok = ok and _no_completed_step_ran_twice(client, run.id, story)
        return 0 if ok else 1
    finally:
        for proc in procs:
            proc.stop()
        client.runtime.db.dispose()
        demo_home.close(console, ok, "[bold]fleet runs[/bold] and [bold]fleet status RUN_ID[/bold]")


def _follow(
    console: Console, client: Fleet, run_id: str, procs: list[FleetProcess], story: Story
) -> bool:
    q = client.runtime.queries
    deadline = time.monotonic() + TIMEOUT
    with live_display(console) as live:
        while True:
            run = q.run(run_id)
            assert run is not None
            steps = [s for s in q.steps(run_id) if s.kind == StepKind.TASK]
            if not story.killed_worker:
                _maybe_kill(client, steps, procs, story)
            elif not story.resumed:
                _maybe_resumed(steps, story)
            live.update(live_view(run, steps, story))
            if RunStatus(run.status).finished:
                return bool(run.status == RunStatus.SUCCEEDED)
            if time.monotonic() > deadline:
                story.say(f"[red]gave up after {TIMEOUT:.0f}s[/red]")
                live.update(live_view(run, steps, story))
                return False
            time.sleep(0.12)


@contextmanager
def live_display(console: Console) -> Iterator[Live]:
    """Rich's ``Live``, its last frame ended on a line of its own: piped (no terminal),
    Live prints that frame without a final newline, and the next line printed would be
    glued onto its last line."""
    with Live(console=console, refresh_per_second=8, transient=False) as live:
        yield live
    if not console.is_terminal:
        console.line()


def _maybe_kill(client: Fleet, steps: list[Any], procs: list[FleetProcess], story: Story) -> None:
    target = next(
        (s for s in steps if s.step_id == KILL_STEP and s.status == StepStatus.RUNNING), None
    )
    if target is None or not target.lease_owner:
        return
    name, _, pid = target.lease_owner.rpartition(":")
    victim = next((p for p in procs if str(p.pid) == pid), None)
    if victim is None:
        return
    victim.signal(signal.SIGKILL)
    story.killed_worker = name
    story.say(
        f"[red]SIGKILL[/red] {name} (pid {pid}) while it runs {KILL_STEP} (epoch {target.epoch})"
    )
    story.say(
        f"its lease expires within {LEASE_SECONDS:.0f}s; the sweeper then hands "
        f"{KILL_STEP} to a live worker"
    )


def _maybe_resumed(steps: list[Any], story: Story) -> None:
    ids = [s.step_id for s in steps]
    target = next((s for s in steps if s.step_id == KILL_STEP), None)
    if (
        target is None
        or target.epoch < 2
        or not target.lease_owner
        and target.status != StepStatus.DONE
    ):
        return
    story.resumed = True
    holder = (target.lease_owner or "").rsplit(":", 1)[0] or "a live worker"
    position = ids.index(KILL_STEP) + 1
    story.say(
        f"[green]resumed[/green]: {holder} took over {KILL_STEP} at epoch {target.epoch} "
        f"(step {position}); the {position - 1} steps before it are not run again"
    )


def live_view(run: Any, steps: list[Any], story: Story) -> Group:
    table = Table(title=f"run {run.id} · {status_text(run.status)}", expand=False)
    for col in ("step", "status", "attempts", "epoch", "lease holder"):
        table.add_column(col)
    for s in steps:
        holder = s.lease_owner.rsplit(":", 1)[0] if s.lease_owner else ""
        table.add_row(s.step_id, status_text(s.status), str(s.attempts), str(s.epoch), holder)
    return Group(table, Text.from_markup("\n".join(story.events[-8:])))


def _summary(console: Console, client: Fleet, run_id: str, story: Story) -> None:
    q = client.runtime.queries
    run = q.run(run_id)
    assert run is not None
    steps = [s for s in q.steps(run_id) if s.kind == StepKind.TASK]
    by_step = attempts_by_step(q.attempts(run_id))

    table = Table(title="every step")
    for col in ("step", "ran", "on", "epoch", "status"):
        table.add_column(col)
    for s in steps:
        atts = by_step.get(s.step_id, [])
        on = ", ".join(
            a.worker.rsplit(":", 1)[0]
            + ("" if a.outcome == AttemptOutcome.DONE else f" ({a.outcome})")
            for a in atts
        )
        table.add_row(s.step_id, str(len(atts)), on, str(s.epoch), status_text(s.status))
    console.print(table)

    rerun = [s.step_id for s in steps if len(by_step.get(s.step_id, [])) > 1]
    saved = saved_by_resume(q.attempts(run_id))
    cost = Table(title="what the crash cost", show_header=True)
    for col in ("", "steps", "model calls", "tokens", "cost"):
        cost.add_column(col)
    killed = [a for atts in by_step.values() for a in atts if a.outcome in _CRASHED]
    lost_tokens = sum(a.input_tokens + a.output_tokens for a in killed)
    cost.add_row(
        "re-run after the crash (fleet)",
        str(len(rerun)),
        str(sum(a.calls for a in killed)),
        f"{lost_tokens:,}",
        f"${sum(a.cost for a in killed):.4f}",
    )
    cost.add_row(
        "restarting from step one would re-run",
        str(saved["steps"] + len(rerun)),
        str(saved["calls"]),
        f"{saved['tokens']:,}",
        f"${saved['cost']:.4f}",
    )
    console.print(cost)
    usage = q.usage(run_id)
    console.print(
        f"run spend: {usage['calls']} model calls, {usage['tokens']:,} tokens, "
        f"${usage['cost']:.4f} (every attempt, the killed one included)"
    )
    if run.status == RunStatus.SUCCEEDED:
        result = client.runtime.payloads.load(run.result)
        report = result.get("report", "") if isinstance(result, dict) else str(result)
        console.print(Panel(report, title=f"result · run {run_id} succeeded"))
    else:
        console.print(f"[red]run {run_id} {run.status}[/red]: {run.error}")


def _no_completed_step_ran_twice(client: Fleet, run_id: str, story: Story) -> bool:
    if not story.killed_worker:
        return False  # the story did not happen: nothing was shown
    by_step = attempts_by_step(client.runtime.queries.attempts(run_id))
    return all(
        sum(a.outcome == AttemptOutcome.DONE for a in atts) == 1
        and (len(atts) == 1 or atts[0].outcome in _CRASHED)
        for atts in by_step.values()
    )
