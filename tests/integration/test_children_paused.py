"""Issue 16: the worker replaying a parent run is frozen (SIGSTOP) mid-replay, for
longer than a lease, while its children finish: one result is delivered, once.

An advance holds no lease. Any worker may replay a run at any time, and each write a
replay makes is conditional: steps are inserted as a no-op on conflict, ``finish_run``
moves only a running run, ``mark_advanced`` only forward. The wake-up the frozen replay
has not answered (``advanced_seq < wake_seq``) is re-sent by the sweeper, another worker
finishes the run, and the frozen replay, woken with a stale history, changes nothing.
The replay is held where the test freezes it by ``tests.flows.hold_replay``. Both
stores; real workers, each running one task at a time, so the frozen one runs nothing
but the held replay (no child step of its is taken over).

One finding is kept as an expected failure, named where it is asserted: a replay
frozen inside a step's commit keeps the run (SQLite: the store) until it wakes
(``FROZEN_COMMIT``). Another, a stale replay parking a run that had moved on as
waiting for ever, is fixed (``set_waiting`` is conditional on the wake-up the replay
saw) and tested here."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from fleet import Fleet, RunHandle
from fleet.errors import StoreUnavailable
from fleet.states import RunStatus, StepStatus
from fleet.store.queries import Queries
from fleet.testing import FleetProcess
from fleet.worker.dispatch import advance_shadow
from fleet.worker.replay import replay_run, step_shadow
from fleet.worker.sweeper import sweep_once
from tests.harness import (
    Backend,
    Cluster,
    InlineBroker,
    executions,
    poll,
    starts,
    wait_until,
)

N = 3
EXPECTED = {"children": [0, 1, 4], "after": -5}
# Where a replay of held_brood is held, and the task that replay runs in, by the name
# Celery logs it under (its shadow): an advance, also at "end", in the commit of
# ``other``, which the advance that resumed the run after its children runs itself (a
# step's commit replays its run).
HOLDS = {"start": "advance", "first": "advance", "children": "advance", "end": "advance"}
# Held before the children waiting for "go" are sent it: they finish while it is frozen.
EARLY = ("start", "first")
_TASK = re.compile(r"Task (\S+)\[([\w-]+)\] (received|succeeded|ended|raised|failed|retry)")


def _tasks(proc: FleetProcess) -> dict[str, tuple[str, list[str]]]:
    """The Celery tasks the worker has logged: id → (name, what it logged, in order)."""
    seen: dict[str, tuple[str, list[str]]] = {}
    for name, task_id, what in _TASK.findall(proc.output()):
        seen.setdefault(task_id, (name, []))[1].append(what)
    return seen


def _running(proc: FleetProcess) -> list[tuple[str, str]]:
    """(name, id) of each task the worker has received and not ended."""
    return [(name, tid) for tid, (name, what) in _tasks(proc).items() if what == ["received"]]


def _ended(proc: FleetProcess, task_id: str) -> str | None:
    """How the task ended on the worker (``succeeded``, ``raised``…), None while it runs."""
    what = _tasks(proc).get(task_id, ("", []))[1]
    return what[-1] if len(what) > 1 else None


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


def _replay_event(backend: Backend, run_id: str, event: str) -> dict[str, Any] | None:
    return next(
        (e for e in executions(backend, run_id) if e["step"] == "workflow" and e["event"] == event),
        None,
    )


def _waiting(client: Fleet, run_id: str) -> bool:
    row = client.runtime.queries.run(run_id)
    return row is not None and row.status == RunStatus.WAITING


def _go(client: Fleet, kids: list[str]) -> None:
    """Send each child its "go" once it waits for it. Not sooner: a signal that settles
    the wait while the replay recording it has yet to mark the run waiting can leave
    the run parked (see test_a_stale_replay_does_not_park_a_run_that_moved_on)."""
    for kid in kids:
        poll(lambda kid=kid: _waiting(client, kid), 30, f"child run {kid} to wait for go")
        client.signal(kid, "go")


def _ending(q: Queries, run_id: str) -> tuple[Any, ...]:
    """What a run's end wrote: its status, result, error and when it finished."""
    row = q.run(run_id)
    assert row is not None
    return (row.status, row.result, row.error, row.finished_at)


