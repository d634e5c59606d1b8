"""Store-level checks of a chaos run (issue 46), whatever the programs its runs ran.

Retention prunes finished runs while the chaos run goes on, so a run is read once, as it
finishes: ``capture`` turns it into a plain JSON-able record (its end, its steps and
their attempts, its child runs, its dead letters, and the local replay of its history,
``fleet.testing.replay``). The checks read captures and logs and return human-readable
failures naming the run and step; an empty list: the check holds.

- ``check_settled``: nothing of a run is left going after it ended (DESIGN invariant 11).
- ``check_replays``: a run's end is the end a replay of its history from the top reaches.
- ``check_overlap``: a concurrency limit's step bodies never overlapped beyond it.
- ``check_effects``: every effect the model expects applied exactly once at the
  stand-in provider (tests/provider.py), none lost, none twice, none unexpected.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fleet import Fleet, NonDeterminism
from fleet.records import attempts_by_step
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.testing import replay

ENDED = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}
LIVE = {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.NEEDS_DECISION}
SETTLED = {StepStatus.DONE, StepStatus.DEAD}
# A run's recorded error ends with the traceback of where it was raised (a worker's
# replay); a local replay's with its own: the text before it is the error.
TRACEBACK = "\n\nTraceback (most recent call last):"
CLIP = 300  # characters kept of a step's or attempt's error (its first line)


def _line(text: str | None) -> str | None:
    return None if text is None else text.partition("\n")[0][:CLIP]


def _canonical(value: Any) -> str:
    """A JSON value as text, so that ``1``, ``1.0`` and ``true`` stay three values."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# --- capture --------------------------------------------------------------------------


def capture(client: Fleet, run_id: str) -> dict[str, Any] | None:
    """Run ``run_id`` as the store has it now, as a plain JSON-able record; None if the
    store has no such run (pruned). ``client``: the Fleet its workflows are registered
    on (the replay runs them). Raises ``StoreUnavailable`` while the store does not
    answer: capture it again.

    Keys: ``run``, ``workflow``, ``status``, ``result`` (the decoded value), ``error``,
    ``parent``, ``detached``, ``finished_at``; ``steps`` in history order, each ``id``,
    ``name``, ``kind``, ``status``, ``attempts``, ``epoch``, ``error`` (first line) and
    ``tries`` (its attempts: ``epoch``, ``attempt``, ``outcome``, ``worker``,
    ``started_at``, ``finished_at``, ``error``); ``children``, every descendant run
    (``id``, ``parent``, ``status``, ``detached``); ``dead_letters`` (``id``, ``step``,
    ``attempts``, ``replayed``); ``replay`` (``status`` finished, failed or suspended,
    ``result``, ``error``, ``next``, ``wait``, ``new``; or ``nondeterminism`` or
    ``error`` with its ``error``)."""
    queries = client.runtime.queries
    run = queries.run(run_id)
    if run is None:
        return None
    attempts = attempts_by_step(queries.attempts(run_id))
    steps = [
        {
            "id": s.step_id,
            "name": s.name,
            "kind": str(s.kind),
            "status": str(s.status),
            "attempts": s.attempts,
            "epoch": s.epoch,
            "error": _line(s.error),
            "tries": [
                {
                    "epoch": a.epoch,
                    "attempt": a.attempt,
                    "outcome": str(a.outcome),
                    "worker": a.worker,
                    "started_at": a.started_at,
                    "finished_at": a.finished_at,
                    "error": _line(a.error),
                }
                for a in attempts.get(s.step_id, [])
            ],
        }
        for s in queries.steps(run_id)
    ]
    children = [
        {"id": c.id, "parent": c.parent_id, "status": str(c.status), "detached": c.detached}
        for c in queries.descendants(run_id)
    ]
    letters = [
        {"id": d.id, "step": d.step_id, "attempts": d.attempts, "replayed": d.replayed_at}
        for d in queries.dead_letters(run_id=run_id)
    ]
    return {
        "run": run_id,
        "workflow": run.workflow,
        "status": str(run.status),
        "result": client.runtime.payloads.load(run.result),
        "error": run.error,
        "parent": run.parent_id,
        "detached": run.detached,
        "finished_at": run.finished_at,
        "steps": steps,
        "children": children,
        "dead_letters": letters,
        "replay": _replayed(client, run_id),
    }


