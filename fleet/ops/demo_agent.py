"""``fleet demo agent``: the notes agent (a tool-using loop on the stand-in model) on the
embedded default; its worker killed with SIGKILL while a tool of a late turn runs, a
new worker resumes the conversation, a person approves the destructive tool, and the
call log shows that no turn asked the model twice."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from fleet.app import Fleet
from fleet.config import Settings
from fleet.ops.demo import APP, DemoHome, Story, demo_env, example_fleet, live_display, live_view
from fleet.ops.render_transcript import render_transcript
from fleet.records import attempts_by_step
from fleet.states import AttemptOutcome, RunStatus, StepKind, StepStatus
from fleet.testing import SWEEPER_READY, WORKER_READY, FleetProcess, sweeper_argv, worker_argv

WORKFLOW = "agent"
KILL_TURN = 4  # after the first compaction: the resumed model is shown a summary
TOOL_LATENCY = 0.8
MODEL_LATENCY = 0.2
TIMEOUT = 120.0
APPROVAL = {"approved": True, "by": "demo"}
_CRASHED = (AttemptOutcome.LOST, AttemptOutcome.FENCED)


class Agent:
    """What the demo has seen of the run so far."""

    def __init__(self) -> None:
        self.story = Story()
        self.killed_step = ""
        self.approved = False
        self.resumed = False


def run_agent_demo(
    console: Console, *, keep: bool, database_url: str | None, broker_url: str | None
) -> int:
    """Tell the story; 0 only if the run succeeded, the killed attempt was taken over
    and every turn asked the model exactly once."""
    example = example_fleet()  # first: without the examples, nothing to set up or clean
    demo_home = DemoHome.make(keep, "fleet-agent-")
    home, logdir = demo_home.path, demo_home.logs
    calls_log = home / "model-calls.jsonl"
    env = {
        **demo_env(home, database_url, broker_url),
        "FLEET_MODEL_LATENCY": str(MODEL_LATENCY),
        "FLEET_TOOL_LATENCY": str(TOOL_LATENCY),
        "FLEET_MODEL_CALLS": str(calls_log),
        "FLEET_NOTES_LOG": str(home / "notes.jsonl"),
    }
    where = "Postgres + Redis" if database_url else f"the embedded store in {home}"
    console.print(
        Panel.fit(
            f"[bold]fleet demo agent[/bold]: the notes agent ({WORKFLOW}) on {where}.\n"
            f"Each turn the stand-in model is asked for tool calls; reads are plain steps, "
            f"write_note an effect,\ndelete_note waits for a person's approval. In turn "
            f"{KILL_TURN} the worker is killed with SIGKILL while a tool runs;\na new worker "
            f"should resume the conversation without asking the model anything again.",
        )
    )
    client = example.with_settings(Settings.from_env(env))
    client.upgrade_schema()
    procs: list[FleetProcess] = []
    agent = Agent()
    ok = False

    def start(name: str, argv: list[str], ready: str, extra: dict[str, str]) -> bool:
        proc = FleetProcess(name, argv, {**env, **extra}, logdir)
        procs.append(proc)
        if not proc.wait_for_output(ready, 60):
            console.print(f"[red]{name} did not start[/red]; its log: {proc.log}")
            return False
        return True

    try:
        if not (
            start("worker-1", worker_argv(APP, 2), WORKER_READY, {"FLEET_WORKER_NAME": "worker-1"})
            and start("sweeper", sweeper_argv(APP), SWEEPER_READY, {})
        ):
            return 1
        agent.story.say("worker-1 and the sweeper are up")
        run = client.enqueue(WORKFLOW)
        agent.story.say(f"enqueued run {run.id}")
        done = _follow(console, client, run.id, procs, agent, start)
        ok = _summary(console, client, run.id, agent, calls_log) and done
        return 0 if ok else 1
    finally:
        for proc in procs:
            proc.stop()
        client.runtime.db.dispose()
        demo_home.close(console, ok, "[bold]fleet transcript RUN_ID[/bold]")


def _follow(
    console: Console,
    client: Fleet,
    run_id: str,
    procs: list[FleetProcess],
    agent: Agent,
    start: Callable[[str, list[str], str, dict[str, str]], bool],
) -> bool:
    q = client.runtime.queries
    deadline = time.monotonic() + TIMEOUT
    with live_display(console) as live:
        while True:
            run = q.run(run_id)
            assert run is not None
            steps = [s for s in q.steps(run_id) if s.kind == StepKind.TASK]
            if not agent.killed_step and _maybe_kill(steps, procs, agent):
                named = {"FLEET_WORKER_NAME": "worker-2"}
                if not start("worker-2", worker_argv(APP, 2), WORKER_READY, named):
                    return False
                agent.story.say("worker-2 is up; the sweeper hands it the killed step")
            if agent.killed_step and not agent.resumed:
                _maybe_resumed(steps, agent)
            if run.status == RunStatus.WAITING and not agent.approved:
                client.signal(run_id, "approval", APPROVAL)
                agent.approved = True
                agent.story.say(
                    "the run waits for approval of delete_note (no worker held); "
                    f"approved by {APPROVAL['by']!r}"
                )
            live.update(live_view(run, steps[-12:], agent.story))
            if RunStatus(run.status).finished:
                return bool(run.status == RunStatus.SUCCEEDED)
            if time.monotonic() > deadline:
                agent.story.say(f"[red]gave up after {TIMEOUT:.0f}s[/red]")
                live.update(live_view(run, steps[-12:], agent.story))
                return False
            time.sleep(0.05)


def _maybe_kill(steps: list[Any], procs: list[FleetProcess], agent: Agent) -> bool:
    """SIGKILL the worker running the first tool of turn ``KILL_TURN``, once it runs."""
    ids = [s.step_id for s in steps]
    turn = f"model_turn#{KILL_TURN}"
    if turn not in ids or ids.index(turn) + 1 >= len(steps):
        return False
    target = steps[ids.index(turn) + 1]
    if target.status != StepStatus.RUNNING or not target.lease_owner:
        return False
    name, _, pid = target.lease_owner.rpartition(":")
    victim = next((p for p in procs if str(p.pid) == pid), None)
    if victim is None:
        return False
    victim.signal(signal.SIGKILL)
    agent.killed_step = target.step_id
    agent.story.say(
        f"[red]SIGKILL[/red] {name} (pid {pid}) while it runs {target.step_id} "
        f"(turn {KILL_TURN}, epoch {target.epoch})"
    )
    return True


def _maybe_resumed(steps: list[Any], agent: Agent) -> None:
    ids = [s.step_id for s in steps]
    if agent.killed_step not in ids:
        return
    target = steps[ids.index(agent.killed_step)]
    if target.status != StepStatus.DONE:
        return
    agent.resumed = True
    done = [i for i in ids[: ids.index(target.step_id)] if i.startswith("model_turn#")]
    agent.story.say(
        f"[green]resumed[/green]: {target.step_id} done at epoch {target.epoch}; the "
        f"{len(done)} model turns before it were not asked again"
    )


def _summary(console: Console, client: Fleet, run_id: str, agent: Agent, calls_log: Path) -> bool:
    """Print the conversation and the proof lines; True if every proof holds."""
    q = client.runtime.queries
    run = q.run(run_id)
    assert run is not None
    info = client.transcript(run_id)
    console.print()
    console.print(render_transcript(info, view="raw"))
    if run.status == RunStatus.SUCCEEDED:
        result = client.runtime.payloads.load(run.result)
        console.print(Panel(Text(str(result.get("answer", ""))), title=f"answer · run {run_id}"))
    else:
        console.print(Text(f"run {run_id} {run.status}: {run.error}", style="red"))

    per_turn = model_calls_per_turn(calls_log, run_id)
    turns = sum(1 for m in info.raw() if m.get("role") == "assistant")
    counts = [per_turn.get(t, 0) for t in range(1, turns + 1)]
    calls_ok = (
        bool(counts) and all(n == 1 for n in counts) and set(per_turn) <= set(range(1, turns + 1))
    )
    succeeded = run.status == RunStatus.SUCCEEDED
    taken = _taken_over(client, run_id, agent.killed_step)
    console.print(
        f"compactions: {len(info.compactions)}; the model's window now holds "
        f"{len(info.window())} of {len(info.messages)} messages"
    )
    for good, line in (
        (calls_ok, f"model calls per turn: {counts} (each turn asked the model once)"),
        (succeeded, f"run {run_id} {run.status}"),
        (
            taken is not None,
            taken or f"the killed step {agent.killed_step or '?'} was not taken over",
        ),
    ):
        mark = "[green]ok[/green]" if good else "[red]FAILED[/red]"
        console.print(Text.from_markup(f"proof {mark}: ") + Text(line))
    return calls_ok and succeeded and taken is not None


def model_calls_per_turn(calls_log: Path, run_id: str) -> Counter[int]:
    """How many times the model was asked each turn of the run (the stand-in's log)."""
    if not calls_log.exists():
        return Counter()
    lines = [json.loads(line) for line in calls_log.read_text().splitlines() if line.strip()]
    return Counter(c["turn"] for c in lines if c.get("run") == run_id and c["kind"] == "chat")


def _taken_over(client: Fleet, run_id: str, step_id: str) -> str | None:
    """The takeover of the killed step as one line, or None if it did not happen."""
    atts = attempts_by_step(client.runtime.queries.attempts(run_id)).get(step_id, [])
    if len(atts) < 2 or atts[0].outcome not in _CRASHED or atts[-1].outcome != AttemptOutcome.DONE:
        return None
    first, last = atts[0], atts[-1]
    return (
        f"killed attempt taken over: {step_id} epoch {first.epoch} on "
        f"{first.worker.rsplit(':', 1)[0]} {first.outcome}, epoch {last.epoch} on "
        f"{last.worker.rsplit(':', 1)[0]} done"
    )
