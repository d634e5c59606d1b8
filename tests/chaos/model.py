"""The model: a program's expected end, computed in process by running its meaning
(``programs.interpret``) on a stand-in for fleet's ``WorkflowContext`` that knows what
fleet does, never on fleet's engine.

``expected(program, root_id, died=...)`` says, for the root run and every child run
that must exist: how it ends (``succeeded`` with its result, ``failed`` with its error,
``cancelled`` with why), its "main" transcript (raw messages and the model's window);
which effects the provider must have applied once (``effects``) and which at most
once (``maybe_effects``); and what the driver must do (``signals``, ``cancel``,
``budget``). What fleet does, as the model knows it (fleet/worker/workflow.py,
fanout.py, children.py, replay.py, failures.py, fleet/store/family.py, CONTRACT.md):

- a step is retried until its cap (``programs.cap``) unless it raises NonRetryable; a
  dead step raises ``StepFailed``: "step <id> failed after <n> attempt(s): <Type>: <msg>";
- ``map``/``parallel`` settle every branch first; with ``return_exceptions`` a dead
  branch stands in the list as its StepFailed; one dead branch is raised as is, several
  as "<n> branches failed (<ids>); the first: <first one>";
- a failed child raises ``ChildFailed``: "child <step id> failed: child run <run id>
  <status>: <the first line of the child's error>";
- a run whose workflow raised StepFailed fails with "StepFailed: <its message>";
- a cancelled run's error is "cancelled: <reason>"; cancelling (or ending) a run cancels
  its live attached children and theirs ("cancelled: parent run <id> cancelled"),
  never a detached one;
- a wait with a timeout nobody answers returns None; a signal sent before its wait is
  kept for it;
- a run whose tree's spend has reached its budget shows ``needs_decision`` before its
  next step until ``raise_budget`` (a child's budget is capped by what its parent has
  left when it starts); raised, it goes on: its end does not depend on it;
- ``compact`` summarizes the current window before the last ``keep_last`` messages
  (the previous summary, then the raw messages after what it covered), or runs no step
  when that covers nothing new; the window is the latest done summary, then the raw
  messages after it.

Faults cost attempts: ``died`` is the set of step ids that ended dead with an attempt
interrupted by a fault. Such a step is dead whatever its own mode, after an unknown
number of attempts with an unknown error: its text is "step <id> failed after *
attempt(s): *", and the observed error is compared through ``stable_error``, which
writes any died step's text so. An effect that died may have been applied (0 or 1).

Errors are compared by their first line (a workflow's own exception would add its
traceback after it); results as JSON values with types kept (tests.harness.same).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet import NonRetryable, StepFailed
from tests.chaos import programs as P

CANCEL_REASON = "chaos driver: stuck mid-fan-out"
WILD = "*"


@dataclass
class RunEnd:
    """How one run ends: ``status`` succeeded | failed | cancelled (``waiting``: it
    never ends, which no valid program does), its ``result`` or ``error`` (the
    stable first line), its "main" transcript."""

    run_id: str
    parent: str | None
    detached: bool
    status: str
    result: Any = None
    error: str | None = None
    raw: list[dict[str, Any]] = field(default_factory=list)
    window: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Signal:
    """A signal the driver sends: ``mode`` before (as soon as the run exists), after (once
    the run waits on it) or after_id (then with the wait's id)."""

    run_id: str
    name: str
    payload: Any
    mode: str


@dataclass(frozen=True)
class Cancel:
    """The driver cancels ``run_id`` once ``stuck_run`` waits on ``wait`` and the task
    steps ``settled`` (of ``run_id``) have settled."""

    run_id: str
    stuck_run: str
    wait: str
    settled: tuple[str, ...]
    reason: str = CANCEL_REASON


@dataclass
class Expected:
    root: str
    runs: dict[str, RunEnd]
    effects: dict[str, int]  # idempotency key -> applications the provider must show
    maybe_effects: set[str]  # died effects: applied once or not at all
    signals: list[Signal]
    cancel: Cancel | None
    budget: int | None  # the root's token budget: its tree may park on it
    died: frozenset[str] = frozenset()

    @property
    def end(self) -> RunEnd:
        return self.runs[self.root]


class _Dead(StepFailed):
    """A dead step (or child, or fan-out) as the workflow sees it; ``text`` is its message."""

    def __init__(self, step_id: str, text: str) -> None:
        super().__init__(step_id, text)
        self.text = text
        self.args = (text,)


class _Stuck(BaseException):
    """The run waits on something nobody will ever answer."""

    def __init__(self, cancel: Cancel | None = None) -> None:
        super().__init__()
        self.cancel = cancel


@dataclass
class _Call:
    fn: str
    args: tuple[Any, ...]
    key: str


class _Handle:
    def __init__(self, step_id: str, end: RunEnd) -> None:
        self.step_id = step_id
        self.end = end

    def result(self) -> Any:
        end = self.end
        if end.status == "succeeded":
            return json.loads(json.dumps(end.result))
        if end.status == "waiting":
            raise _Stuck()
        raise _Dead(
            self.step_id,
            f"child {self.step_id} failed: child run {end.run_id} {end.status}: {end.error}",
        )


class _Chat:
    """A run's "main" transcript: raw messages, compactions (upto, summary or None if its
    step died), and the latest compaction this run has passed."""

    def __init__(self) -> None:
        self.raw: list[dict[str, Any]] = []
        self.done: list[tuple[int, list[dict[str, Any]]]] = []
        self.passed: tuple[int, list[dict[str, Any]]] | None = None

    def append(self, message: dict[str, Any]) -> None:
        self.raw.append(json.loads(json.dumps(message)))

    def __len__(self) -> int:
        return len(self.raw)

    def window(self) -> list[dict[str, Any]]:
        if self.passed is None:
            return list(self.raw)
        upto, summary = self.passed
        return [*summary, *self.raw[upto:]]

    def recorded_window(self) -> list[dict[str, Any]]:
        """``TranscriptInfo.window()``: the latest done compaction's summary, then after."""
        if not self.done:
            return list(self.raw)
        upto, summary = self.done[-1]
        return [*summary, *self.raw[upto:]]


class _Context:
    """The model's ``WorkflowContext`` for one run."""

    def __init__(self, sim: _Sim, run_id: str) -> None:
        self.sim = sim
        self.run_id = run_id
        self.chat = _Chat()

    # -- steps and fan-outs

    def step(self, name: str, *args: Any, key: str) -> Any:
        return self._outcome(self.sim.attempts(self.run_id, name, args, key))

    @staticmethod
    def _outcome(value: Any) -> Any:
        if isinstance(value, _Dead):
            raise value
        return value

    def map(self, name: str, items: list[Any], key: str, return_exceptions: bool = False) -> Any:
        got = [
            self.sim.attempts(self.run_id, name, (item,), f"{key}#{n}")
            for n, item in enumerate(items, 1)
        ]
        return self._gather(got, return_exceptions)

    def call(self, fn: str, *args: Any, key: str) -> _Call:
        return _Call(fn, args, key)

    def parallel(self, *calls: _Call, return_exceptions: bool = False) -> list[Any]:
        got: list[Any] = []
        stuck: list[str] = []
        for c in calls:
            if c.fn == P.WORKFLOW:
                handle = self.start_child(c.fn, *c.args, key=c.key)
                if handle.end.status == "waiting":
                    stuck.append(c.key)
                    got.append(None)
                    continue
                try:
                    got.append(handle.result())
                except _Dead as exc:
                    got.append(exc)
            else:
                got.append(self.sim.attempts(self.run_id, c.fn, c.args, c.key))
        if stuck:  # a branch never settles: the fan-out never returns
            settled = tuple(c.key for c in calls if c.fn != P.WORKFLOW)
            child = f"{self.run_id}/{stuck[0]}"
            raise _Stuck(Cancel(self.run_id, child, self.sim.stuck_wait[child], settled))
        return self._gather(got, return_exceptions)

    @staticmethod
    def _gather(got: list[Any], return_exceptions: bool) -> list[Any]:
        dead = [g for g in got if isinstance(g, _Dead)]
        if dead and not return_exceptions:
            if len(dead) == 1:
                raise dead[0]
            names = ", ".join(d.step_id for d in dead)
            text = f"{len(dead)} branches failed ({names}); the first: {dead[0].text}"
            raise _Dead(dead[0].step_id, text)
        return got

    # -- children

    def child(self, workflow: str, *args: Any, key: str) -> Any:
        return self.start_child(workflow, *args, key=key).result()

    def start_child(self, workflow: str, *args: Any, key: str, detached: bool = False) -> _Handle:
        assert workflow == P.WORKFLOW
        child_id = f"{self.run_id}/{key}"
        return _Handle(key, self.sim.run(child_id, args[0], self.run_id, detached))

    # -- waits

    def wait_for(self, name: str, timeout: float | None = None) -> Any:
        planned = self.sim.planned.get(name)
        if planned is not None:
            v, mode = planned
            self.sim.signals.append(Signal(self.run_id, name, {"v": v}, mode))
            return {"v": v}
        if timeout is not None:
            return None
        self.sim.stuck_wait[self.run_id] = name
        raise _Stuck()

    def sleep(self, seconds: float) -> None:
        return None

    # -- transcripts

    def transcript(self, name: str = "main") -> _Chat:
        assert name == "main"
        return self.chat

    def compact(self, chat: _Chat, fn: str, keep_last: int, key: str) -> list[dict[str, Any]]:
        base_upto, base_summary = chat.passed if chat.passed else (0, [])
        upto = max(0, len(chat) - keep_last)  # (no tool messages in programs)
        if upto <= base_upto:
            return list(base_summary)
        source = [*base_summary, *chat.raw[base_upto:upto]]
        got = self.sim.attempts(self.run_id, fn, (source,), key)
        if isinstance(got, _Dead):
            raise got
        summary = [{"role": "system", "content": got}]
        chat.passed = (upto, summary)
        chat.done.append((upto, summary))
        return list(summary)


class _Sim:
    """One program's model run: every run of its tree, its effects and the driver's plan."""

    def __init__(self, program: Mapping[str, Any], died: frozenset[str]) -> None:
        self.died = died
        self.runs: dict[str, RunEnd] = {}
        self.effects: dict[str, int] = {}
        self.maybe: set[str] = set()
        self.signals: list[Signal] = []
        self.stuck_wait: dict[str, str] = {}
        self.plan: Cancel | None = None  # the run the driver cancels, and when
        self.planned = {
            P.signal_name(op["id"]): (op["v"], op["mode"])
            for op in P.walk(program)
            if op["op"] == "signal"
        }

    def attempts(self, run_id: str, name: str, args: tuple[Any, ...], step_id: str) -> Any:
        """The step's output, or its ``_Dead`` (not raised), after its attempts."""
        if name == "chaos_effect":
            key = f"{run_id}:{step_id}"
            if step_id in self.died:
                self.maybe.add(key)
            else:
                self.effects[key] = 1
        if step_id in self.died:
            return _Dead(step_id, f"step {step_id} failed after {WILD} attempt(s): {WILD}")
        args = json.loads(json.dumps(args))  # what a step is given went through JSON
        cap = P.cap(name)
        for attempt in range(1, cap + 1):
            try:
                out = P.perform(name, args, step_id, attempt, fast=True)
            except Exception as exc:
                if isinstance(exc, NonRetryable) or attempt == cap:
                    error = f"{type(exc).__name__}: {exc}"
                    text = f"step {step_id} failed after {attempt} attempt(s): {error}"
                    return _Dead(step_id, text)
                continue
            if name == "chaos_effect":
                return {"receipt": f"{run_id}:{step_id}", "body": out}
            return out
        raise AssertionError("unreachable")

    def run(
        self, run_id: str, args: Mapping[str, Any], parent: str | None, detached: bool
    ) -> RunEnd:
        ctx = _Context(self, run_id)
        end = RunEnd(run_id, parent, detached, "waiting")
        self.runs[run_id] = end
        try:
            result = P.interpret(ctx, args)
        except _Dead as exc:
            end.status, end.error = "failed", f"StepFailed: {exc.text}"
        except _Stuck as stuck:
            if stuck.cancel is not None:
                if parent is not None:
                    raise AssertionError(f"a cancel below the root, in {run_id}") from None
                self.plan = stuck.cancel
        else:
            end.status, end.result = "succeeded", json.loads(json.dumps(result))
        end.raw, end.window = list(ctx.chat.raw), ctx.chat.recorded_window()
        return end

    def cancel(self, run_id: str, reason: str) -> None:
        """``run_id`` is cancelled: it and its live attached descendants end."""
        self.runs[run_id].status, self.runs[run_id].error = "cancelled", f"cancelled: {reason}"
        why = f"parent run {run_id} cancelled"
        stack = [run_id]
        while stack:
            parent = stack.pop()
            for end in self.runs.values():
                if end.parent == parent and not end.detached and end.status == "waiting":
                    end.status, end.error = "cancelled", f"cancelled: {why}"
                    stack.append(end.run_id)


def _step_ids(died: Iterable[Any]) -> frozenset[str]:
    """Died steps as step ids: given as ids or as (run id, step id) pairs."""
    return frozenset(d if isinstance(d, str) else d[1] for d in died)


def expected(program: Mapping[str, Any], root_id: str, died: Iterable[Any] = ()) -> Expected:
    """What must be true once the run ``root_id`` of ``program`` and its tree have ended,
    given the steps that ``died`` of faults (ids, or (run id, step id) pairs)."""
    ids = _step_ids(died)
    sim = _Sim(program, ids)
    sim.run(root_id, program, None, False)
    if sim.plan is not None:
        sim.cancel(sim.plan.run_id, sim.plan.reason)
    budget = program.get("budget") or {}
    return Expected(
        root=root_id,
        runs=sim.runs,
        effects=sim.effects,
        maybe_effects=sim.maybe,
        signals=sim.signals,
        cancel=sim.plan,
        budget=budget.get("tokens"),
        died=ids,
    )


# --- comparing an observed end with the model's ------------------------------------------


def stable_error(error: str | None, died: Iterable[Any] = ()) -> str | None:
    """What of a run's error the model predicts: its first line, with the text of every
    died step (the end of the line) written "failed after * attempt(s): *"."""
    if error is None:
        return None
    line = error.partition("\n")[0]
    for step_id in sorted(_step_ids(died)):
        pattern = rf"step {re.escape(step_id)} failed after \d+ attempt\(s\): .*$"
        line = re.sub(pattern, f"step {step_id} failed after {WILD} attempt(s): {WILD}", line)
    return line


@dataclass
class Observed:
    """A run as read from the store (or a capture): status, result, error, transcript."""

    status: str
    result: Any = None
    error: str | None = None
    raw: list[dict[str, Any]] = field(default_factory=list)
    window: list[dict[str, Any]] = field(default_factory=list)


def same(a: Any, b: Any) -> bool:
    """JSON values equal with their types kept (1, 1.0 and True differ); key order aside."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same(v, b[k]) for k, v in a.items())
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def differences(
    exp: Expected, seen: Mapping[str, Observed], applied: Mapping[str, int]
) -> list[str]:
    """Every way what was observed differs from the model: ``seen`` holds the runs of
    the tree found in the store (by id), ``applied`` the provider's applications by
    idempotency key (keys of other programs are ignored). Empty: as modeled."""
    out: list[str] = []
    missing = sorted(set(exp.runs) - set(seen))
    extra = sorted(set(seen) - set(exp.runs))
    if missing:
        out.append(f"runs missing: {missing}")
    if extra:
        out.append(f"runs that should not exist: {extra}")
    for run_id, want in exp.runs.items():
        got = seen.get(run_id)
        if got is None:
            continue
        if got.status != want.status:
            out.append(f"{run_id}: {got.status}, expected {want.status} ({want.error or 'ok'})")
            continue
        if want.status == "succeeded" and not same(got.result, want.result):
            out.append(f"{run_id}: result {_short(got.result)}, expected {_short(want.result)}")
        error = stable_error(got.error, exp.died)
        if want.status != "succeeded" and error != want.error:
            out.append(f"{run_id}: error {error!r}, expected {want.error!r}")
        if not same(got.raw, want.raw):
            out.append(f"{run_id}: transcript {_short(got.raw)}, expected {_short(want.raw)}")
        elif not same(got.window, want.window):
            out.append(f"{run_id}: window {_short(got.window)}, expected {_short(want.window)}")
    mine = (exp.root + ":", exp.root + "/")
    for key, n in sorted(applied.items()):
        if not key.startswith(mine) or not n:
            continue
        if key in exp.maybe_effects:
            if n > 1:
                out.append(f"effect {key} applied {n} times (died: at most once)")
        elif exp.effects.get(key, 0) != n:
            out.append(f"effect {key} applied {n} times, expected {exp.effects.get(key, 0)}")
    for key, n in exp.effects.items():
        if not applied.get(key):
            out.append(f"effect {key} applied 0 times, expected {n}")
    return out


def applications(calls: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """The provider's applications by key, from its call log (tests.provider)."""
    return Counter(c["key"] for c in calls if c.get("applied"))


def _short(value: Any, n: int = 300) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= n else text[: n - 3] + "..."
