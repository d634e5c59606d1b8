"""Replaying a workflow over its recorded checkpoints (the ``advance`` of a run).

The workflow function runs from the top on every advance. A step already recorded
as done returns its recorded output at once; the first step not yet done stops the
replay (``_Suspend``), after recording it if it is new. So a run resumes at its first
unfinished step, whichever worker replays it.

The replay records and never sends: ``replay_run`` returns the new task steps it
recorded (``Replayed``) and its caller sends them once what recorded them has
committed. ``advance`` is the plain case: replay, then send them all.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from fleet import codec
from fleet.errors import NonDeterminism, PayloadError, StepFailed, StoreUnavailable
from fleet.logs import log_context
from fleet.registry import StepDef, WorkflowDef, check_name
from fleet.secrets import Redactor, redacting
from fleet.states import Incident, RunStatus, StepKind, StepStatus
from fleet.store.ledger import NewCompaction, NewStep
from fleet.store.queries import Snapshot
from fleet.store.rows import RunRow, StepRow
from fleet.transcripts import DEFAULT, summary_messages
from fleet.worker.conversation import Compacted, Conversations, Transcript, Window
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.replay")

MAX_STEP_ID = 300


class _Suspend(BaseException):
    """Stops a replay at the first unfinished step.

    A BaseException so that a workflow's own ``except Exception`` cannot swallow it;
    the replay driver is its only catcher. Unwinding is how a replay that must wait
    leaves the workflow function without running any code past that point.
    """


def _seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def step_shadow(workflow: str, name: str) -> str:
    """The name a step task shows in Flower and logs: ``research.answer``, from the
    step's registered name, never its id (ids hold positions, keys and tool-call ids:
    one Flower series per id would grow without bound)."""
    return f"{workflow}.{name}"


@dataclass(frozen=True)
class NewTask:
    """A task step a replay recorded: a worker must be told to execute it."""

    step_id: str
    name: str


@dataclass
class Replayed:
    """What a replay recorded that must be sent: its new task steps, in order. Send
    them only once the transaction that recorded them has committed (a worker given a
    step the store does not have yet drops it, and the sweeper sends it late)."""

    run_id: str
    queue: str
    workflow: str
    tasks: list[NewTask] = field(default_factory=list)

    def send(self, rt: Runtime) -> None:
        """One message per new task step; a failure to send is the sweeper's to repair."""
        for task in self.tasks:
            rt.dispatcher.execute(
                self.run_id,
                task.step_id,
                self.queue,
                shadow=step_shadow(self.workflow, task.name),
            )


