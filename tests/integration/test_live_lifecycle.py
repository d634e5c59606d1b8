"""The lifecycle of live runs (fleet/worker/live.py) as a Hypothesis state machine:
whatever happens to a run's parked workflow between its advances, what the run records
is what a replay of its history from the top records. It drives runs only through the
drivers a worker's tasks call and the client's calls, and reads only the store.

The machine drives two or three runs of ``drawn`` (tests/flows.py: a recorded draw and
a step per round, every draw in its result) through ``fleet.worker.inline``'s
``advance_steps`` and ``run_steps``, the broker stood in by an ``InlineBroker``'s list
of messages. Each delivery runs on one of two slots, threads kept for the whole test,
so a run's next advance lands on the thread that parked its workflow or on the other
(which replays it from the top: a greenlet resumes only on its own thread).
FLEET_LIVE_RUNS is 2: with three runs, a slot's keep drops the other slot's entries for
room. The rules:

- deliver: one message (an advance, or a step) on a slot, with 0 to 2 more of the
  run's steps kept inline;
- cut: the same while the store fails under it: after ``skip`` statements, ``count``
  failures one after another, each a lost connection: at once (Postgres: the session
  terminated, ``pg_terminate_backend``), or ``at_commit``, at the transaction's COMMIT
  (Postgres: the connection reset by a proxy as the COMMIT goes out). The advance's
  transaction rolls back; with ``count`` > 1 its fallback fails too, and so does the
  task: its message is lost;
- fork: the same in a child process forked on a slot (``os.fork``), as another worker
  process would run it; it hands back through a pipe the messages it sent, and exits.
  The run's history moves on behind what this process keeps parked;
- cancel, signal ("go", to a run waiting for it), sweep (the leases of the tasks that
  failed run out, and ``sweep_once`` sends again what was lost), and renew: the ended
  runs pruned (``Fleet.prune``) and a cancelled run's id enqueued again, as retention
  and a client may do (the same id, another run).

After every rule each run that has ended is checked, and at teardown every run, once
the machine has driven them all to their end (bounded rounds of delivering, signalling
and sweeping):
- it ended where a replay of its history from the top ends (``tests/chaos/checks.py``:
  the same result, or the same error), with nothing of it left going;
- it succeeded only with what its workflow returns (the round numbers in order, a draw
  each: never another greenlet's ``GreenletExit`` message), and failed only of a dead
  step;
- no step id of it is recorded twice, and no step of it committed twice;
- a forked child that moved a run on entered its workflow from the top (the workflow
  counts its entries): a child keeps none of its parent's parked workflows.

Planted bugs it catches (issue 51), each alone: a parked workflow kept although its
advance's transaction did not commit; ``take`` resuming one without its fit check.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import sqlite3
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from fleet import Fleet
from fleet.errors import StoreUnavailable
from fleet.states import RunStatus, StepStatus
from fleet.testing import InlineBroker
from fleet.worker.dispatch import ADVANCE, EXECUTE
from fleet.worker.inline import advance_steps, run_steps
from fleet.worker.sweeper import sweep_once
from tests import flows
from tests.chaos.checks import capture, check_replays, check_settled, head
from tests.harness import Backend

SLOTS = 2
RUNS = 3  # at most, per example, each a ``drawn`` of 2 to 4 rounds
ROOM = 2  # FLEET_LIVE_RUNS
LEASE = 30.0  # seconds: never over within an example (``sweep`` lets a lost task's go)
CANCELS = RECYCLED = 2  # at most, per example
CHILD_SECONDS = 60.0  # the most a forked child may take
SLOT_SECONDS = 60.0  # the most one delivery may take
SETTLE_SECONDS = 30.0  # the most teardown takes to drive every run to its end
SETTLE_ROUNDS = 40  # rounds of delivering, signalling and sweeping it takes at most

SETTINGS = settings(
    max_examples=int(os.environ.get("FLEET_TEST_LIFECYCLE_EXAMPLES", "40")),
    stateful_step_count=30,
    deadline=None,
    derandomize=True,  # the same examples on every run: what one run catches, all do
    suppress_health_check=list(HealthCheck),
)

_EXAMPLE = itertools.count(1)


# --- the store failing under a slot -----------------------------------------------------


@dataclass
class _Plan:
    # Statements (COMMITs, ``at_commit``) that go through first; None: every one until
    # the workflow of the run delivered draws (``flows.ON_DRAW``), in the advance whose
    # transaction then fails.
    skip: int | None
    count: int  # failures still to come
    at_commit: bool  # each failure is a COMMIT's
    fired: int = 0

    def fails(self, commit: bool) -> bool:
        """Whether the statement (or COMMIT) going out now fails; counted if so."""
        if commit != self.at_commit or self.count == 0 or self.skip is None:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        self.count -= 1
        self.fired += 1
        return True


class CommitCutter:
    """A TCP proxy in front of Postgres that resets a connection as a COMMIT goes out
    through it (a Parse or Query message with the text ``COMMIT``) while ``plan`` says
    so: the server never sees the COMMIT, and the client's fails on a lost connection.
    Two pump threads per connection; ``close`` ends them all."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.plan: _Plan | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pumps: dict[tuple[socket.socket, socket.socket], int] = {}  # pair -> pumps left
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            server.settimeout(None)
            pair = (client, server)
            with self._lock:
                self._pumps[pair] = 2
                self._threads = [t for t in self._threads if t.is_alive()]
                for src, dst in (pair, pair[::-1]):
                    thread = threading.Thread(
                        target=self._pump, args=(src, dst, pair, src is client), daemon=True
                    )
                    self._threads.append(thread)
                    thread.start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        pair: tuple[socket.socket, socket.socket],
        upstream: bool,
    ) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                plan = self.plan
                commit = upstream and b"COMMIT\x00" in data
                if commit and plan is not None and plan.fails(commit=True):
                    break
                dst.sendall(data)
        _shut(*pair)  # one side ended or was cut: the other goes too
        with self._lock:
            self._pumps[pair] -= 1
            last = self._pumps[pair] == 0
            if last:
                del self._pumps[pair]
        if last:
            for sock in pair:
                sock.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            pairs, threads = list(self._pumps), list(self._threads)
        for pair in pairs:
            _shut(*pair)
        for thread in threads:
            thread.join(timeout=10)


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class Cuts:
    """Fails the store under the thread that arms it: after ``skip`` statements (a
    ``before_cursor_execute`` listener sees every statement fleet runs), the next
    ``count`` fail, one after another, each as on a lost connection: on Postgres the
    statement's session is first terminated from a connection of the test's own
    (``pg_terminate_backend``). Or, ``at_commit``, after ``skip`` COMMITs, the next
    ``count`` COMMITs fail (Postgres: ``CommitCutter``; SQLite: a ``commit`` listener)."""

    def __init__(self, fleet: Fleet, cutter: CommitCutter | None) -> None:
        self.engine = fleet.runtime.db.engine
        self.cutter = cutter
        self.plans: dict[int, _Plan] = {}
        self.admin: psycopg.Connection[Any] | None = None
        if cutter is not None:
            url = make_url(fleet.settings.database_url).set(drivername="postgresql")
            url = url.set(port=cutter.target_port)  # not through the cutter
            self.admin = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "commit", self._commit)
        flows.ON_DRAW.append(self._drew)

    def close(self) -> None:
        flows.ON_DRAW.remove(self._drew)
        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "commit", self._commit)
        if self.admin is not None:
            self.admin.close()

    def _drew(self, run_id: str) -> None:
        plan = self.plans.get(threading.get_ident())
        if plan is not None and plan.skip is None:
            plan.skip = 0

    @contextlib.contextmanager
    def armed(self, skip: int | None, count: int, at_commit: bool) -> Iterator[_Plan]:
        """The store failing under this thread while inside."""
        plan = _Plan(skip, count, at_commit)
        me = threading.get_ident()
        self.plans[me] = plan
        if self.cutter is not None:
            self.cutter.plan = plan
        try:
            yield plan
        finally:
            del self.plans[me]
            if self.cutter is not None:
                self.cutter.plan = None

    def _before(self, conn: Any, *_: Any) -> None:
        plan = self.plans.get(threading.get_ident())
        if plan is None or not plan.fails(commit=False):
            return
        if self.admin is None:
            raise sqlite3.OperationalError("disk I/O error (the test cut the store)")
        pid = conn.connection.driver_connection.info.backend_pid
        self.admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        deadline = time.monotonic() + 10
        while self.admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            assert time.monotonic() < deadline, f"backend {pid} outlived its termination"
            time.sleep(0.01)
        raise psycopg.errors.AdminShutdown(
            "terminating connection due to administrator command (the test cut it)"
        )

    def _commit(self, conn: Any) -> None:
        """SQLite's COMMIT, before it goes out (Postgres's went out already): it fails
        as on an I/O error, which rolls the transaction back."""
        plan = self.plans.get(threading.get_ident())
        if self.cutter is None and plan is not None and plan.fails(commit=True):
            conn.connection.driver_connection.execute("ROLLBACK")
            raise OperationalError(
                "COMMIT", None, sqlite3.OperationalError("disk I/O error (the test cut it)")
            )


