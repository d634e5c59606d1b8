"""The bound parameters and predicates every conditional statement is built from.

Statements are built once, at import (``fleet/store/transitions.py``), and take
their values as bound parameters: building one from the column objects on every
call costs SQLAlchemy more Python time than the database spends on it, and a
prebuilt one reuses one compiled form. Parameters are named ``b_*``, never a
column's name, which SQLAlchemy reserves for SET values.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    String,
    and_,
    bindparam,
    exists,
    func,
    literal_column,
    or_,
    select,
)

from fleet.states import RunStatus, StepStatus, Transition
from fleet.store.engine import db_now
from fleet.store.schema import attempts, runs, steps

# --- bound parameters -----------------------------------------------------------

RUN = bindparam("b_run", type_=String)
STEP = bindparam("b_step", type_=String)
EPOCH = bindparam("b_epoch", type_=Integer)
OWNER = bindparam("b_owner", type_=String)
LEASE = bindparam("b_lease", type_=Float)  # seconds from now
GRACE = bindparam("b_grace", type_=Float)  # seconds from now
SEQ = bindparam("b_seq", type_=Integer)
OUTPUT = bindparam("b_output", type_=String)
INPUT = bindparam("b_input", type_=String)
OUTCOME = bindparam("b_outcome", type_=String)
ERROR = bindparam("b_error", type_=String)
ATTEMPT = bindparam("b_attempt", type_=Integer)
NAME = bindparam("b_name", type_=String)
WAIT_NAME = bindparam("b_wait_name", type_=String)  # a wait step's name, "wait:<signal>"
PAYLOAD = bindparam("b_payload", type_=String)
SIGNAL = bindparam("b_signal", type_=Integer)
DELAY = bindparam("b_delay", type_=Float)  # seconds from now
LIMIT = bindparam("b_limit", type_=Integer)


def now() -> Any:
    """The database's clock, read by the statement itself (one clock for the fleet)."""
    return db_now()


# --- predicates -----------------------------------------------------------------


def among(column: Any, names: Iterable[str | Enum]) -> Any:
    """``column IN ('a', 'b')`` of fleet's own state names, written into the statement
    rather than bound: its plan (prepared once per connection) sees them, and the driver
    runs it as compiled (an expanding bound list would need SQLAlchemy to render it)."""
    quoted: list[Any] = []
    for name in sorted({str(getattr(n, "value", n)) for n in names}):
        if not name.isidentifier():
            raise ValueError(f"not a state name: {name!r}")
        quoted.append(literal_column(f"'{name}'"))
    return column.in_(quoted)


def status_in(transition: Transition) -> Any:
    """``status IN (sources)`` of the table entry, on its subject's table."""
    table = runs if transition.subject == "run" else steps
    return among(table.c.status, transition.sources)


def takeable(at: Any) -> Any:
    """A step whose lease may be taken now: never run, due for retry, or abandoned."""
    return or_(
        steps.c.status == StepStatus.PENDING,
        and_(steps.c.status == StepStatus.RETRY_WAIT, steps.c.due_at <= at),
        and_(steps.c.status == StepStatus.RUNNING, steps.c.lease_expires_at < at),
    )


def run_is(run_id: Any, *statuses: RunStatus, unlimited: bool = False) -> Any:
    """The run is in one of ``statuses`` (and, if ``unlimited``, has no spend limits)."""
    where = [runs.c.id == run_id, among(runs.c.status, statuses)]
    if unlimited:
        where += [runs.c.budget_tokens.is_(None), runs.c.budget_cost.is_(None)]
    return exists().where(*where)


def tree(run_id: Any, name: str = "tree") -> Any:
    """The ids of a run and of its descendants (its child runs, theirs…), found through
    runs.parent_id; nested, so it can stand inside any statement's subquery."""
    top = select(runs.c.id).where(runs.c.id == run_id).cte(name, recursive=True, nesting=True)
    return top.union_all(select(runs.c.id).where(runs.c.parent_id == top.c.id))


def spent_tokens(run_id: Any) -> Any:
    ids = tree(run_id, "tree_tokens")
    return (
        select(func.coalesce(func.sum(attempts.c.input_tokens + attempts.c.output_tokens), 0))
        .where(attempts.c.run_id.in_(select(ids.c.id)))
        .scalar_subquery()
    )


def spent_cost(run_id: Any) -> Any:
    ids = tree(run_id, "tree_cost")
    return (
        select(func.coalesce(func.sum(attempts.c.cost), 0.0))
        .where(attempts.c.run_id.in_(select(ids.c.id)))
        .scalar_subquery()
    )


def within_budget(run_id: Any) -> Any:
    """The spend recorded by the run's tree (every attempt of it and of its child runs,
    theirs too) is below each limit the run has. A child's own limits were capped at
    its start by what its parent had left (fleet/worker/children.py)."""
    return exists().where(
        runs.c.id == run_id,
        or_(runs.c.budget_tokens.is_(None), spent_tokens(run_id) < runs.c.budget_tokens),
        or_(runs.c.budget_cost.is_(None), spent_cost(run_id) < runs.c.budget_cost),
    )


def step_is(run_id: Any, step_id: Any) -> Any:
    return and_(steps.c.run_id == run_id, steps.c.step_id == step_id)


def held(run_id: Any, step_id: Any, epoch: Any) -> Any:
    """The fence: the step is still running under the epoch this writer holds."""
    return and_(
        step_is(run_id, step_id), steps.c.status == StepStatus.RUNNING, steps.c.epoch == epoch
    )
