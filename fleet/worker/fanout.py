"""Fan-outs on the workflow's side: ``wf.map`` and ``wf.parallel`` (``Fanouts``, a part
of ``WorkflowContext``), and ``wf.call``, which describes one branch of ``parallel``
(see CONTRACT.md).

A fan-out reserves one position per branch, in order, and records its new branches
together (one write); its results come back once every branch has settled, so a dead
branch raises only when nothing of the fan-out can still run (invariant 11).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.errors import BranchesFailed, LimitExceeded, StepFailed
from fleet.registry import StepDef, WorkflowDef
from fleet.store.ledger import NewStep
from fleet.store.rows import StepRow
from fleet.worker.runtime import Runtime


@dataclass(frozen=True)
class Call:
    """One branch of ``wf.parallel``, described by ``wf.call``: a step (or a workflow,
    run as a child) and its arguments; ``key`` names its step (default: positional)."""

    fn: StepDef | WorkflowDef | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str | None = None


def _not_a_call(given: object) -> str:
    """What ``parallel`` says when given something other than a ``wf.call``."""
    name = getattr(given, "name", None)
    if isinstance(given, StepDef | WorkflowDef) and isinstance(name, str):
        return f"parallel() takes wf.call(...) descriptions, not {name!r}: wf.call({name}, ...)"
    return f"parallel() takes wf.call(...) descriptions, got {given!r:.100}"


class Fanouts:
    """``WorkflowContext``'s fan-out calls. It uses the context's replay mechanics
    (fleet/worker/workflow.py): positions reserved and checked (``_expect``), steps
    recorded (``_record``), a stop until steps move on (``_park``), a settled step's
    outcome (``_outcome``)."""

    if TYPE_CHECKING:
        run_id: str
        _rt: Runtime
        _pos: int

        def _positional(self, name: str) -> str: ...
        def _next_id(self, name: str, key: str | None) -> str: ...
        def _expect(self, step_id: str, name: str) -> StepRow | None: ...
        def _record(self, new: list[NewStep], last: bool = False) -> None: ...
        def _park(self, start: int, ids: Sequence[str]) -> Sequence[StepRow]: ...
        def _outcome(self, rec: StepRow | None, pos: int, step_id: str) -> Any: ...
        def _new_task(
            self, sd: StepDef, step_id: str, args: Sequence[Any], kwargs: dict[str, Any]
        ) -> NewStep: ...
        def _new_child(
            self, wd: WorkflowDef, step_id: str, args: Sequence[Any], kwargs: dict[str, Any]
        ) -> NewStep: ...

    def map(
        self,
        fn: StepDef | str,
        items: Iterable[Any],
        key: str | Callable[[Any], str] | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """One step per item, run in parallel; results in order, once every item has
        settled (a dead item raises only then: no sibling is left pending).

        ``key`` names the items: a prefix (``key#1``, ``key#2``…) or a function of the item.
        With ``return_exceptions`` a dead item stands in the list as its ``StepFailed``.
        """
        sd = self._rt.registry.step(fn)
        items = list(items)
        self._check_fanout(len(items))
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
        return self._gather(recs, ids, new, return_exceptions)

    def call(
        self, fn: StepDef | WorkflowDef | str, *args: Any, key: str | None = None, **kwargs: Any
    ) -> Call:
        """Describe one branch of ``parallel``: a step, or a child workflow, with its
        arguments. Nothing runs until ``parallel`` is given it."""
        return Call(fn, args, kwargs, key)

    def parallel(self, *calls: Call, return_exceptions: bool = False) -> list[Any]:
        """Run different steps (or child workflows), each described by ``wf.call``, at
        once; results in order, once every branch has settled. A dead branch raises its
        ``StepFailed`` (a child's ``ChildFailed``); several dead: ``BranchesFailed`` naming
        them all. With ``return_exceptions`` each dead branch stands in the list instead."""
        self._check_fanout(len(calls))
        recs: list[StepRow | None] = []
        ids: list[str] = []
        new: list[NewStep] = []
        for call in calls:
            if not isinstance(call, Call):
                raise TypeError(_not_a_call(call))
            target = self._target(call.fn)
            step_id = self._next_id(target.name, call.key)
            rec = self._expect(step_id, target.name)
            recs.append(rec)
            ids.append(step_id)
            if rec is not None:
                continue
            if isinstance(target, WorkflowDef):
                new.append(self._new_child(target, step_id, call.args, call.kwargs))
            else:
                new.append(self._new_task(target, step_id, call.args, call.kwargs))
        return self._gather(recs, ids, new, return_exceptions)

    def _gather(
        self,
        recs: Sequence[StepRow | None],
        ids: Sequence[str],
        new: list[NewStep],
        return_exceptions: bool,
    ) -> list[Any]:
        """The results of a fan-out's branches, in order, once all have settled. New
        branches are recorded together (one fan-out) and the replay stops; so it does
        while any branch is still pending or running, even if another is already dead:
        a fan-out raises only once nothing of it can still run. The branches hold the
        last ``len(ids)`` positions ``_expect`` reserved."""
        start = self._pos - len(ids)
        if new:
            self._record(new, last=True)
        while new or any(rec is None or not rec.status.finished for rec in recs):
            recs, new = self._park(start, ids), []
        results: list[Any] = []
        dead: list[StepFailed] = []
        for i, rec in enumerate(recs):
            try:
                results.append(self._outcome(rec, start + i, ids[i]))
            except StepFailed as exc:
                dead.append(exc)
                results.append(exc)
        if dead and not return_exceptions:
            if len(dead) == 1:
                raise dead[0]
            raise BranchesFailed(dead) from dead[0]
        return results

    def _check_fanout(self, branches: int) -> None:
        limit = self._rt.settings.max_fanout
        if branches > limit:
            raise LimitExceeded(
                f"a fan-out of {branches} branches in run {self.run_id} is over "
                f"FLEET_MAX_FANOUT={limit}"
            )

    def _target(self, fn: StepDef | WorkflowDef | str) -> StepDef | WorkflowDef:
        """What a ``wf.call`` names: a registered step, or a workflow to run as a child."""
        registry = self._rt.registry
        if isinstance(fn, WorkflowDef):
            return registry.workflow(fn)
        if isinstance(fn, str) and fn not in registry.steps and fn in registry.workflows:
            return registry.workflows[fn]
        return registry.step(fn)
