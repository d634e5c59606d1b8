"""Rich views of runs and steps, shared by the CLI and the demo.

The rule: every value that comes from the store or the user (ids, names, errors,
inputs) is shown as text through ``plain``, never as Rich markup: a run id holding
``[/]`` must not crash a view, nor ``[link=…]`` change what the operator sees, nor an
escape sequence drive the terminal.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from fleet.durations import ago
from fleet.records import Replay, attempts_by_step, saved_by_resume
from fleet.states import Decision, Incident, IntentOutcome, RunStatus, StepKind, StepStatus

# Every status has a style (tests/unit/test_render.py): green ended well, red ended
# badly, magenta waits for a person, yellow waits for time or a signal.
RUN_STYLE: dict[RunStatus, str] = {
    RunStatus.QUEUED: "white",
    RunStatus.RUNNING: "cyan",
    RunStatus.WAITING: "yellow",
    RunStatus.NEEDS_DECISION: "magenta",
    RunStatus.SUCCEEDED: "green",
    RunStatus.FAILED: "red",
    RunStatus.CANCELLED: "dim",
}
STEP_STYLE: dict[StepStatus, str] = {
    StepStatus.PENDING: "white",
    StepStatus.RUNNING: "cyan",
    StepStatus.RETRY_WAIT: "yellow",
    StepStatus.IN_DOUBT: "magenta",
    StepStatus.DONE: "green",
    StepStatus.DEAD: "red",
}
# A view is given a status's value (both enums say "running", in the same style).
STATUS_STYLE: dict[str, str] = {
    status.value: style for status, style in [*RUN_STYLE.items(), *STEP_STYLE.items()]
}


# C0 and C1 control characters but newline and tab.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape_control(text: str) -> str:
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def plain(value: object, style: str = "") -> Text:
    """``value`` as literal text, its control characters shown escaped."""
    return Text(_escape_control(str(value)), style=style)


def one_line(value: object) -> str:
    """``value`` as one printable line: newlines and control characters escaped."""
    return _escape_control(str(value).replace("\n", "\\n").replace("\t", " "))


def as_json(value: Any) -> str:
    """A loaded value as JSON. What JSON cannot hold (a ``Secret``, whose repr names
    it and never holds its value) is shown as its repr."""
    return json.dumps(value, default=repr)


def status_text(status: str) -> Text:
    return plain(status, style=STATUS_STYLE.get(status, ""))


def spend(usage: dict[str, Any]) -> str:
    return f"{usage['tokens']:,} tok ${usage['cost']:.4f}"


def runs_table(
    rows: Sequence[Any],
    usage: dict[str, dict[str, Any]],
    progress: dict[str, tuple[int, int]],
) -> Table:
    table = Table(title="runs")
    table.add_column("run", no_wrap=True)
    table.add_column("workflow", no_wrap=True)
    for col in ("version", "status", "steps", "spend", "created"):
        table.add_column(col)
    for r in rows:
        u = usage.get(r.id)
        done, total = progress.get(r.id, (0, 0))
        table.add_row(
            plain(r.id),
            plain(r.workflow),
            plain(r.version),
            status_text(r.status),
            f"{done}/{total}",
            spend(u) if u else "-",
            ago(r.created_at),
        )
    return table


def run_view(
    run: Any,
    steps: Sequence[Any],
    attempts: Sequence[Any],
    usage: dict[str, Any],
    incidents: dict[str, int],
    intents: Sequence[Any] = (),
    children: Sequence[Any] = (),
    limited: Mapping[str, tuple[str, str]] | None = None,
) -> Group:
    head = _grid()
    head.add_row("run", plain(run.id))
    pins = f", pins {run.pins}" if run.pins not in ("{}", "") else ""
    head.add_row("workflow", plain(f"{run.workflow} version {run.version}{pins}"))
    head.add_row("queue", plain(f"{run.queue} (served by workers that have this version)"))
    head.add_row("status", status_text(run.status))
    if run.parent_id is not None:
        detached = ", detached" if run.detached else ""
        head.add_row("parent", plain(f"{run.parent_id} (its step {run.parent_step}{detached})"))
    head.add_row("spend", _spend_line(run, usage))
    saved = saved_by_resume(attempts)
    if saved["crashes"]:
        head.add_row(
            "saved by resume",
            (
                f"{saved['crashes']} crash(es): {saved['steps']} checkpointed step(s) not run "
                f"again, {saved['calls']} model call(s), {saved['tokens']:,} tokens, "
                f"${saved['cost']:.4f}"
            ),
        )
    _attention_rows(head, run, incidents)
    if run.result is not None:
        head.add_row("result", plain(clip(run.result, 300)))
    if run.error:
        head.add_row("error", plain(run.error.splitlines()[0] if run.error else "", style="red"))
    parts: list[Any] = [head, steps_table(steps, attempts)]
    if children:
        parts.append(children_tree(run, children))
    if intents:
        parts.append(intents_table(intents))
    waits = open_waits(run.id, steps)
    if waits:
        parts.append(waits_table(waits))
    in_doubt = [s.step_id for s in steps if s.status == StepStatus.IN_DOUBT]
    for step_id, (limit, why) in sorted((limited or {}).items()):
        parts.append(plain(f"step {step_id} is waiting on limit {limit} ({why})", style="yellow"))
    if in_doubt:
        parts.append(
            plain(
                f"needs a decision: fleet resolve {run.id} {in_doubt[0]} (--output JSON | --retry)",
                style="magenta",
            )
        )
    return Group(*parts)


def children_tree(run: Any, children: Sequence[Any]) -> Tree:
    """The run's child runs (``children``: its descendants, each with ``parent_id``) as
    a tree under it: id, workflow, status; a detached child says so."""
    root = Tree(plain(f"child runs of {run.id}"))
    nodes = {run.id: root}
    for child in children:  # oldest first: a parent is placed before its children
        under = nodes.get(child.parent_id, root)
        label = plain(child.id)
        label.append(f"  {child.workflow}  ")
        label.append_text(status_text(child.status))
        if child.detached:
            label.append("  (detached)", style="dim")
        nodes[child.id] = under.add(label)
    return root


def _attention_rows(head: Table, run: Any, incidents: dict[str, int]) -> None:
    """What an operator must act on or know about: a budget reached, a version no
    worker serves, the run's incidents."""
    if run.status == RunStatus.NEEDS_DECISION and run.decision == Decision.BUDGET:
        head.add_row(
            "needs a decision",
            plain(
                f"budget reached: fleet resolve {run.id} --raise-budget tokens=N (or cost=X), "
                f"or fleet cancel {run.id}",
                style="magenta",
            ),
        )
    mismatches = incidents.get(Incident.VERSION_MISMATCH)
    if mismatches and not RunStatus(run.status).finished:
        head.add_row(
            "waits for",
            plain(
                f"a worker with {run.workflow} version {run.version}: "
                f"{mismatches} time(s) a worker of another version left it",
                style="yellow",
            ),
        )
    if incidents:
        head.add_row(
            "incidents", plain(", ".join(f"{k}: {v}" for k, v in sorted(incidents.items())))
        )


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    return grid