class WorkflowContext:
    """The first argument of a workflow function (see CONTRACT.md)."""

    def __init__(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> None:
        self.run_id: str = run.id
        self.pins: dict[str, Any] = codec.decode(run.pins) or {}
        self._rt = rt
        self._workflow: str = run.workflow
        self._queue: str = run.queue
        self._history = history
        self._pos = 0
        self._counts: dict[str, int] = {}
        self._seen: set[str] = set()
        self.new_tasks: list[NewTask] = []
        self.waiting = False  # the replay stopped at a wait_for or a sleep
        self._wake_seq: int = run.wake_seq
        self.answered = False  # the replay's last write also marked the run advanced
        self.talk = Conversations(rt, run)  # its transcripts and their new messages

    # --- the public surface -----------------------------------------------------

    def step(self, fn: StepDef | str, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        """Run ``fn`` durably once; on replay return its recorded output."""
        sd = self._rt.registry.step(fn)
        step_id = self._next_id(sd.name, key)
        rec = self._expect(step_id, sd.name)
        if rec is None:
            self._record([self._new_task(sd, step_id, args, kwargs)], last=True)
            raise _Suspend
        return self._outcome(rec)

    def map(
        self,
        fn: StepDef | str,
        items: Iterable[Any],
        key: str | Callable[[Any], str] | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """One step per item, run in parallel; results in order.

        ``key`` names the items: a prefix (``key#1``, ``key#2``…) or a function of the item.
        With ``return_exceptions`` a dead item stands in the list as its ``StepFailed``.
        """
        sd = self._rt.registry.step(fn)
        items = list(items)
        ids = []
        for item in items:
            item_key = key(item) if callable(key) else None
            prefix = key if isinstance(key, str) else sd.name
            ids.append(item_key if item_key is not None else self._positional(prefix))
        recs = [self._expect(step_id, sd.name) for step_id in ids]
        new = [
            self._new_task(sd, step_id, (item,), {})
            for step_id, item, rec in zip(ids, items, recs, strict=True)
            if rec is None
        ]
        if new:
            self._record(new, last=True)
            raise _Suspend
        results: list[Any] = []
        for rec in recs:
            assert rec is not None
            try:
                results.append(self._outcome(rec))
            except StepFailed as exc:
                if not return_exceptions:
                    raise
                results.append(exc)
        return results

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
        the last ``keep_last``; with ``raw``, every raw message before them) and record
        its output as the summary that now leads ``transcript.window()``. Raw messages
        are never rewritten; a later compaction supersedes this one. Returns the
        summary messages (nothing new to fold in: the current summary, no step)."""
        if not isinstance(transcript, Transcript):
            raise TypeError("compact() takes a transcript from wf.transcript()")
        if keep_last < 0:
            raise ValueError("keep_last must be 0 or more")
        base = None if raw else transcript.compacted
        upto = max(0, len(transcript) - keep_last)
        if upto <= (base.upto if base else 0) and not raw:
            return list(transcript.compacted.summary) if transcript.compacted else []
        sd = self._rt.registry.step(fn)
        step_id = self._next_id(sd.name, key)
        rec = self._expect(step_id, sd.name)
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
            raise _Suspend
        summary = summary_messages(self._outcome(rec))
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

    def _expect(self, step_id: str, name: str) -> StepRow | None:
        """The recorded step at this position, checked against what the replay asks for."""
        if not step_id or len(step_id) > MAX_STEP_ID:
            raise NonDeterminism(f"step id {step_id!r} must be 1-{MAX_STEP_ID} characters")
        if step_id in self._seen:
            raise NonDeterminism(
                f"non-determinism in run {self.run_id}: step id {step_id!r} is used twice; "
                "give each call its own key"
            )
        self._seen.add(step_id)
        pos = self._pos
        self._pos += 1
        if pos >= len(self._history):
            return None
        rec = self._history[pos]
        if rec.step_id != step_id or rec.name != name:
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
        advanced (its wake-up answered); the caller sends the new tasks after the commit."""
        start = self._pos - len(new)
        positioned = [replace(s, seq=start + i) for i, s in enumerate(new)]
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

    def _outcome(self, rec: StepRow) -> Any:
        if rec.status == StepStatus.DONE:
            value = self._rt.payloads.load(rec.output)
            self.talk.produced(value, rec.step_id)
            return value
        if rec.status == StepStatus.DEAD:
            raise StepFailed(rec.step_id, rec.error or "dead-lettered", rec.attempts)
        raise _Suspend

    def _wait(self, name: str, spec: dict[str, Any], delay: float | None) -> Any:
        step_id = self._positional(name)
        rec = self._expect(step_id, name)
        if rec is None:
            payload = codec.encode({**spec, "timeout": delay}, what=step_id, limit=1024)
            self._record([NewStep(step_id, -1, name, StepKind.WAIT, payload, 1, delay=delay)])
            # A signal that came before this wait is waiting for it already.
            if "signal" in spec and self._rt.ledger.deliver_signals(self.run_id):
                rec = self._rt.queries.step(self.run_id, step_id)
        if rec is not None and rec.status == StepStatus.DONE:
            return self._rt.payloads.load(rec.output)
        self.waiting = True
        raise _Suspend

    def _value(self, name: str, make: Callable[[], Any]) -> Any:
        step_id = self._positional(name)
        rec = self._expect(step_id, name)
        if rec is not None:
            return codec.decode(rec.output)
        output = codec.encode(make(), what=step_id, limit=1024)
        self._record([NewStep(step_id, -1, name, StepKind.VALUE, "{}", 1, output)])
        # A concurrent replay may have recorded its own value first: use the stored one.
        stored = self._rt.queries.step(self.run_id, step_id)
        assert stored is not None
        self._history = [*self._history, stored]
        return codec.decode(stored.output)


def pinned_workflow(rt: Runtime, run: RunRow, step_id: str | None = None) -> WorkflowDef | None:
    """The workflow the run is pinned to, if this worker has that version and pins;
    otherwise None, with the mismatch counted and logged (never silent)."""
    wf = rt.registry.workflows.get(run.workflow)
    if wf is not None and wf.pinned_to(run.version, codec.decode(run.pins) or {}):
        return wf
    have = f"version {wf.version} pins {dict(wf.pins)}" if wf else "no such workflow"
    detail = (
        f"run needs {run.workflow} version {run.version} pins {run.pins} "
        f"(queue {run.queue}); this worker has {have}"
    )
    rt.ledger.incident(
        Incident.VERSION_MISMATCH, run.id, step_id, worker=rt.worker_name, detail=detail
    )
    log.warning("%s: left for a worker that has it", detail)
    return None


def advance(rt: Runtime, run_id: str, snapshot: Snapshot | None = None) -> None:
    """Replay the run and act on where it stands, then send the step(s) it recorded:
    what the ``fleet.advance`` task does. Safe to run concurrently and repeatedly."""
    replayed = replay_run(rt, run_id, snapshot)
    if replayed is not None:
        replayed.send(rt)


def replay_run(rt: Runtime, run_id: str, snapshot: Snapshot | None = None) -> Replayed | None:
    """Replay the run and record where it stands: its next step(s), its wait, or its
    end. Returns the new task steps to send (None: the run was not replayed); sends
    nothing. ``snapshot``: the run and its history, if the caller has just read them."""
    # Redacting: a secret the workflow reveals never shows in the run's error or logs.
    with log_context(run_id=run_id), redacting() as redact:
        return _replay(rt, run_id, snapshot or rt.queries.snapshot(run_id), redact)


# A replay runs only for a run that may move on: finished, cancelled and parked runs
# wait for something other than a replay.
_REPLAYABLE = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING})


