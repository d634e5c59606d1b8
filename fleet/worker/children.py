"""Child runs (subagents) on the workflow's side: ``wf.child`` and ``wf.start_child``
(``Children``, a part of ``WorkflowContext``), the step that starts one, and the
handle a workflow waits on (see CONTRACT.md).

A child run is a run of another registered workflow. Its id is
``{parent run id}/{step id}`` and its row is inserted in the transaction that records
the parent's child step (``Ledger.record_steps``), so however often the parent is
replayed, one child is started. The parent's step stays pending until the child run
ends; the ledger settles it then, in the child's finishing transaction
(``Ledger.finish_run``, ``Ledger.cancel_run``), and wakes the parent.

Budgets: a child's budget (the ``budget=`` given, else its workflow's) is capped, when
it starts, by what is left of each budget of its parent (the parent's limit minus the
spend of its whole tree, children included). A parent's own steps are held to its
budget against that tree spend (``fleet/store/predicates.py::within_budget``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.errors import LimitExceeded
from fleet.registry import WorkflowDef, check_budget
from fleet.states import StepKind
from fleet.store.ledger import NewChild, NewStep
from fleet.store.rows import RunRow, StepRow
from fleet.store.schema import runs
from fleet.worker.runtime import Runtime

# The schema's runs.id length (fleet/store/schema.py): a child id longer fails its parent.
MAX_RUN_ID: int = runs.c.id.type.length


def child_run_id(parent_id: str, step_id: str) -> str:
    """The id of the child run a parent's step starts: stable across replays."""
    return f"{parent_id}/{step_id}"


def new_child(
    rt: Runtime,
    parent: RunRow,
    wd: WorkflowDef,
    step_id: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    budget: Mapping[str, float] | None = None,
    detached: bool = False,
) -> NewStep:
    """The child step ``step_id`` of ``parent`` and the run it starts: ``wd``'s version,
    pins and queue (as ``Fleet.enqueue`` computes them), the call as both the step's
    input and the run's arguments. A bad call or a child id over ``MAX_RUN_ID``
    characters raises, failing the parent with one line."""
    run_id = child_run_id(parent.id, step_id)
    if len(run_id) > MAX_RUN_ID:
        raise LimitExceeded(
            f"child run id {run_id[:60]!r}… is {len(run_id)} characters, over the "
            f"{MAX_RUN_ID} a run id may have: give the child (wf.child, wf.start_child, "
            "wf.call) a shorter key="
        )
    wd.check_call(args, kwargs)
    tokens, cost = check_budget(budget if budget is not None else wd.budget)
    tokens, cost = _capped(rt, parent, tokens, cost)
    payload = rt.payloads.dump(
        {"args": list(args), "kwargs": kwargs}, what=f"arguments of child {step_id}"
    )
    pins = wd.encoded_pins()
    child = NewChild(
        run_id,
        wd.name,
        wd.version,
        pins,
        payload,
        wd.queue(rt.settings.queue),
        tokens,
        cost,
        detached,
    )
    return NewStep(step_id, -1, wd.name, StepKind.CHILD, payload, 1, child=child)


def _capped(
    rt: Runtime, parent: RunRow, tokens: int | None, cost: float | None
) -> tuple[int | None, float | None]:
    """Each limit of the child's no higher than what its parent has left (at least one
    token, a millionth of cost: a child started with nothing left parks at once)."""
    if parent.budget_tokens is None and parent.budget_cost is None:
        return tokens, cost
    spent = rt.queries.usage(parent.id)
    if parent.budget_tokens is not None:
        left = max(1, parent.budget_tokens - int(spent["tokens"]))
        tokens = left if tokens is None else min(tokens, left)
    if parent.budget_cost is not None:
        left_cost = max(1e-6, parent.budget_cost - float(spent["cost"]))
        cost = left_cost if cost is None else min(cost, left_cost)
    return tokens, cost


@dataclass(frozen=True)
class ChildHandle:
    """A started child run (``wf.start_child``): ``result()`` is its outcome once it has
    ended: its return value, or ``ChildFailed`` if it failed or was cancelled; until
    then the replay stops there, holding no worker."""

    run_id: str
    step_id: str
    _pos: int  # the child step's position in the run's history
    _settled: Callable[[int, str], Any]

    def result(self) -> Any:
        return self._settled(self._pos, self.step_id)


class Children:
    """``WorkflowContext``'s calls that start child runs. It uses the context's replay
    mechanics (fleet/worker/workflow.py): a position reserved and checked (``_expect``),
    steps recorded (``_record``), a recorded step's outcome (``_settled``)."""

    if TYPE_CHECKING:
        run_id: str
        _rt: Runtime
        _run: RunRow
        _pos: int

        def _next_id(self, name: str, key: str | None) -> str: ...
        def _expect(self, step_id: str, name: str) -> StepRow | None: ...
        def _record(self, new: list[NewStep], last: bool = False) -> None: ...
        def _settled(self, pos: int, step_id: str) -> Any: ...

    def child(
        self,
        workflow: WorkflowDef | str,
        *args: Any,
        key: str | None = None,
        budget: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``workflow`` as a child run (a subagent: its own steps, retries, budget)
        and return its result; ``ChildFailed`` if it failed or was cancelled. Its run
        id is ``{this run's id}/{key or position}``: a replay never starts a second
        one. The run waits holding no worker; cancelling it cancels the child."""
        return self._start_child(workflow, args, kwargs, key, budget, False, True).result()

    def start_child(
        self,
        workflow: WorkflowDef | str,
        *args: Any,
        key: str | None = None,
        budget: Mapping[str, float] | None = None,
        detached: bool = False,
        **kwargs: Any,
    ) -> ChildHandle:
        """Start a child run and go on at once: the handle's ``result()`` waits for it,
        so several children run together. ``detached=True``: it is not cancelled when
        this run is cancelled or ends (it outlives it)."""
        return self._start_child(workflow, args, kwargs, key, budget, detached, False)

    def _start_child(
        self,
        workflow: WorkflowDef | str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: str | None,
        budget: Mapping[str, float] | None,
        detached: bool,
        last: bool,
    ) -> ChildHandle:
        """Reserve the child step's position and record it (with its run) if new;
        ``last``: the replay suspends right after (``child``), so mark it advanced."""
        wd = self._rt.registry.workflow(workflow)
        step_id = self._next_id(wd.name, key)
        rec = self._expect(step_id, wd.name)
        if rec is None:
            self._record([self._new_child(wd, step_id, args, kwargs, budget, detached)], last)
        run_id = child_run_id(self.run_id, step_id)
        return ChildHandle(run_id, step_id, self._pos - 1, self._settled)

    def _new_child(
        self,
        wd: WorkflowDef,
        step_id: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        budget: Mapping[str, float] | None = None,
        detached: bool = False,
    ) -> NewStep:
        """The child step ``step_id`` and the run of ``wd`` it starts (not recorded):
        for ``child``, ``start_child`` and a workflow given to ``wf.call``."""
        return new_child(self._rt, self._run, wd, step_id, args, kwargs, budget, detached)