# --- the world the machine drives ---------------------------------------------------------


@dataclass
class World:
    """One store's Fleet (FLEET_LIVE_RUNS small, leases long, the sweeper's grace 0),
    its messages in an ``InlineBroker``, the slots and the store's cuts."""

    kind: str
    fleet: Fleet
    broker: InlineBroker
    slots: list[ThreadPoolExecutor]
    cuts: Cuts
    stats: Counter[str] = field(default_factory=Counter)

    @classmethod
    @contextlib.contextmanager
    def open(cls, backend: Backend) -> Iterator[World]:
        base = backend.settings()
        cutter = None
        if backend.kind == "postgres":
            url = make_url(base.database_url)
            cutter = CommitCutter(url.port or 5432)
            base = replace(base, database_url=url.set(port=cutter.port).render_as_string(False))
        fleet = flows.fleet.with_settings(
            replace(base, live_runs=ROOM, lease_seconds=LEASE, sweep_grace=0.0)
        )
        slots = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slot{i}") for i in range(SLOTS)
        ]
        try:
            fleet.upgrade_schema()
            world = cls(backend.kind, fleet, InlineBroker(fleet), slots, Cuts(fleet, cutter))
            try:
                yield world
            finally:
                world.cuts.close()
        finally:
            for slot in slots:
                slot.shutdown(wait=True)
            fleet.runtime.db.dispose()
            if cutter is not None:
                cutter.close()

    def on(self, slot: int, fn: Callable[[], Any]) -> Any:
        """``fn`` run on the slot's thread; what it returned or raised."""
        return self.slots[slot].submit(fn).result(timeout=SLOT_SECONDS)

    def deliver(self, message: tuple[str, list[str]], extra: int) -> None:
        """What a worker's task does with the message, here; ``extra``: how many more of
        the run's steps it may run inline."""
        task, args = message
        rt = self.fleet.runtime

        def more(n: int) -> bool:
            return n <= extra

        if task == ADVANCE:
            advance_steps(rt, args[0], more)
        elif task == EXECUTE:
            run_steps(rt, args[0], args[1], more)
        else:  # pragma: no cover - the broker holds only fleet's messages
            raise AssertionError(f"not a fleet message: {message!r}")
        self.stats["delivered"] += 1