def _children(q: Queries, run_id: str) -> list[str]:
    """The ids of ``run_id``'s child runs in the store (by their parent_id, not by id)."""
    return sorted(r.id for r in q.runs(limit=1000) if r.parent_id == run_id)


def _dropped(workers: list[FleetProcess], run_id: str, step_id: str) -> bool:
    """Whether a worker dropped a delivery of the step (``failures.refused`` logs it)."""
    line = f"execute {step_id} of run {run_id} dropped"
    return any(line in w.output() for w in workers)


def _ended_run(run: RunHandle) -> bool:
    """Whether the run has ended; False while the store does not answer (see FROZEN_COMMIT)."""
    try:
        return RunStatus(run.status()).finished
    except StoreUnavailable:
        return False


def _finishes(run: RunHandle, timeout: float) -> bool:
    """Whether the run ends within ``timeout`` seconds."""
    try:
        wait_until(lambda: _ended_run(run), timeout, f"run {run.id} to end")
    except TimeoutError:
        return False
    return True


# Found with this test (brief S): the replay that follows a step's commit runs inside the
# commit's transaction, which holds the run's row (Postgres) or the store's write lock
# (SQLite) while the workflow function runs. A worker frozen there keeps them however
# long it is frozen: its step's lease runs out, but nothing can take the step over or
# replay the run (on SQLite nothing can write at all) until it wakes or dies.
FROZEN_COMMIT = (
    "a worker frozen in the replay inside a step's commit holds the run (Postgres: its "
    "rows; SQLite: the whole store) until it wakes: no other worker finishes the run"
)


@pytest.mark.parametrize("point", list(HOLDS))
def test_a_parent_replay_frozen_past_its_lease_delivers_one_result(
    backend: Backend, client: Fleet, cluster: Cluster, tmp_path: Path, point: str
) -> None:
    workers = [cluster.worker("w1", concurrency=1), cluster.worker("w2", concurrency=1)]
    cluster.sweeper()
    folder = tmp_path / "hold"
    folder.mkdir()
    run = client.enqueue("held_brood", N, [point, str(folder)])
    kids = [f"{run.id}/kid-{i}" for i in range(N)]
    q = client.runtime.queries
    if point not in EARLY:
        _go(client, kids[1:])
    held = poll(lambda: _replay_event(backend, run.id, "held"), 60, f"a replay held at {point}")
    zombie = cluster.by_pid(held["pid"])
    (task,) = _running(zombie)
    # Not read from the store: held in a commit, a worker keeps SQLite's lock (no reads).
    queue = client.runtime.registry.workflows["held_brood"].queue(client.runtime.settings.queue)
    shadow = {"advance": advance_shadow(queue), "execute": step_shadow("held_brood", "other")}
    assert task[0] == shadow[HOLDS[point]], f"held in {task}, not in an {HOLDS[point]}"
    zombie.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    poll(lambda: _stopped(zombie.pid), 10, "the worker to stop")
    if point == "start":
        assert _children(q, run.id) == [], "its replay is to record the children itself"
    if point == "first":  # its replay has seen the first child's result only
        assert all(not RunStatus(q.run(k).status).finished for k in kids[1:])  # type: ignore[union-attr]
    if point in EARLY:
        _go(client, kids[1:])

    # The other worker finishes the run while this one is frozen (held in the commit,
    # it cannot: FROZEN_COMMIT; a few leases show that without waiting the full 30 s)...
    finished = _finishes(run, 3 * backend.lease_seconds if point == "end" else 30)
    assert finished or point == "end", "the run did not finish while a replay was frozen"
    # ... and it stays frozen past its lease (an advance holds none; a commit does), woken
    # only once whatever lease it held has run out twice over.
    time.sleep(max(0.0, frozen_at + 2 * backend.lease_seconds - time.monotonic()))
    if finished:
        ending, steps = _ending(q, run.id), q.steps(run.id)
        assert ending[0] == RunStatus.SUCCEEDED and ending[3] is not None

    (folder / "release").touch()
    zombie.signal(signal.SIGCONT)
    how = poll(lambda: _ended(zombie, task[1]), 30, f"the frozen {task[0]} to end")
    assert how == "ended", zombie.output()[-3000:]  # fleet's tasks: "ended", never "succeeded"
    released = _replay_event(backend, run.id, "released")
    assert released is not None and released["pid"] == zombie.pid, "the held replay went on"
    if point == "children":
        # Its stale history lacks ``other#1``: it records it again (a no-op) and sends
        # it again; the worker that gets it drops it.
        poll(lambda: _dropped(workers, run.id, "other#1"), 30, "the stale re-send of other#1")
    if finished:
        assert _ending(q, run.id) == ending, "the run finished once: result and time unchanged"
        assert q.steps(run.id) == steps, "the frozen replay changed none of the run's steps"
    _delivered_once(backend, q, run, kids)
    if not finished:  # safe, but not live: see FROZEN_COMMIT
        pytest.xfail(FROZEN_COMMIT)


