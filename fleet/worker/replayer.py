"""A recorded run replayed in the caller's process, writing nothing
(``fleet.testing.replay``; Temporal's ``Replayer`` does the same with its histories).

The run's workflow function runs from the top over its history as an advance runs it:
the same ``WorkflowContext``, every call checked against the history at its position
(``NonDeterminism`` names the first step that differs), each recorded step handing
back its recorded output, each wait its signal, ``now`` and ``random`` their values,
each transcript its messages. No step body, effect or model call runs: none is ever
run by a replay. Where an advance would record something (new steps, a wait, a value),
``ReplayContext`` notes it instead; where an advance would stop, the replay stops.
``Replay`` says where it ended: the workflow's result or error, or the steps it stands
before.

Nothing here writes. The replay's runtime reads a store opened read-only
(fleet/store/readonly.py), so a write tried by mistake is refused by the database, or
a history exported from one (``fleet export``, fleet/store/exports.py), with no
database at all; its dispatcher sends nothing; a value too large to inline is
referenced, never stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from fleet import codec
from fleet.config import Settings
from fleet.errors import BadInput, NonDeterminism, StoreUnavailable, UnknownRun
from fleet.logs import log_context
from fleet.records import Replay
from fleet.registry import Registry, WorkflowDef
from fleet.secrets import redacting
from fleet.states import RunStatus, StepKind
from fleet.store.exports import Exported
from fleet.store.ledger import Ledger, NewStep
from fleet.store.payloads import BLOB, Payloads
from fleet.store.queries import Queries
from fleet.store.readonly import read_only
from fleet.store.rows import RunRow, StepRow
from fleet.worker.dispatch import Dispatcher, Message
from fleet.worker.replay import check_all_replayed, error_text
from fleet.worker.runtime import Runtime
from fleet.worker.workflow import Suspend, WorkflowContext

# What a replay records and at once stops at: it cannot know a wait's signal or a
# value (now, random) the history does not hold.
_STOPS = frozenset({StepKind.WAIT, StepKind.VALUE})
_ENDED = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED})


class _Unsent:
    """The replay's ``Sender``: a replay sends no wake-up."""

    def send(self, message: Message) -> None:
        raise RuntimeError(f"a local replay sends nothing (it was asked to send {message.task})")

    def waiting(self, queues: Sequence[str]) -> int:
        return 0


class _Unstored(Payloads):
    """Values too large to inline are referenced by their hash, as recorded ones are,
    and not stored."""

    def store(self, text: str) -> str:
        if len(text.encode()) <= self.settings.max_payload_bytes:
            return text
        return BLOB + hashlib.sha256(text.encode()).hexdigest()


def local_runtime(
    settings: Settings, registry: Registry, history: Exported | None = None
) -> Runtime:
    """A runtime for replays of runs in ``settings``' store, opened read-only, or, given
    ``history``, of the run an exported history holds, with no store at all (its reads
    answered from the file's rows, fleet/store/exports.py): dispose of its ``db`` when
    done."""
    queries = Queries(read_only(settings.database_url)) if history is None else history
    db = queries.db
    ledger = Ledger(db, grace=settings.sweep_grace)
    rt = Runtime(settings, db, ledger, queries, registry, Dispatcher(_Unsent()))
    rt.payloads = _Unstored(settings, ledger, queries)
    return rt


@dataclass(frozen=True)
class _New:
    """A step the replay would record: its position and id."""

    pos: int
    step_id: str