# --- a forked child -----------------------------------------------------------------------


def in_a_child(body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``body`` run in a child forked from this thread; what it returned (JSON through a
    pipe). The child leaves with ``os._exit``: nothing of the parent's (pytest's exit
    handlers, its buffered output, its connections) runs or is closed there."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: measured by what it hands back
        code = 1
        try:
            os.close(read_end)
            try:
                report = body()
            except BaseException:
                report = {"crashed": traceback.format_exc()}
            with os.fdopen(write_end, "wb") as out:
                out.write(json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the forked child {pid} took over {CHILD_SECONDS}s")
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _reap(pid)
    if not chunks:
        raise AssertionError(f"the forked child {pid} handed nothing back")
    report: dict[str, Any] = json.loads(b"".join(chunks))
    if "crashed" in report:
        raise AssertionError(f"the forked child {pid} crashed:\n{report['crashed']}")
    return report


def _reap(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# --- the runs -----------------------------------------------------------------------------


@dataclass
class Run:
    """One run enqueued (an id enqueued again after its run was pruned is another)."""

    id: str
    n: int
    wait: bool
    cancelled: bool = False
    signalled: bool = False
    checked: bool = False

    @property
    def go(self) -> dict[str, str]:
        return {"go": self.id}


def check_run(fleet: Fleet, run: Run) -> list[str]:
    """What is wrong with an ended run (empty: nothing)."""
    c = capture(fleet, run.id)
    if c is None:
        return [f"run {run.id} is gone from the store before it was checked"]
    failures = check_replays([c]) + check_settled([c])
    status = RunStatus(c["status"])
    twice = [step for step, times in Counter(s["id"] for s in c["steps"]).items() if times > 1]
    if twice:
        failures.append(f"run {run.id} recorded steps {twice} twice")
    for s in c["steps"]:
        done = [t for t in s["tries"] if t["outcome"] == "done"]
        if len(done) > 1:
            failures.append(f"run {run.id}: step {s['id']} committed {len(done)} times")
    if status is RunStatus.SUCCEEDED:
        failures += _not_its_return(run, c["result"])
    elif status is RunStatus.FAILED and not head(c["error"]).startswith("StepFailed"):
        failures.append(f"run {run.id} failed of {head(c['error'])[:300]!r}, not of a dead step")
    elif status is RunStatus.CANCELLED and not run.cancelled:
        failures.append(f"run {run.id} is cancelled, and no one cancelled it")
    return failures


def _not_its_return(run: Run, result: Any) -> list[str]:
    """What ``drawn(run.n, run.wait)`` returns: ``[i, draw]`` per round, and the "go"
    signal's payload after the first round if it waited."""
    rounds = result if isinstance(result, list) else None
    if rounds is not None and run.wait and len(rounds) > 1 and rounds[1] == run.go:
        rounds = rounds[:1] + rounds[2:]
    if (
        rounds is None
        or len(rounds) != run.n
        or any(
            not isinstance(r, list)
            or len(r) != 2
            or r[0] != i
            or not isinstance(r[1], float)
            or not 0 <= r[1] < 1
            for i, r in enumerate(rounds)
        )
    ):
        return [
            f"run {run.id} (drawn {run.n} rounds, wait={run.wait}) succeeded with "
            f"{result!r:.300}: not what its workflow returns"
        ]
    return []


# --- the machine --------------------------------------------------------------------------

homes = st.booleans()  # on the slot that ran the run last, or on the other one
picks = st.integers(0, 7)  # which of the run's messages: the oldest first as it shrinks
extras = st.integers(0, 2)
which = st.integers(0, RUNS - 1)

Message = tuple[str, list[str]]


class LiveLifecycle(RuleBasedStateMachine):
    """No rule has a precondition, and none draws from what the store says: a failing
    example replays as it ran. A rule with nothing to do does nothing."""

    world: ClassVar[World | None] = None

    def __init__(self) -> None:
        super().__init__()
        world = type(self).world
        assert world is not None
        self.w = world
        self.fleet = world.fleet
        self.sent = world.broker.sent
        self.sent.clear()  # another example's leftovers: their runs have ended
        self.example = next(_EXAMPLE)
        self.runs: list[Run] = []
        self.home: dict[str, int] = {}  # run id -> the slot that ran it last
        self.cancels = self.recycled = 0

    # -- runs --

    @initialize(
        shapes=st.lists(st.tuples(st.integers(2, 4), st.booleans()), min_size=1, max_size=RUNS)
    )
    def start(self, shapes: list[tuple[int, bool]]) -> None:
        for k, (n, wait) in enumerate(shapes):
            self._enqueue(Run(f"life-{self.w.kind}-{self.example}-{k}", n, wait))

    def _enqueue(self, run: Run) -> None:
        self.fleet.enqueue("drawn", run.n, run.wait, run_id=run.id)
        self.runs = [r for r in self.runs if r.id != run.id] + [run]

    def _status(self, run: Run) -> RunStatus:
        return RunStatus(self.fleet.run(run.id).status())

    # -- deliveries --

    def _take(
        self, k: int, pick: int, home: bool, task: str | None = None
    ) -> tuple[Message, int] | None:
        """A message of the ``k``-th run (a ``task`` one if it has one) taken off the
        broker (of any run if it has none; None: there is none), and the slot it goes
        to: the one that ran its run last (as a sticky queue would send it), or the
        other one (a run's first delivery's home is slot 0)."""
        run_id = self.runs[k % len(self.runs)].id
        mine = [i for i, (_, args) in enumerate(self.sent) if args[0] == run_id]
        mine = [i for i in mine if self.sent[i][0] == task] or mine
        candidates = mine or range(len(self.sent))
        if not candidates:
            return None
        message = self.sent.pop(candidates[pick % len(candidates)])
        last = self.home.get(message[1][0], 0)
        return message, last if home else (last + 1) % SLOTS

    def _ran(self, message: Message, slot: int) -> None:
        self.home[message[1][0]] = slot

    @rule(k=which, pick=picks, home=homes, extra=extras)
    def deliver(self, k: int, pick: int, home: bool, extra: int) -> None:
        taken = self._take(k, pick, home)
        if taken is not None:
            message, slot = taken
            self._ran(message, slot)
            self.w.on(slot, lambda: self.w.deliver(message, extra))

    @rule(
        k=which,
        pick=picks,
        home=homes,
        extra=extras,
        skip=st.integers(0, 8),
        count=st.integers(1, 3),
    )
    def cut(self, k: int, pick: int, home: bool, extra: int, skip: int, count: int) -> None:
        """A delivery whose ``skip``-th statement on fails, ``count`` of them."""
        self._cut(k, pick, home, extra, skip, count, at_commit=False)

    @rule(
        k=which,
        pick=picks,
        home=homes,
        extra=extras,
        skip=st.one_of(st.none(), st.integers(0, 3)),
        count=st.integers(1, 2),
    )
    def cut_commit(
        self, k: int, pick: int, home: bool, extra: int, skip: int | None, count: int
    ) -> None:
        """A delivery whose ``skip``-th COMMIT on fails (None: the first once its
        workflow has drawn), ``count`` of them."""
        self._cut(k, pick, home, extra, skip, count, at_commit=True)

    def _cut(
        self,
        k: int,
        pick: int,
        home: bool,
        extra: int,
        skip: int | None,
        count: int,
        at_commit: bool,
        task: str | None = None,
    ) -> None:
        taken = self._take(k, pick, home, task)
        if taken is None:
            return
        message, slot = taken
        self._ran(message, slot)

        def cut_delivery() -> None:
            with self.w.cuts.armed(skip, count, at_commit) as plan:
                try:
                    self.w.deliver(message, extra)
                except StoreUnavailable as exc:
                    # The task failed on the store: its message is gone, the sweeper's
                    # to repair. Only a cut may do that.
                    if not plan.fired:
                        raise AssertionError(f"{message} failed on an uncut store") from exc
                    self.w.stats["lost"] += 1
                self.w.stats["cuts"] += plan.fired

        self.w.on(slot, cut_delivery)

    @rule(k=which, pick=picks, home=homes)
    def fork(self, k: int, pick: int, home: bool) -> None:
        """A message of the run taken by another worker process: a child forked on a
        slot."""
        self._fork(k, pick, home)

    @rule(k=which, pick=picks, extra=extras, back=st.booleans())
    def failover(self, k: int, pick: int, extra: int, back: bool) -> None:
        """An incident: the run's home slot loses its connection at the COMMIT of the
        advance in which the run's workflow draws, delivering a step of the run, the
        sweeper sends again what was lost, another worker process takes the run's step,
        and (``back``) its next message comes back to the home slot."""
        self._cut(k, pick, True, extra, None, 1, at_commit=True, task=EXECUTE)
        self.sweep()
        self._fork(k, -1, False, EXECUTE)  # the newest step message: the one sent again
        if back:
            self.deliver(k, -1, True, 0)  # the newest: what the child sent

    def _fork(self, k: int, pick: int, home: bool, task: str | None = None) -> None:
        taken = self._take(k, pick, home, task)
        if taken is None:
            return
        message, slot = taken
        run_id = message[1][0]
        before = len(self.sent)

        def child() -> dict[str, Any]:
            entered = flows.ENTERED.get(run_id, 0)
            was = self._footprint(run_id)
            error = None
            try:
                self.w.deliver(message, 0)
            except StoreUnavailable as exc:  # reported: the parent fails
                error = str(exc)
            return {
                "sent": self.sent[before:],
                "entered": flows.ENTERED.get(run_id, 0) - entered,
                "moved": self._footprint(run_id) != was,
                "error": error,
            }

        report = self.w.on(slot, lambda: in_a_child(child))
        assert report["error"] is None, f"{message} failed in a forked child: {report['error']}"
        if report["moved"] and report["entered"] < 1:
            raise AssertionError(
                f"a child forked on slot {slot} moved run {run_id} on ({message}) without "
                "entering its workflow from the top: it resumed a workflow its parent "
                "keeps parked"
            )
        self.sent.extend((task, list(args)) for task, args in report["sent"])
        self.w.stats["forks"] += 1

    def _footprint(self, run_id: str) -> tuple[str | None, int]:
        """The run's status and how many steps it recorded (None: pruned)."""
        queries = self.fleet.runtime.queries
        row = queries.run(run_id)
        return (None, 0) if row is None else (str(row.status), len(queries.steps(run_id)))

    # -- what others do to the runs --

    @rule(k=which)
    def cancel(self, k: int) -> None:
        if self.cancels >= CANCELS:
            return
        self.cancels += 1
        run = self.runs[k % len(self.runs)]
        if self.fleet.cancel(run.id, reason="the machine cancelled it"):
            run.cancelled = True
            self.w.stats["cancelled"] += 1

    @rule(k=which)
    def signal(self, k: int) -> None:
        """ "go" to a run that waits (or will) for it, once: kept until it waits."""
        self._signal(self.runs[k % len(self.runs)])

    def _signal(self, run: Run) -> None:
        if run.wait and not run.signalled and not self._status(run).finished:
            self.fleet.signal(run.id, "go", run.go)
            run.signalled = True

    @rule()
    def sweep(self) -> None:
        """The sweeper's tick, once the leases of the tasks that failed have run out."""
        self._leases_run_out()
        sweep_once(self.fleet.runtime)

    def _leases_run_out(self) -> None:
        """Between two rules no task runs: a step running is one whose task failed on
        the store, its lease held. It runs out (released, as at a worker's shutdown,
        rather than waited for)."""
        rt = self.fleet.runtime
        for run in self.runs:
            for step in rt.queries.steps(run.id):
                if step.status == StepStatus.RUNNING:
                    rt.ledger.release_lease(run.id, step.step_id, step.epoch)

    @rule(
        k=which,
        n=st.integers(2, 4),
        wait=st.booleans(),
        first=st.sampled_from(["home", "other", "fork"]),
    )
    def recycle(self, k: int, n: int, wait: bool, first: str) -> None:
        """The run is cancelled if it still goes, retention prunes the ended runs, and
        the run's id is enqueued again: the same id, another run (another history,
        another creation time), whose first advance is taken at once: by the slot
        that ran the id last, the other one, or another worker process."""
        if self.recycled >= RECYCLED:
            return
        self.recycled += 1
        old = self.runs[k % len(self.runs)]
        if self.fleet.cancel(old.id, reason="the machine recycles it"):
            old.cancelled = True
        self.check_ended()
        self._let_go([r for r in self.runs if r.checked and r is not old])
        self.fleet.prune(0)
        assert self.fleet.runtime.queries.run(old.id) is None, f"run {old.id} was not pruned"
        self.runs = [r for r in self.runs if not r.checked]  # the ended ones are gone
        self._enqueue(Run(old.id, n, wait))
        self.w.stats["recycled"] += 1
        again = len(self.runs) - 1  # its newest message is its advance
        if first == "fork":
            self._fork(again, -1, False)
        else:
            self.deliver(again, -1, first == "home", 0)

    # -- the checks --

    @invariant()
    def check_ended(self) -> None:
        failures: list[str] = []
        for run in self.runs:
            if not run.checked and self._status(run).finished:
                failures += check_run(self.fleet, run)
                run.checked = True
                self.w.stats["checked"] += 1
        assert not failures, "\n".join(failures)

    def teardown(self) -> None:
        self._settle()
        self.check_ended()
        self._let_go(self.runs)

    def _let_go(self, runs: list[Run]) -> None:
        """An advance of each ended run: this process keeps no parked workflow of it
        (one a fork child ended, or a cancelled run's), and the next example starts
        with the room ``FLEET_LIVE_RUNS`` gives it, as it would run on its own."""
        for run in runs:
            self.w.on(0, lambda run=run: self.w.deliver((ADVANCE, [run.id]), 0))

    def _settle(self) -> None:
        """Every run driven to its end: messages delivered (each on its run's home
        slot), the waiting ones signalled, what was lost swept up again."""
        deadline = time.monotonic() + SETTLE_SECONDS
        for _ in range(SETTLE_ROUNDS):
            for _ in range(200):
                if not self.sent:
                    break
                message = self.sent.pop(0)
                slot = self.home.get(message[1][0], 0)
                self.w.on(slot, lambda m=message: self.w.deliver(m, 2))
            open_runs = [r for r in self.runs if not self._status(r).finished]
            if not open_runs or time.monotonic() > deadline:
                break
            for run in open_runs:
                self._signal(run)
            if not self.sent:
                time.sleep(0.02)  # what the sweeper sends again is due on the store's clock
                self.sweep()
        stuck = [self._story(r) for r in self.runs if not self._status(r).finished]
        assert not stuck, f"runs that never ended ({SETTLE_ROUNDS} rounds): {stuck}"

    def _story(self, run: Run) -> str:
        rt = self.fleet.runtime
        steps = ", ".join(
            f"{s.step_id} {s.status} (attempt {s.attempts}, epoch {s.epoch})"
            for s in rt.queries.steps(run.id)
        )
        return f"{run.id} {self._status(run)}: {steps}"


def test_a_live_run_records_what_its_replay_from_the_top_records(backend: Backend) -> None:
    with World.open(backend) as world:
        LiveLifecycle.world = world
        try:
            run_state_machine_as_test(LiveLifecycle, settings=SETTINGS)
        finally:
            LiveLifecycle.world = None
        print(f"{backend.kind}: {dict(world.stats)}")