def _delivered_once(backend: Backend, q: Queries, run: RunHandle, kids: list[str]) -> None:
    """One result, each step run once, one child run per child step, nothing amiss."""
    assert run.wait(timeout=30) == EXPECTED
    assert starts(backend, run.id) == {"other#1": 1}, "the step after the children ran once"
    other = [(a.epoch, a.outcome) for a in q.attempts(run.id) if a.step_id == "other#1"]
    assert other == [(1, "done")]
    assert _children(q, run.id) == kids, "no second child was started"
    for kid in kids:
        assert starts(backend, kid) == {"work#1": 1}, kid
        assert _ending(q, kid)[:2] == (RunStatus.SUCCEEDED, str(int(kid[-1]) ** 2)), kid
    kid_steps = {s.step_id: s.status for s in q.steps(run.id) if s.step_id.startswith("kid-")}
    assert kid_steps == {f"kid-{i}": StepStatus.DONE for i in range(N)}
    assert q.incident_counts(run.id).get("nondeterminism") is None


# Found with this file's tests: a replay that read the run while its wait was pending,
# and reaches set_waiting only after a signal settled the wait and a fresher replay
# resumed the run and recorded its next step, parked the moving run as waiting; the next
# step's lease was refused (the run not running), the sweeper passed over its steps and
# the run (its wake-ups answered): the run waited forever. set_waiting now applies only
# if the run's wake_seq is the one the replay saw. A frozen worker is one way to be that
# late; a signal sent while the replay that records the wait runs is another.


def _swept(client: Fleet, inline: InlineBroker, run: RunHandle) -> bool:
    """One sweep, its messages delivered; whether the run has ended."""
    sweep_once(client.runtime)
    inline.drain()
    return RunStatus(run.status()).finished


def test_a_stale_replay_does_not_park_a_run_that_moved_on(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("approval")
    inline.drain()
    q = client.runtime.queries
    stale = q.snapshot(run.id)  # read by a replay of the waiting run that is then frozen
    assert stale is not None and stale.run.status == RunStatus.WAITING
    client.signal(run.id, "approval", {"approved": True})
    inline.step()  # a fresh replay: the run resumes, work#2 is recorded and sent
    assert q.step(run.id, "work#2") is not None
    replay_run(client.runtime, run.id, stale)  # the frozen replay wakes
    inline.drain()
    # Whatever was lost, the sweeper re-sends after its grace (1 s here): give it three.
    wait_until(lambda: _swept(client, inline, run), 4, f"run {run.id} to end", interval=0.2)
    assert run.wait(timeout=0) == {"decision": {"approved": True}}
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1}