class ReplayContext(WorkflowContext):
    """A ``WorkflowContext`` whose records are noted, never written (``new``), and
    which stops where an advance would stop (``parked``: the first position and the
    ids of the steps it waits on)."""

    def __init__(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> None:
        super().__init__(rt, run, history)
        self.new: list[_New] = []

    def _record(self, new: list[NewStep], last: bool = False) -> None:
        start = self._pos - len(new)
        self.new.extend(_New(start + i, s.step_id) for i, s in enumerate(new))
        if any(s.kind in _STOPS for s in new):
            self.waiting = any(s.kind is StepKind.WAIT for s in new)
            self._park(start, [s.step_id for s in new])

    def _park(self, start: int, ids: Sequence[str]) -> Sequence[StepRow]:
        self.parked = (start, tuple(ids))
        raise Suspend

    def _hand_over_kept(self) -> bool:
        """A wait stays as recorded: handing it a kept signal is a write."""
        return False

    @property
    def met(self) -> int:
        """How many recorded steps the replay met."""
        return min(self._pos, len(self._history))

    def standing(self) -> tuple[str, ...]:
        """The steps the stopped replay stands before, in order: those it waits on that
        are not finished, and those it would record."""
        start, ids = self.parked or (self._pos, ())
        history = self._history
        at = {n.pos: n.step_id for n in self.new}
        for i, step_id in enumerate(ids):
            pos = start + i
            if pos >= len(history) or not history[pos].status.finished:
                at[pos] = step_id
        return tuple(at[pos] for pos in sorted(at))

    def unrecorded(self) -> str | None:
        """What the replay would record that a run which ended did not: a step or a
        message its history does not hold (its code has changed)."""
        if self.new:
            first = self.new[0]
            return f"step {first.step_id!r} at position {first.pos + 1}"
        messages = self.talk.messages
        if messages:
            return f"message {messages[0].pos} of transcript {messages[0].transcript!r}"
        return None


def replay_recorded(rt: Runtime, run_id: str, workflow: WorkflowDef | None = None) -> Replay:
    """Replay run ``run_id`` over its history, in this process, with ``workflow`` (None:
    the registered workflow of the run's name, version and pins). Raises
    ``NonDeterminism`` where the workflow no longer does what the history records,
    ``UnknownRun``, or ``BadInput`` when the registered workflow is not the run's."""
    snapshot = rt.queries.snapshot(run_id)
    if snapshot is None:
        raise UnknownRun(f"no run {run_id!r} in the store")
    run, history = snapshot
    wf = workflow or _registered(rt, run)
    ctx = ReplayContext(rt, run, history)
    with log_context(run_id=run_id), redacting() as redact:
        try:
            args, kwargs = rt.payloads.load_call(run.args, f"arguments of run {run_id}")
            redact.watch((args, kwargs))
            returned = wf.fn(ctx, *args, **kwargs)
            check_all_replayed(ctx)
            limit = rt.settings.max_blob_bytes
            text = codec.encode(returned, what=f"result of run {run_id}", limit=limit)
            replay = Replay(run_id, "finished", result=codec.decode(text), replayed=ctx.met)
        except Suspend:
            replay = _suspended(ctx, run_id)
        except (NonDeterminism, StoreUnavailable):
            raise
        except Exception as exc:
            replay = Replay(run_id, "failed", error=redact(error_text(exc)), replayed=ctx.met)
    unrecorded = ctx.unrecorded() if run.status in _ENDED else None
    if unrecorded is not None:
        raise NonDeterminism(
            f"non-determinism in run {run_id}: the run {run.status} but its replay would "
            f"record {unrecorded}, which its history does not hold"
        )
    return replay


def _suspended(ctx: ReplayContext, run_id: str) -> Replay:
    standing = ctx.standing()
    wait = None
    if ctx.waiting and ctx.parked is not None:
        name = ctx.parked[1][0].rpartition("#")[0]
        wait = name.removeprefix("wait:") if name.startswith("wait:") else None
    return Replay(
        run_id,
        "suspended",
        next=standing,
        wait=wait,
        new=tuple(n.step_id for n in ctx.new),
        replayed=ctx.met,
    )


def _registered(rt: Runtime, run: RunRow) -> WorkflowDef:
    """The registered workflow the run is pinned to; ``BadInput`` naming both if the one
    of its name is another version (or pins)."""
    wf = rt.registry.workflow(run.workflow)
    if not wf.pinned_to(run.version, codec.decode(run.pins) or {}):
        raise BadInput(
            f"run {run.id} is of {run.workflow} version {run.version} pins {run.pins}; the "
            f"registered one is version {wf.version} pins {dict(wf.pins)}: name it as the "
            "workflow (workflow=, fleet replay --workflow) to replay the run with it anyway"
        )
    return wf
