"""What the chaos harness does to program runs from outside, through fleet's public
Python API only: sends the signals their waits expect (before the wait is reached,
after it, or after it with the wait's id from ``RunHandle.waits()``), raises the budget
of a run parked on it (``needs_decision``), and cancels a run stuck mid-fan-out on a
wait nobody answers, once the rest of that fan-out has settled (the model's plan,
tests/chaos/model.py). With ``hands`` (tests/chaos/console_hands.py), a share of
those actions (drawn per action from the seed) goes through the console's forms over
HTTP instead, as an operator's would: a signal after its wait as an approval or a
rejection of the wait's id, the cancel, the budget raise. And ``observe``: a program's
runs as the store has them, for ``model.differences``.

``Driver.tick()`` does what is due and returns at once; the harness calls it in its
loop with its own deadline. Every call may meet a store that is briefly unreachable
(a restart, a cut connection): the action is tried again on a later tick, and counted
in ``counts["store_errors"]``. An action on a run that will never exist (its parent
ended without starting it) or has ended is dropped.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from fleet import Fleet
from fleet.errors import BadInput, RunFailed, UnknownRun, WaitNotOpen
from fleet.store.schema import runs as runs_table
from tests.chaos.console_hands import Conflict, ConsoleHands, Unreachable
from tests.chaos.model import Expected, Observed, Signal

FINISHED = frozenset({"succeeded", "failed", "cancelled"})
POLL = 0.2  # seconds between two looks at the same run for the same action
CONSOLE_SHARE = 0.5  # of the actions, with hands: the share done through the console


def _parent(run_id: str) -> str | None:
    return run_id.rpartition("/")[0] or None


@dataclass
class _Action:
    kind: str  # signal | cancel | budget
    run_id: str
    signal: Signal | None = None
    due: float = 0.0
    detail: Any = None
    console: bool = False  # done through the console's forms (else the Python API)


@dataclass
class _Watch:
    expected: Expected
    actions: list[_Action] = field(default_factory=list)


class Driver:
    """Acts on the runs of the programs it watches; ``tick()`` from the harness's loop."""

    def __init__(
        self,
        client: Fleet,
        poll: float = POLL,
        hands: ConsoleHands | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.poll = poll
        self.hands = hands
        self.rng = rng or random.Random(0)
        self.counts: Counter[str] = Counter()
        self._watches: list[_Watch] = []
        self._status: dict[str, str] = {}  # runs seen finished (they stay so)

    def watch(self, exp: Expected) -> None:
        """Act on the runs of one program (``exp``: the model's fault-free plan)."""
        w = _Watch(exp)
        w.actions += [_Action("signal", s.run_id, signal=s) for s in exp.signals]
        if exp.cancel is not None:
            w.actions.append(_Action("cancel", exp.cancel.run_id))
        if exp.budget is not None:
            w.actions += [_Action("budget", run_id) for run_id in exp.runs]
        for action in w.actions:
            action.console = self.hands is not None and self.rng.random() < CONSOLE_SHARE
        self._watches.append(w)

    def forget(self, root_id: str) -> None:
        """Forget what was seen of the tree of ``root_id`` (its id is enqueued again)."""
        for run_id in [r for r in self._status if r == root_id or r.startswith(root_id + "/")]:
            del self._status[run_id]

    def pending(self) -> int:
        return sum(len(w.actions) for w in self._watches)

    def tick(self) -> int:
        """One pass over the actions that are due; returns how many were done."""
        done = 0
        now = time.monotonic()
        for w in self._watches:
            for action in list(w.actions):
                if action.due > now:
                    continue
                try:
                    try:
                        finished = self._act(w.expected, action)
                    except (UnknownRun, BadInput, Conflict) as exc:
                        finished = self._refused(action, exc)
                except Unreachable:  # the console or its store is down: try again later
                    self.counts["console_errors"] += 1
                    finished = False
                except AssertionError:  # the harness's own form was refused: its bug
                    raise
                except Exception:  # the store is unreachable: try again later
                    self.counts["store_errors"] += 1
                    finished = False
                if finished:
                    w.actions.remove(action)
                    done += 1
                else:
                    action.due = time.monotonic() + self.poll
        return done

    def run_until(self, done: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
        """Tick until ``done()`` (True) or ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick()
            if done():
                return True
            time.sleep(interval)
        return False

    # --- the actions: each returns True once it is done (or moot) -------------------

    def _act(self, exp: Expected, action: _Action) -> bool:
        if action.kind == "signal":
            return self._signal(action)
        if action.kind == "cancel":
            return self._cancel(exp, action)
        return self._budget(exp, action)

    def _signal(self, action: _Action) -> bool:
        s = action.signal
        assert s is not None
        if s.mode == "before":
            self._send(action, s.payload)
            self.counts["signal_before"] += 1
            return True
        handle = self.client.run(s.run_id)
        wait = next((w for w in handle.waits() if w.name == s.name), None)
        if wait is None:
            return self._ended(s.run_id)
        if s.mode == "after_id":
            try:
                if action.console and self.hands is not None:
                    # An approval (odd v) or a rejection; the program reads v back from
                    # the comment and checks the decision (programs.signal_value).
                    v = int(s.payload["v"])
                    self.hands.decide(s.run_id, s.name, wait.id, bool(v % 2), str(v))
                    self.counts["console_decide"] += 1
                else:
                    self.client.signal(s.run_id, s.name, s.payload, wait_id=wait.id)
            except (WaitNotOpen, Conflict):
                return False  # answered meanwhile (by an earlier try of ours?): look again
            self.counts["signal_wait_id"] += 1
            return True
        self._send(action, s.payload)
        self.counts["signal_after"] += 1
        return True

    def _send(self, action: _Action, payload: Any) -> None:
        s = action.signal
        assert s is not None
        if action.console and self.hands is not None:
            self.hands.signal(s.run_id, s.name, payload)
            self.counts["console_signal"] += 1
        else:
            self.client.signal(s.run_id, s.name, payload)

    def _cancel(self, exp: Expected, action: _Action) -> bool:
        plan = exp.cancel
        assert plan is not None
        if self._ended(plan.run_id):
            return True
        stuck = self.client.run(plan.stuck_run)
        if not any(w.name == plan.wait for w in stuck.waits()):
            return self._ended(plan.stuck_run)
        steps = {s.id: s.status for s in self.client.run(plan.run_id).steps()}
        if any(steps.get(step_id) not in ("done", "dead") for step_id in plan.settled):
            return False
        if action.console and self.hands is not None:
            try:
                self.hands.cancel(plan.run_id, plan.reason)
            except Conflict:  # ended meanwhile
                return self._ended(plan.run_id)
            self.counts["console_cancel"] += 1
        else:
            self.client.cancel(plan.run_id, reason=plan.reason)
        self.counts["cancel"] += 1
        return True

    def _budget(self, exp: Expected, action: _Action) -> bool:
        run_id = action.run_id
        handle = self.client.run(run_id)
        status = handle.status()
        if status in FINISHED:
            return True
        if status == "needs_decision":
            spent = int(handle.usage()["tokens"])
            assert exp.budget is not None
            try:
                if action.console and self.hands is not None:
                    self.hands.raise_budget(run_id, spent + exp.budget)
                    self.counts["console_budget"] += 1
                else:
                    self.client.raise_budget(run_id, tokens=spent + exp.budget)
            except (BadInput, Conflict):  # not parked on its budget (an effect in doubt)
                return False
            self.counts["budget_raise"] += 1
        return False

    def _ended(self, run_id: str) -> bool:
        """Whether the run has ended (so what waits on it is moot); reads the store."""
        if run_id in self._status:
            return True
        status = self.client.run(run_id).status()
        if status in FINISHED:
            self._status[run_id] = status
            return True
        return False

    def _refused(self, action: _Action, exc: Exception) -> bool:
        """An action refused: the run is unknown (not started yet, or never will be) or
        ended (a signal to an ended run). Done once nothing can come of it."""
        if isinstance(exc, UnknownRun):
            return self._never(action.run_id)
        self.counts[f"refused_{action.kind}"] += 1
        return self._ended(action.run_id)

    def _never(self, run_id: str) -> bool:
        """A run that does not exist will never exist once its parent has ended (a
        child run is created with the parent's step that starts it)."""
        parent = _parent(run_id)
        if parent is None:
            return False
        try:
            return self._ended(parent)
        except UnknownRun:
            return self._never(parent)


def tree_ids(client: Fleet, root_id: str) -> list[str]:
    """The ids of the run ``root_id`` and every run below it, as the store has them."""
    like = root_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "/%"
    stmt = select(runs_table.c.id).where(
        (runs_table.c.id == root_id) | runs_table.c.id.like(like, escape="\\")
    )
    with client.runtime.db.engine.connect() as conn:
        return sorted(str(r) for r in conn.execute(stmt).scalars())


def observe(client: Fleet, root_id: str) -> dict[str, Observed]:
    """Every run of the tree of ``root_id``: its status, result or error, transcript."""
    seen: dict[str, Observed] = {}
    for run_id in tree_ids(client, root_id):
        handle = client.run(run_id)
        status = handle.status()
        obs = Observed(status)
        if status in FINISHED:
            try:
                obs.result = handle.wait(timeout=0)
            except RunFailed as exc:
                obs.error = exc.error
        info = client.transcript(run_id)
        obs.raw, obs.window = info.raw(), info.window()
        seen[run_id] = obs
    return seen