def _spend_line(run: Any, usage: dict[str, Any]) -> str:
    limits = [
        f"{run.budget_tokens:,} tokens" if run.budget_tokens else "",
        f"${run.budget_cost:.4f}" if run.budget_cost else "",
    ]
    budget = " and ".join(x for x in limits if x)
    return f"{spend(usage)} in {usage['calls']} model call(s)" + (
        f" (budget {budget})" if budget else ""
    )


def open_waits(run_id: str, steps: Sequence[Any]) -> list[dict[str, Any]]:
    """The run's open waits, earliest first: a ``wait_for`` (its signal, since when,
    its timeout, and the command that answers it, that wait and no other) or a sleep
    (until when: nothing to send, any worker wakes it)."""
    found = []
    for s in steps:
        if s.kind != StepKind.WAIT or s.status != StepStatus.PENDING:
            continue
        name = s.name.removeprefix("wait:") if s.name.startswith("wait:") else None
        answer = None
        if name is not None:
            answer = (
                f"fleet signal {shlex.quote(run_id)} {shlex.quote(name)} "
                f"--wait-id {shlex.quote(s.step_id)} --data JSON"
            )
        found.append(
            {
                "id": s.step_id,
                "signal": name,
                "since": s.created_at,
                "timeout_at": s.due_at,
                "answer": answer,
            }
        )
    return found


def waits_table(waits: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="open waits")
    for col in ("wait", "for", "since", "times out", "answer with"):
        table.add_column(col)
    for w in waits:
        due = w["timeout_at"]
        table.add_row(
            plain(w["id"]),
            plain(f"signal {w['signal']!r}" if w["signal"] is not None else "its time"),
            ago(w["since"]),
            "never" if due is None else _stamp(due),
            plain(w["answer"] or "nothing: the sweeper wakes it when the time comes"),
        )
    return table