def _replayed(client: Fleet, run_id: str) -> dict[str, Any]:
    """The local replay of the run's history from the top, as a record."""
    try:
        got = replay(run_id, fleet=client)
    except NonDeterminism as exc:
        return {"status": "nondeterminism", "error": f"NonDeterminism: {exc}"}
    except Exception as exc:  # the check reports it: the replay itself must work
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    return {
        "status": got.status,
        "result": got.result,
        "error": got.error,
        "next": list(got.next),
        "wait": got.wait,
        "new": list(got.new),
    }


# --- (a) nothing left going behind a run that ended -------------------------------------


def check_settled(captures: Iterable[Mapping[str, Any]]) -> list[str]:
    """Behind a run that ended: a run that succeeded or failed has every step settled
    (done or dead); a cancelled one has no step running (its leases were revoked: a
    pending or retrying step of it is never taken again); and no child run that is not
    detached is still live under a parent that ended. A detached child may outlive
    its parent, so its child step may stay pending."""
    failures: list[str] = []
    for c in captures:
        status = RunStatus(c["status"])
        if status not in ENDED:
            continue
        run = c["run"]
        detached = {k["id"] for k in c["children"] if k["detached"]}
        for s in c["steps"]:
            if s["kind"] == StepKind.CHILD and f"{run}/{s['id']}" in detached:
                continue
            step = StepStatus(s["status"])
            if _left_going(status, s["kind"], step):
                failures.append(f"run {run} is {status} but its step {s['id']} is {step}")
        ended = {run: status} | {
            k["id"]: RunStatus(k["status"]) for k in c["children"] if k["status"] in ENDED
        }
        for k in c["children"]:
            if k["detached"] or RunStatus(k["status"]) not in LIVE:
                continue
            parent = ended.get(k["parent"])
            if parent is not None:
                failures.append(
                    f"child run {k['id']} is {k['status']} but its parent {k['parent']} is {parent}"
                )
    return failures


def _left_going(run: RunStatus, kind: str, step: StepStatus) -> bool:
    """Whether a step so is left going behind a run so that ended."""
    if run is not RunStatus.CANCELLED or kind == StepKind.CHILD:
        return step not in SETTLED
    return step is StepStatus.RUNNING


# --- (b) the run's end is its replay's ------------------------------------------------------


def head(error: str | None) -> str:
    """A recorded error without the traceback of where it was raised."""
    return (error or "").partition(TRACEBACK)[0].strip()


def check_replays(captures: Iterable[Mapping[str, Any]]) -> list[str]:
    """A run that succeeded replays to ``finished`` with the same result; a run that
    failed replays to the same error (a ``NonDeterminism`` the run failed of, to that
    one). A cancelled or live run's replay is not compared, but it must have worked."""
    failures: list[str] = []
    for c in captures:
        run, status, got = c["run"], c["status"], c["replay"]
        if got["status"] == "error":
            failures.append(f"run {run}: its replay failed: {got['error']}")
        elif status == RunStatus.SUCCEEDED:
            if got["status"] != "finished":
                failures.append(f"run {run} succeeded but its replay is {_story(got)}")
            elif _canonical(got["result"]) != _canonical(c["result"]):
                failures.append(
                    f"run {run} succeeded with {_canonical(c['result'])[:CLIP]} but its "
                    f"replay returns {_canonical(got['result'])[:CLIP]}"
                )
        elif status == RunStatus.FAILED:
            if got["status"] not in ("failed", "nondeterminism"):
                failures.append(f"run {run} failed but its replay is {_story(got)}")
            elif head(got["error"]) != head(c["error"]):
                failures.append(
                    f"run {run} failed with {head(c['error'])[:CLIP]!r} but its replay "
                    f"with {head(got['error'])[:CLIP]!r}"
                )
    return failures


def _story(got: Mapping[str, Any]) -> str:
    if got["status"] == "suspended":
        waits = f", waiting for {got['wait']!r}" if got.get("wait") else ""
        return f"suspended before {', '.join(got['next']) or 'nothing'}{waits}"
    return f"{got['status']}: {head(got.get('error'))[:CLIP]}"


# --- (c) a concurrency limit's overlap ------------------------------------------------------


