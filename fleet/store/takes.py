"""The lease take's parts the step ledger runs: why a take was refused (named), the
lease taken, and the take itself in a transaction, its statement chosen by whether the
run has spend limits (``transitions.TAKE``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from fleet.states import RunStatus, StepStatus
from fleet.store import derived, driver, fused
from fleet.store import transitions as sql
from fleet.store.predicates import run_is, step_is, takeable, within_budget
from fleet.store.schema import steps


class TakeRefused(StrEnum):
    """Why a lease was not taken: the zero-rows cases of ``take_lease``, named."""

    UNKNOWN_STEP = "unknown_step"  # malformed or stale message
    ALREADY_FINISHED = "already_finished"  # duplicate delivery of a done/dead step
    LEASE_LIVE = "lease_live"  # duplicate delivery while another attempt runs
    NOT_DUE = "not_due"  # a retry woken early; the sweeper sends it when due
    RUN_NOT_LIVE = "run_not_live"  # the run was cancelled or has finished
    EXHAUSTED = "exhausted"  # the attempt cap was spent by crashed attempts
    OVER_BUDGET = "over_budget"  # the run's spend has reached its budget


@dataclass(frozen=True)
class Lease:
    run_id: str
    step_id: str
    epoch: int
    attempt: int
    name: str
    input: str
    took_over: bool
    # The step is a branch of a fan-out (``wf.map``, ``wf.parallel``): its commit wakes
    # the run only if it is the last branch to settle, so it reads no history with it.
    branch: bool = False


_WHY_NOT_TAKEN = select(
    steps.c.status,
    steps.c.attempts,
    steps.c.max_attempts,
    takeable(sql.now()).label("takeable"),
    run_is(sql.RUN, RunStatus.RUNNING).label("run_live"),
    within_budget(sql.RUN).label("within_budget"),
    ~run_is(sql.RUN, *RunStatus, unlimited=True).label("limited"),
).where(step_is(sql.RUN, sql.STEP))


def take_in(
    conn: Connection, params: dict[str, Any], limited: bool
) -> tuple[int, int, str, str, bool, bool] | None:
    """The take, its earlier attempt marked lost and this one opened, in ``conn``'s
    transaction: (epoch, attempt, name, input, whether it took over, whether the step
    is a branch of a fan-out), or None."""
    if conn.dialect.name == fused.DIALECT:
        # One statement: the take, the earlier attempt marked lost, this one opened.
        row = driver.run(conn, fused.TAKE_AND_OPEN[limited], params).first()
        if row is None:
            return None
        epoch, attempt, name, input_, lost, fanout = row
        return epoch, attempt, name, input_, lost > 0, fanout is not None
    row = driver.run(conn, sql.TAKE[limited], params).first()
    if row is None:
        return None
    epoch, attempt, name, input_, fanout = row
    key = {"b_run": params["b_run"], "b_step": params["b_step"]}
    # Epochs only grow, so a first epoch has no earlier attempt to mark lost.
    took_over = epoch > 1 and driver.run(conn, derived.MARK_LOST, key).rowcount > 0
    opened = {**key, "b_epoch": epoch, "b_attempt": attempt, "b_owner": params["b_owner"]}
    driver.run(conn, derived.OPEN_ATTEMPT, opened)
    return epoch, attempt, name, input_, took_over, fanout is not None


def why_not_taken(
    conn: Connection, key: dict[str, Any], limited: bool = True
) -> TakeRefused | None:
    """Why a take was refused. None: it was taken as for a run without limits
    (``limited`` false) and the run has some, so it is to be taken again as for one
    that has."""
    row = conn.execute(_WHY_NOT_TAKEN, key).first()
    if row is None:
        return TakeRefused.UNKNOWN_STEP
    if StepStatus(row.status).finished:
        return TakeRefused.ALREADY_FINISHED
    if not row.run_live:
        return TakeRefused.RUN_NOT_LIVE
    if not limited and row.limited:
        return None
    if row.takeable and row.attempts >= row.max_attempts:
        return TakeRefused.EXHAUSTED
    if row.takeable and not row.within_budget:
        return TakeRefused.OVER_BUDGET
    if row.status == StepStatus.RUNNING:
        return TakeRefused.LEASE_LIVE
    return TakeRefused.NOT_DUE