def intents_table(intents: Sequence[Any]) -> Table:
    table = Table(title="effects (write-ahead intents)")
    for col in ("step", "epoch", "idempotency key", "outcome", "written"):
        table.add_column(col)
    for i in intents:
        style = "magenta" if i.outcome == IntentOutcome.OPEN else ""
        table.add_row(
            plain(i.step_id),
            str(i.epoch),
            plain(i.idempotency_key),
            plain(i.outcome, style=style),
            ago(i.created_at),
        )
    return table


def steps_table(steps: Sequence[Any], attempts: Sequence[Any]) -> Table:
    by_step = attempts_by_step(attempts)
    table = Table(title="steps")
    for col in ("step", "status", "attempts", "epoch", "workers", "spend", "error"):
        table.add_column(col)
    for s in steps:
        if s.kind != StepKind.TASK:
            continue
        atts = by_step.get(s.step_id, [])
        tokens = sum(a.input_tokens + a.output_tokens for a in atts)
        cost = sum(a.cost for a in atts)
        workers = ", ".join(f"{a.worker} ({a.outcome})" for a in atts) or "-"
        table.add_row(
            plain(s.step_id),
            status_text(s.status),
            attempts_shown(s.attempts, len(atts)),
            str(s.epoch),
            plain(workers),
            f"{tokens:,} tok ${cost:.4f}" if atts else "-",
            plain(clip(s.error or "", 60)),
        )
    return table


def attempts_shown(counted: int, made: int) -> str:
    """A step's attempts as the operator counts them: every one it made (its attempt log,
    which the workers column lists and its epoch follows), and, once a dead letter's
    replay has reset the count its cap is held to, how many since: ``4 (1 since replay)``."""
    total = max(counted, made)
    return str(total) if total == counted else f"{total} ({counted} since replay)"


def clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters, with an ellipsis when cut."""
    return text if len(text) <= n else text[: n - 1] + "…"


def dead_letters_table(letters: Sequence[Any]) -> Table:
    table = Table(title="dead letters")
    table.add_column("id", no_wrap=True)
    table.add_column("run", no_wrap=True)
    for col in ("workflow", "step", "error", "attempts", "last failed", "replayed"):
        table.add_column(col)
    for d in letters:
        table.add_row(
            str(d.id),
            plain(d.run_id),
            plain(d.workflow),
            plain(d.step_id),
            plain(clip(d.error, 60)),
            str(d.attempts),
            ago(d.last_failed_at),
            ago(d.replayed_at) if d.replayed_at else "-",
        )
    return table


def dead_letter_view(d: Any) -> Group:
    head = _grid()
    rows = [
        ("dead letter", str(d.id)),
        ("run", d.run_id),
        ("workflow", d.workflow),
        ("step", f"{d.step_id} ({d.step_name})"),
        ("input", as_json(d.input)),
        ("error", d.error),
        ("attempts", str(d.attempts)),
        ("first failed", f"{_stamp(d.first_failed_at)} ({ago(d.first_failed_at)})"),
        ("last failed", f"{_stamp(d.last_failed_at)} ({ago(d.last_failed_at)})"),
        ("replayed", f"{_stamp(d.replayed_at)}" if d.replayed_at else "no"),
    ]
    for k, v in rows:
        head.add_row(k, plain(v))
    return Group(head, plain(d.traceback or "(no traceback: the worker was lost)", style="dim"))


REPLAY_STYLE = {"finished": "green", "failed": "red", "suspended": "yellow"}


def replay_view(r: Replay) -> Group:
    """What a local replay reached (``fleet replay``): the run's end as replayed (its
    result, or its error with the replay's traceback), or the steps it stands before and
    the signal it waits for."""
    head = _grid()
    head.add_row("run", plain(r.run_id))
    head.add_row("replayed", plain(r.status, style=REPLAY_STYLE.get(r.status, "")))
    head.add_row("steps met", f"{r.replayed} recorded (no step body run)")
    if r.status == "finished":
        head.add_row("result", plain(as_json(r.result)))
    error = (r.error or "").split("\n", 1)
    if r.error:
        head.add_row("error", plain(error[0], style="red"))
    if r.next:
        head.add_row("stands before", plain(", ".join(r.next)))
    if r.new:
        head.add_row("not recorded yet", plain(", ".join(r.new)))
    if r.wait is not None:
        head.add_row("waits for", plain(f"signal {r.wait}"))
    if len(error) > 1:
        return Group(head, plain(error[1].strip("\n"), style="dim"))
    return Group(head)


def _stamp(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