def read_lines(path: Path | str) -> list[dict[str, Any]]:
    """The JSON lines of a log (a limit log, the step log); none if it is missing. A
    line cut short (its writer killed mid-write) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _stops(stopped: Mapping[int, float | Iterable[float]], pid: int) -> list[float]:
    at = stopped.get(pid)
    if at is None:
        return []
    return sorted([float(at)] if isinstance(at, int | float) else [float(t) for t in at])


def intervals(
    lines: Iterable[Mapping[str, Any]],
    stopped: Mapping[int, float | Iterable[float]],
    end: float | None = None,
) -> dict[str, list[tuple[float, float, str]]]:
    """Per limit, each step body's time inside it: (entered, left, who). A body left at
    its ``exit``, or at the moment its process was killed or frozen (``stopped``: pid →
    that time, or times) if that came first: a frozen or dead body calls nothing. One
    that never exited and whose process was never stopped is inside until ``end`` (None:
    the log's last time)."""
    entered: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    exited: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    last = 0.0
    for e in lines:
        key = (e["limit"], e["run"], e["step"], e["epoch"], e["pid"])
        (entered if e["event"] == "enter" else exited)[key].append(float(e["t"]))
        last = max(last, float(e["t"]))
    close = last if end is None else end
    out: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for key, enters in entered.items():
        limit, run, step, epoch, pid = key
        exits = sorted(exited.get(key, []))
        for t in sorted(enters):
            left = next((x for x in exits if x >= t), math.inf)
            if left != math.inf:
                exits.remove(left)
            stop = next((s for s in _stops(stopped, pid) if t <= s < left), None)
            left = stop if stop is not None else left
            if left <= t:
                continue  # stopped as it entered: it was never inside
            who = f"run {run} step {step} epoch {epoch} (pid {pid})"
            out[limit].append((t, close if left == math.inf else left, who))
    return out


def check_overlap(
    lines: Iterable[Mapping[str, Any]],
    capacities: Mapping[str, int],
    stopped: Mapping[int, float | Iterable[float]] | None = None,
    end: float | None = None,
    excused: Iterable[tuple[float, float]] = (),
) -> list[str]:
    """No concurrency limit (``capacities``: its name → its concurrency) ever had more
    step bodies inside it at once, from its ``enter``/``exit`` lines (fields run, step,
    epoch, pid, t, limit, event); ``stopped`` and ``end`` as ``intervals`` takes them.
    One failure per time the count went over, naming the bodies inside then, but a time
    that began inside one of the ``excused`` windows (from, until)."""
    windows = list(excused)
    failures: list[str] = []
    spans = intervals(lines, stopped or {}, end)
    for limit, cap in sorted(capacities.items()):
        # At one instant an exit comes before an enter: the slot was given back first.
        edges = sorted(
            [(t, 1, i) for i, (t, _, _) in enumerate(spans.get(limit, []))]
            + [(left, 0, i) for i, (_, left, _) in enumerate(spans.get(limit, []))]
        )
        inside: set[int] = set()
        over = False
        for t, entering, i in edges:
            if entering:
                inside.add(i)
            else:
                inside.discard(i)
            if len(inside) > cap and not over and not any(lo <= t <= hi for lo, hi in windows):
                who = "; ".join(spans[limit][j][2] for j in sorted(inside))
                failures.append(
                    f"limit {limit} (concurrency {cap}) had {len(inside)} bodies inside at "
                    f"t={t:.3f}: {who}"
                )
            over = len(inside) > cap
    return failures


# --- (d) effects applied exactly once ----------------------------------------------------


def check_effects(
    calls: Iterable[Mapping[str, Any]],
    expected: Iterable[str],
    allowed: Iterable[str] = (),
) -> list[str]:
    """Each key of ``expected`` (``run_id:step_id``, an effect the model says happens)
    applied exactly once at the stand-in provider (``calls``: its call log,
    tests/provider.py ``provider_calls``): never is lost, twice is twice. A key of
    ``allowed`` (an effect that may or may not have happened: its run was cancelled
    around it) at most once; any other key applied is one no run should have made."""
    applied = Counter(c["key"] for c in calls if c["applied"])
    want, may = set(expected), set(allowed)
    failures = [f"effect {key} was never applied (lost)" for key in sorted(want - set(applied))]
    for key, n in sorted(applied.items()):
        if n > 1:
            failures.append(f"effect {key} was applied {n} times")
        elif key not in want and key not in may:
            failures.append(f"effect {key} was applied though no run expects it")
    return failures
