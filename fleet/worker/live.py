"""Live runs: a run's workflow kept suspended in the worker between its advances.

A replay runs the workflow function from the top over the run's recorded outputs, so
an advance costs time in proportion to the run's length. A live run's workflow runs in
a greenlet instead: where a replay would unwind (``Suspend``) it parks
(``WorkflowContext._park``), and this process keeps it. The run's next advance on the
same thread hands it that advance's history and resumes it where it parked, whatever
the run's length (Temporal's sticky workflow cache does the same for its workers).

What the resumed workflow goes on to do is exactly what a replay from the top over the
same history would do:
- everything it was handed before the positions it parked on came from ``done`` rows,
  and a done row never changes (the argument of fleet/store/history.py); a context
  that was handed a dead step's error (``dirty``) is not kept, since a replayed dead
  letter turns that step back to pending;
- the rows of the positions it parked on are read again from the new history, which
  ``take`` first checks has those very steps there, and every position it reserved;
- it is the same run (id and creation time: retention may delete a finished run and
  the id be enqueued again), the same workflow of the same registry and store;
- it is kept only once the transaction its advance wrote in has committed
  (``after_commit``): a workflow that went on past writes that rolled back is dropped,
  never resumed.
Anything else (another process or thread, an entry dropped for room, a check that
fails) replays from the top, which stays the recovery path every kill test exercises.

A greenlet resumes only on the thread that made it: one entry per run, resumed only by
an advance on its thread (and one whose thread died, its ident taken by another, is
refused by ``bind``). Not on a gevent pool, where every task is a greenlet of one
thread and a store call switches greenlets under the workflow: there every advance
replays. At most ``FLEET_LIVE_RUNS`` entries per process, holding at most ``MAX_BYTES``
of recorded outputs between them (a parked workflow keeps every output it was handed
alive, as the workflow itself often does), the least recently parked dropped first.

A dropped greenlet is unwound (``GreenletExit``) by its own thread, from plain code: at
once if the drop is there, else at that thread's next ``take`` (its orphans). It is
never let go on another thread: the greenlet library then kills it on its own thread at
that thread's next greenlet call, which may be in the middle of a switch, and the
dying greenlet's ``GreenletExit`` message came back from a switch it had no part in:
the loop's thread, resuming a run's workflow after its commit failed, took "Killing the
greenlet because all references have vanished." for the workflow's return value and
recorded it as the run's result (tests/integration/test_async_store_cut.py, about 1
in 14). ``Live.run`` also refuses such a value rather than record it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import greenlet

from fleet.errors import StoreUnavailable
from fleet.registry import Registry, WorkflowDef
from fleet.store.engine import Database, after_commit
from fleet.store.rows import RunRow, StepRow
from fleet.worker.runtime import Runtime, under_gevent
from fleet.worker.workflow import PARKED, Suspend, WorkflowContext

log = logging.getLogger("fleet.live")

# What the parked workflows of one process may hold between them, in recorded bytes of
# the outputs they were handed (the history cache's bound, fleet/store/history.py).
MAX_BYTES = 64 * 1024 * 1024


@dataclass(eq=False)
class Live:
    """One run's workflow, started or parked in a greenlet of ``thread``."""

    ctx: WorkflowContext
    wf: WorkflowDef
    args: list[Any]
    kwargs: dict[str, Any]
    registry: Registry  # the runtime's it was started with: a resume's must be the same
    db: Database
    created_at: float
    thread: int = field(default_factory=threading.get_ident)
    glet: greenlet.greenlet | None = None
    # The secret values its workflow revealed in earlier advances: each advance's
    # redactor masks them too, as a replay that revealed them again would.
    revealed: frozenset[str] = frozenset()

    def run(self) -> Any:
        """Start or resume the workflow here until it parks (``PARKED``), returns (its
        result) or raises (its exception, raised here)."""
        if self.glet is None:
            self.ctx.live = True
            self.glet = greenlet.greenlet(self._body)
        self.glet.parent = greenlet.getcurrent()
        # It sees this advance's context variables (its log context, its redactor).
        self.glet.gr_context = contextvars.copy_context()
        value = self.glet.switch()
        if value is not PARKED and not self.glet.dead:
            # Not the workflow's: it neither parked nor returned. Another greenlet's end
            # came back through this switch (module docstring); nothing is recorded of
            # it, and the run is advanced again from the store.
            self.drop()
            raise StoreUnavailable(
                f"run {self.ctx.run_id}: its workflow's greenlet was switched away from "
                f"(got {value!r:.100}); the run will be advanced again"
            )
        return value

    def bind(self) -> bool:
        """Make the greenlet that is running now the one it parks back to; False if it
        cannot be (its thread died and another got the same ident: the greenlet
        library refuses a parent on another thread)."""
        assert self.glet is not None
        try:
            self.glet.parent = greenlet.getcurrent()
        except (ValueError, greenlet.error):
            return False
        return True

    def _body(self) -> Any:
        return self.wf.fn(self.ctx, *self.args, **self.kwargs)

    @property
    def parked(self) -> bool:
        return self.glet is not None and not self.glet.dead and self.ctx.parked is not None

    def fits(self, rt: Runtime, run: RunRow, history: Sequence[StepRow]) -> bool:
        """It may be resumed for this advance of ``run`` over ``history``."""
        ctx = self.ctx
        if ctx.parked is None or ctx.dirty:
            return False
        if self.created_at != run.created_at:
            return False
        if self.registry is not rt.registry or self.db is not rt.db:
            return False
        if len(history) < ctx.reached:  # a position it reserved is not in the history
            return False
        start, ids = ctx.parked
        return all(history[start + i].step_id == step_id for i, step_id in enumerate(ids))

    def drop(self) -> None:
        """Never resume it, and unwind it now if it is this thread's: a parked greenlet
        and its frames hold each other, so left to the collector a dropped one lives on
        until a full collection (hundreds of megabytes of them in a worker whose runs
        outnumber ``FLEET_LIVE_RUNS``). Another thread's is handed to that thread, which
        unwinds it at its next ``take`` (module docstring). A park while it unwinds
        raises ``Suspend``."""
        self.ctx.live = False
        glet, self.glet = self.glet, None
        if glet is None or glet.dead:
            return
        if self.thread != threading.get_ident():
            with _ORPHANS_LOCK:
                _ORPHANS.setdefault(self.thread, []).append((glet, self.ctx.run_id))
            return
        _unwind(glet, self.ctx.run_id)