def _replay(
    rt: Runtime, run_id: str, snapshot: Snapshot | None, redact: Redactor
) -> Replayed | None:
    if snapshot is None:
        rt.ledger.incident(
            Incident.MALFORMED_MESSAGE, None, detail=f"advance of unknown run {run_id!r}"
        )
        log.warning("advance for unknown run %r dropped", run_id)
        return None
    run, history = snapshot
    status = RunStatus(run.status)
    if status not in _REPLAYABLE:
        return None
    wf = pinned_workflow(rt, run)
    if wf is None:
        return None
    if status is RunStatus.QUEUED:
        rt.ledger.start_run(run_id)
    elif status is RunStatus.WAITING:
        rt.ledger.resume_run(run_id)
    ctx = WorkflowContext(rt, run, history)
    # Whether the replay suspends, returns or raises, what it recorded is to be sent.
    replayed = Replayed(run_id, run.queue, run.workflow, ctx.new_tasks)
    try:
        # Arguments that cannot be loaded fail the run (PayloadError), once.
        args, kwargs = rt.payloads.load_call(run.args, f"arguments of run {run_id}")
        redact.watch((args, kwargs))
        result = wf.fn(ctx, *args, **kwargs)
        if ctx._pos < len(ctx._history):
            raise NonDeterminism(
                f"non-determinism in run {run_id}: the workflow returned after {ctx._pos} steps "
                f"but the history has {len(ctx._history)} (next recorded: "
                f"{ctx._history[ctx._pos].step_id!r})"
            )
        unfinished = ctx.talk.unfinished()
        if unfinished:
            raise NonDeterminism(unfinished)
        encoded = rt.payloads.dump(result, what=f"result of run {run_id}")
        ctx.flush()
    except _Suspend:
        ctx.flush()
        if ctx.waiting:
            rt.ledger.set_waiting(run_id)
        if not ctx.answered:
            rt.ledger.mark_advanced(run_id, run.wake_seq)
        return replayed
    except NonDeterminism as exc:
        # What it appended before the mismatch is not written: the history stays as it was.
        rt.ledger.incident(Incident.NONDETERMINISM, run_id, detail=str(exc))
        log.error("%s", exc)
        _fail(rt, run_id, redact(f"NonDeterminism: {exc}"))
    except StepFailed as exc:
        ctx.flush()
        _fail(rt, run_id, redact(f"StepFailed: {exc}"))
    except PayloadError as exc:
        _fail(rt, run_id, redact(f"PayloadError: {exc}"))
    except StoreUnavailable:
        raise  # the sweeper will advance the run again once the store answers
    except Exception as exc:
        error = "".join(traceback.format_exception_only(exc)).strip()
        _fail(rt, run_id, redact(f"{error}\n\n{traceback.format_exc()}"))
    else:
        rt.ledger.finish_run(run_id, RunStatus.SUCCEEDED, result=encoded)
    rt.ledger.mark_advanced(run_id, run.wake_seq)
    return replayed


def _fail(rt: Runtime, run_id: str, error: str) -> None:
    log.info("run %s failed: %s", run_id, error.partition("\n")[0])
    rt.ledger.finish_run(run_id, RunStatus.FAILED, error=error)
