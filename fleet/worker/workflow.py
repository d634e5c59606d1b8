"""The workflow's side of a replay: ``WorkflowContext``, the first argument of a
workflow function (see CONTRACT.md).

The workflow function runs from the top on every replay. A step already recorded as
done returns its recorded output at once; the first step not yet done stops the
replay (``_park``), after recording it if it is new. Each call is checked against
the history at its position (``_expect``: ``NonDeterminism`` otherwise). What the
replay recorded is left in ``new_tasks`` for the driver (``fleet/worker/replay.py``)
to send once it has committed.

Stopping has two forms. A replayed workflow unwinds (``Suspend``). A live one (run in
a greenlet, fleet/worker/live.py) parks where it stands, and a later advance hands it
that advance's history (``rebind``) and resumes it there: the rows of the positions it
parked on are read again, the rows before them are ``done`` rows, which never change.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import greenlet

from fleet import codec
from fleet.errors import ChildFailed, LimitExceeded, NonDeterminism, StepFailed
from fleet.registry import StepDef, check_name
from fleet.states import StepKind, StepStatus
from fleet.store.ledger import NewChild, NewCompaction, NewStep
from fleet.store.rows import RunRow, StepRow
from fleet.transcripts import DEFAULT, summary_messages
from fleet.worker.children import Children
from fleet.worker.conversation import Compacted, Conversations, Transcript, Window
from fleet.worker.fanout import Fanouts
from fleet.worker.runtime import Runtime

MAX_STEP_ID = 300
_DONE = StepStatus.DONE


class Suspend(BaseException):
    """Stops a replay at the first unfinished step.

    A BaseException so that a workflow's own ``except Exception`` cannot swallow it;
    the replay driver is its only catcher. Unwinding is how a replay that must wait
    leaves the workflow function without running any code past that point.
    """


# What a live workflow's greenlet hands its driver when it parks (see ``_park``).
PARKED = object()


def _is(rec: StepRow, step_id: str, name: str) -> bool:
    """The recorded step is the one the replay asks for at its position."""
    return rec.step_id == step_id and rec.name == name


def _seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


@dataclass(frozen=True)
class NewTask:
    """A task step a replay recorded: a worker must be told to execute it."""

    step_id: str
    name: str


class WorkflowContext(Children, Fanouts):
    """The first argument of a workflow function (see CONTRACT.md); its child runs'
    calls (``child``, ``start_child``) are in fleet/worker/children.py, its fan-outs
    (``map``, ``call``, ``parallel``) in fleet/worker/fanout.py."""

    def __init__(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> None:
        self.run_id: str = run.id
        self.pins: dict[str, Any] = codec.decode(run.pins) or {}
        self._rt = rt
        self._workflow: str = run.workflow
        self._queue: str = run.queue
        self._history = history
        self._pos = 0
        self._counts: dict[str, int] = {}
        self._defs: dict[StepDef | str, StepDef] = {}  # what ``step`` was given → its def
        self._seen: set[str] = set()
        self.new_tasks: list[NewTask] = []
        self.waiting = False  # the replay stopped at a wait_for or a sleep
        self._wake_seq: int = run.wake_seq
        self.answered = False  # the replay's last write also marked the run advanced
        self.talk = Conversations(rt, run)  # its transcripts and their new messages
        self._run = run
        self.new_children: list[NewChild] = []  # child runs recorded: each needs an advance
        # Live (fleet/worker/live.py): run in a greenlet that parks instead of unwinding.
        self.live = False
        # Handed a dead step's error: a replayed dead letter can undo that, so this
        # context is not kept live past its advance.
        self.dirty = False
        # Where it parked: the first position and the step ids it waits on.
        self.parked: tuple[int, tuple[str, ...]] | None = None

    def rebind(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> None:
        """Hand a parked live context a later advance: its runtime (bound to that
        advance's transaction), the run's row and history as it read them. What it
        recorded is that advance's to send."""
        self._rt = rt
        self._run = run
        self._history = history
        self._wake_seq = run.wake_seq
        self.new_tasks = []
        self.new_children = []
        self.waiting = False
        self.answered = False
        self.talk.rebind(rt)

    @property
    def reached(self) -> int:
        """How many recorded steps the workflow has met (or reserved) so far."""
        return self._pos

    @property
    def created_at(self) -> float:
        """When the run was created (its history is read from then on)."""
        return self._run.created_at

    def unreplayed(self) -> str | None:
        """A recorded step a workflow that returned never reached, as the error; None if none."""
        pos, history = self._pos, self._history
        if pos >= len(history):
            return None
        return (
            f"non-determinism in run {self.run_id}: the workflow returned after {pos} steps "
            f"but the history has {len(history)} (next recorded: {history[pos].step_id!r})"
        )

    # --- the public surface -----------------------------------------------------

    def step(self, fn: StepDef | str, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        """Run ``fn`` durably once; on replay return its recorded output."""
        sd = self._defs.get(fn)
        if sd is None:
            sd = self._defs[fn] = self._rt.registry.step(fn)
        name = sd.name
        step_id = self._next_id(name, key)
        # The common case first: a replay over a long history passes here once per
        # recorded step. The step at this position is done and passes ``_expect``'s
        # checks (the same two predicates), so its output is handed back at once.
        pos = self._pos
        if pos < len(self._history):
            done = self._history[pos]
            if done.status is _DONE and _is(done, step_id, name) and self._fresh(step_id):
                self._seen.add(step_id)
                self._pos = pos + 1
                return self.talk.output(done)
        rec = self._expect(step_id, name)
        if rec is None:
            self._record([self._new_task(sd, step_id, args, kwargs)], last=True)
        return self._outcome(rec, self._pos - 1, step_id)

    def wait_for(self, name: str, timeout: timedelta | float | None = None) -> Any:
        """Suspend the run until a signal called ``name`` arrives (its payload is
        returned) or ``timeout`` passes (None is returned). No worker is held meanwhile;
        a signal sent before the wait is kept for it."""
        check_name(name, "signal")
        return self._wait(f"wait:{name}", {"signal": name}, _seconds(timeout))

    def sleep(self, seconds: timedelta | float) -> None:
        """A durable timer: the run sleeps in the store and any worker wakes it."""
        delay = _seconds(seconds)
        if delay is None or delay < 0:
            raise ValueError("sleep needs a non-negative duration")
        self._wait("sleep", {}, delay)

    def transcript(self, name: str = DEFAULT) -> Transcript:
        """The run's durable, append-only message log ``name`` (see CONTRACT.md)."""
        return self.talk.open(name)

    def compact(
        self,
        transcript: Transcript,
        fn: StepDef | str,
        keep_last: int = 20,
        key: str | None = None,
        raw: bool = False,
    ) -> list[dict[str, Any]]:
        """Run ``fn`` as a step over the messages not kept (the current window before
        the last ``keep_last``, or more so that no tool result is kept without the
        call it answers; with ``raw``, every raw message before them) and record
        its output as the summary that now leads ``transcript.window()``. Raw messages
        are never rewritten; a later compaction supersedes this one. Returns the
        summary messages (nothing new to fold in: the current summary, no step)."""
        if not isinstance(transcript, Transcript):
            raise TypeError("compact() takes a transcript from wf.transcript()")
        if keep_last < 0:
            raise ValueError("keep_last must be 0 or more")
        base = None if raw else transcript.compacted
        upto = max(0, len(transcript) - keep_last)
        # Never part a tool call from its results: the kept messages do not begin
        # with a tool result (a provider refuses one whose call it was not shown).
        while 0 < upto < len(transcript) and transcript[upto].get("role") == "tool":
            upto -= 1
        if upto <= (base.upto if base else 0) and not raw:
            return list(transcript.compacted.summary) if transcript.compacted else []
        sd = self._rt.registry.step(fn)
        step_id = self._next_id(sd.name, key)
        rec = self._expect(step_id, sd.name)
        pos = self._pos - 1
        transcript.compactions += 1
        number = transcript.compactions
        if rec is None:
            start = base.upto if base else 0
            self.talk.compactions.append(
                NewCompaction(
                    transcript.name, number, start, upto, base.number if base else None, step_id
                )
            )
            source = Window(transcript, base, upto, start)
            self._record([self._new_task(sd, step_id, (source,), {})], last=True)
        summary = summary_messages(self._outcome(rec, pos, step_id))
        transcript.compacted = Compacted(number, upto, step_id, summary)
        return list(summary)

    def now(self) -> float:
        """The wall-clock time, recorded: replays see the first value."""
        return float(self._value("now", time.time))

    def random(self) -> float:
        """A random float in [0, 1), recorded: replays see the first value."""
        return float(self._value("random", random.random))

    # --- replay mechanics -------------------------------------------------------

    def _positional(self, name: str) -> str:
        n = self._counts.get(name, 0) + 1
        self._counts[name] = n
        return f"{name}#{n}"

    def _next_id(self, name: str, key: str | None) -> str:
        return self._positional(name) if key is None else str(key)

    def _fresh(self, step_id: str) -> bool:
        """A step id this replay may use: 1-MAX_STEP_ID characters, not used before."""
        return 0 < len(step_id) <= MAX_STEP_ID and step_id not in self._seen

    def _expect(self, step_id: str, name: str) -> StepRow | None:
        """The recorded step at this position, checked against what the replay asks for."""
        if not self._fresh(step_id):
            if step_id in self._seen:
                raise NonDeterminism(
                    f"non-determinism in run {self.run_id}: step id {step_id!r} is used twice; "
                    "give each call its own key"
                )
            raise NonDeterminism(f"step id {step_id!r} must be 1-{MAX_STEP_ID} characters")
        self._seen.add(step_id)
        pos = self._pos
        self._pos += 1
        if pos >= len(self._history):
            if pos >= self._rt.settings.max_steps:
                raise LimitExceeded(
                    f"run {self.run_id} reached FLEET_MAX_STEPS={self._rt.settings.max_steps} "
                    f"steps at step {step_id!r}"
                )
            return None
        rec = self._history[pos]
        if not _is(rec, step_id, name):
            raise NonDeterminism(
                f"non-determinism in run {self.run_id}: at position {pos + 1} the replay asked "
                f"for step {step_id!r} ({name}) but the history has {rec.step_id!r} ({rec.name})"
            )
        return rec

    def _new_task(
        self, sd: StepDef, step_id: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> NewStep:
        payload = self._rt.payloads.dump(
            {"args": list(args), "kwargs": kwargs}, what=f"input of step {step_id}"
        )
        return NewStep(step_id, -1, sd.name, StepKind.TASK, payload, sd.retry.max_attempts)

    def flush(self) -> None:
        """Write the messages appended since the last steps were recorded."""
        messages, compactions = self.talk.taken()
        if messages or compactions:
            self._rt.ledger.record_steps(
                self.run_id, [], messages=messages, compactions=compactions
            )

    def _record(self, new: list[NewStep], last: bool = False) -> None:
        """Record steps the replay reached past the end of the history (and the
        messages appended before them). ``_expect``
        reserved their positions in call order, so they are the last ``len(new)``.
        ``last``: the replay suspends right after, so the same write marks the run
        advanced (its wake-up answered); the caller sends the new tasks after the commit.
        Two or more steps recorded at once are a fan-out (map, parallel): each is marked
        with the seq of its first, so that only its last branch to settle wakes the run."""
        start = self._pos - len(new)
        fanout = start if len(new) > 1 else None
        positioned = [replace(s, seq=start + i, fanout=fanout) for i, s in enumerate(new)]
        messages, compactions = self.talk.taken()
        self._rt.ledger.record_steps(
            self.run_id,
            positioned,
            advanced_seq=self._wake_seq if last else None,
            messages=messages,
            compactions=compactions,
        )
        self.answered = last
        self.new_tasks.extend(
            NewTask(s.step_id, s.name) for s in positioned if s.kind == StepKind.TASK
        )
        self.new_children.extend(s.child for s in positioned if s.child is not None)

    def _outcome(self, rec: StepRow | None, pos: int, step_id: str) -> Any:
        """The outcome of the step at ``pos`` (``rec``: its row, None if this replay
        recorded it), once it has settled: its output, or its error raised."""
        while rec is None or not rec.status.finished:
            (rec,) = self._park(pos, (step_id,))
        if rec.status is _DONE:
            return self.talk.output(rec)
        self.dirty = True
        if rec.kind == StepKind.CHILD:
            raise ChildFailed(rec.step_id, rec.error or "child run failed", rec.attempts)
        raise StepFailed(rec.step_id, rec.error or "dead-lettered", rec.attempts)

    def _settled(self, pos: int, step_id: str) -> Any:
        """``_outcome`` of the step at ``pos`` as this advance's history has it (a
        child's handle may be asked long after it was started)."""
        rec = self._history[pos] if pos < len(self._history) else None
        return self._outcome(rec, pos, step_id)

    def _park(self, start: int, ids: Sequence[str]) -> Sequence[StepRow]:
        """Stop here until the steps ``ids`` at positions ``start``… have moved on.
        Replayed: unwind (``Suspend``). Live: park the greenlet; a later advance
        resumes it with its own history (``rebind``), whose rows at those positions are
        returned (the driver has checked they are these steps)."""
        if not self.live:
            raise Suspend
        self.parked = (start, tuple(ids))
        greenlet.getcurrent().parent.switch(PARKED)
        self.parked = None
        return self._history[start : start + len(ids)]

    def _wait(self, name: str, spec: dict[str, Any], delay: float | None) -> Any:
        step_id = self._positional(name)
        rec = self._expect(step_id, name)
        pos = self._pos - 1
        if rec is None:
            payload = codec.encode({**spec, "timeout": delay}, what=step_id, limit=1024)
            self._record([NewStep(step_id, -1, name, StepKind.WAIT, payload, 1, delay=delay)])
        # A signal that came before this wait is waiting for it already: handed over
        # here when the wait is recorded, and again by a replay that finds it pending
        # (its advance may have died between the two, where each store call commits
        # on its own; nothing else would ever hand it over).
        if "signal" in spec and (rec is None or rec.status is not _DONE) and self._hand_over_kept():
            rec = self._rt.queries.step(self.run_id, step_id)
        while rec is None or rec.status is not _DONE:
            self.waiting = True
            (rec,) = self._park(pos, (step_id,))
        return self._rt.payloads.output(rec)

    def _hand_over_kept(self) -> bool:
        """Hand the run's pending waits the signals kept for them; whether any was."""
        return bool(self._rt.ledger.deliver_signals(self.run_id))

    def _value(self, name: str, make: Callable[[], Any]) -> Any:
        step_id = self._positional(name)
        rec = self._expect(step_id, name)
        if rec is not None:
            if rec.status is not _DONE:
                self.dirty = True
            return codec.decode(rec.output)
        output = codec.encode(make(), what=step_id, limit=1024)
        self._record([NewStep(step_id, -1, name, StepKind.VALUE, "{}", 1, output)])
        # A concurrent replay may have recorded its own value first: use the stored one.
        stored = self._rt.queries.step(self.run_id, step_id)
        assert stored is not None
        self._history = [*self._history, stored]
        return codec.decode(stored.output)