# Parked workflows dropped on another thread than theirs, by their thread's ident.
_ORPHANS: dict[int, list[tuple[greenlet.greenlet, str]]] = {}
_ORPHANS_LOCK = threading.Lock()


def _unwind(glet: greenlet.greenlet, run_id: str) -> None:
    """Throw ``GreenletExit`` into a parked workflow of this thread, from here."""
    try:
        glet.parent = greenlet.getcurrent()
        glet.throw()  # GreenletExit, where it parked
    except (Exception, Suspend) as exc:  # what its unwinding raised is not ours
        log.debug("run %s: its dropped workflow unwound with %r", run_id, exc)


def unwind_orphans() -> int:
    """Unwind the parked workflows of this thread that other threads dropped; how many."""
    me = threading.get_ident()
    if me not in _ORPHANS:  # the common case, without the lock
        return 0
    with _ORPHANS_LOCK:
        orphans = _ORPHANS.pop(me, [])
    for glet, run_id in orphans:
        _unwind(glet, run_id)
    return len(orphans)


class LiveRuns:
    """This process's parked workflows, one per run: the one its latest advance parked,
    on that advance's thread. An advance on another thread drops it (a greenlet
    resumes only where it was made): an async step's run moves from the slot that
    started it to the loop's thread for good, and a parked copy left behind on the
    slot would only take room."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Live, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.resumed = 0  # advances that resumed a parked workflow, for the benchmarks

    def take(
        self, rt: Runtime, run: RunRow, history: Sequence[StepRow], wf: WorkflowDef
    ) -> Live | None:
        """The run's parked workflow, taken out, if it may be resumed on this thread for
        this advance; None: replay from the top (and the entry, if any, is dropped).
        First, this thread unwinds what other threads dropped of its own."""
        unwind_orphans()
        live = self._pop(run.id)
        if live is None:
            return None
        if (
            live.thread != threading.get_ident()
            or live.wf is not wf
            or not live.fits(rt, run, history)
            or not live.bind()
        ):
            live.drop()
            return None
        self.resumed += 1
        return live

    def holds(self, run_id: str) -> bool:
        """This thread keeps a parked workflow of the run."""
        with self._lock:
            entry = self._entries.get(run_id)
            return entry is not None and entry[0].thread == threading.get_ident()

    def _pop(self, run_id: str) -> Live | None:
        with self._lock:
            entry = self._entries.pop(run_id, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            return entry[0]

    def discard(self, run_id: str) -> None:
        """Drop the parked workflow of a run that will not be advanced again."""
        live = self._pop(run_id)
        if live is not None:
            live.drop()

    def keep(self, live: Live, limit: int) -> None:
        """Keep a parked workflow for the run's next advance on its thread (in place of
        any other of the run), dropping the least recently parked past ``limit`` entries
        or ``max_bytes`` (one that alone holds more is not kept: replaying it is cheaper
        than holding it)."""
        size = live.ctx.talk.held_bytes
        dropped: list[Live] = []
        with self._lock:
            key = live.ctx.run_id
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
                if old[0] is not live:
                    dropped.append(old[0])
            self._entries[key] = (live, size)
            self._bytes += size
            while self._entries and (len(self._entries) > limit or self._bytes > self.max_bytes):
                gone, gone_size = self._entries.popitem(last=False)[1]
                self._bytes -= gone_size
                dropped.append(gone)
        for entry in dropped:
            entry.drop()

    def forked(self) -> None:
        """In a forked child: a new lock (a thread of the parent may have held this one
        at the fork, and is not in the child to let it go), and nothing kept."""
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            entries = [live for live, _ in self._entries.values()]
            self._entries.clear()
            self._bytes = 0
        for entry in entries:
            entry.drop()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


RUNS = LiveRuns()


def _forked() -> None:
    """A forked child (Celery's prefork pool) keeps none of its parent's greenlets. Its
    locks are new: a thread of the parent may have held one at the fork, and that
    thread is not in the child to let it go."""
    global _ORPHANS_LOCK
    _ORPHANS_LOCK = threading.Lock()
    RUNS.forked()
    _ORPHANS.clear()


os.register_at_fork(after_in_child=_forked)


def start(
    rt: Runtime,
    wf: WorkflowDef,
    ctx: WorkflowContext,
    args: list[Any],
    kwargs: dict[str, Any],
) -> Live | None:
    """A workflow to run live, if this process keeps live runs (None: replay it)."""
    if rt.settings.live_runs <= 0 or under_gevent():
        return None
    return Live(ctx, wf, args, kwargs, rt.registry, rt.db, ctx.created_at)


def keep_once_committed(rt: Runtime, live: Live) -> None:
    """Keep ``live`` once what its advance wrote has committed: at once if each write
    was its own transaction, else when ``rt``'s transaction commits (never if it rolls
    back)."""
    if not live.parked or live.ctx.dirty:
        return
    limit = rt.settings.live_runs
    tx = rt.ledger.tx
    if tx is None:
        RUNS.keep(live, limit)
    else:
        after_commit(tx.conn, lambda: RUNS.keep(live, limit))
