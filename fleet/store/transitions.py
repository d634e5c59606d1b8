"""Every transition of a run or a step, as the one conditional statement that makes
it, built once at import. Only the ledger executes them.

Each group is headed by the state change it makes; a statement that changes a status
takes its ``WHERE status IN (sources)`` and ``SET status = target`` from the entry
of ``fleet.states.TRANSITIONS`` it names (``_move``), so the two cannot drift.
Values are bound by name (``b_*``, see ``fleet/store/predicates.py``); derived writes
sharing a transition's transaction are in ``fleet/store/derived.py``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    Integer,
    String,
    bindparam,
    case,
    exists,
    func,
    insert,
    select,
)
from sqlalchemy import update as _update
from sqlalchemy.dialects import postgresql, sqlite

from fleet.states import TRANSITIONS, Decision, RunStatus, StepKind
from fleet.store.predicates import (
    DELAY,
    EPOCH,
    ERROR,
    GRACE,
    INPUT,
    LEASE,
    NAME,
    OUTPUT,
    OWNER,
    PAYLOAD,
    RUN,
    SEQ,
    SIGNAL,
    STEP,
    WAIT_NAME,
    among,
    held,
    now,
    run_is,
    status_in,
    step_is,
    takeable,
    within_budget,
)
from fleet.store.schema import dead_letters, runs, signals, steps

DIALECTS = {"postgresql": postgresql, "sqlite": sqlite}


# The table entries a statement below was built from (tests/unit/test_states.py).
BUILT: set[str] = set()


def _move(name: str) -> Any:
    """``UPDATE <subject> SET status = target … WHERE status IN (sources)``, from the table."""
    transition = TRANSITIONS[name]
    BUILT.add(name)
    table = runs if transition.subject == "run" else steps
    return _update(table).where(status_in(transition)).values(status=transition.target)


def _run_move(name: str, **values: Any) -> Any:
    return _move(name).where(runs.c.id == RUN).values(updated_at=now(), **values)


# --- create_run: (none) → queued; a no-op if the id exists (enqueue is idempotent) ----


def _create_run(dialect: Any) -> Any:
    parent = bindparam("b_parent", type_=String)
    # A child run is its parent's tenant's; an enqueued run names its own (or none).
    parents_tenant = select(runs.c.tenant).where(runs.c.id == parent).scalar_subquery()
    return (
        dialect.insert(runs)
        .values(
            id=RUN,
            workflow=bindparam("b_workflow", type_=String),
            version=bindparam("b_version", type_=String),
            pins=bindparam("b_pins", type_=String),
            args=bindparam("b_args", type_=String),
            queue=bindparam("b_queue", type_=String),
            status=RunStatus.QUEUED,
            budget_tokens=bindparam("b_budget_tokens", type_=BigInteger),
            budget_cost=bindparam("b_budget_cost", type_=Float),
            parent_id=parent,
            tenant=func.coalesce(bindparam("b_tenant", type_=String), parents_tenant),
            parent_step=bindparam("b_parent_step", type_=String),
            detached=bindparam("b_detached", type_=Boolean),
            wake_seq=1,
            advanced_seq=0,
            dispatches=0,
            redispatch_at=now() + GRACE,
            created_at=now(),
            updated_at=now(),
        )
        .on_conflict_do_nothing()
        # RETURNING, not rowcount: drivers disagree on rowcount for a skipped insert.
        .returning(runs.c.id)
    )


CREATE_RUN = {name: _create_run(dialect) for name, dialect in DIALECTS.items()}

# --- start_run: run queued → running ------------------------------------------------
START_RUN = _run_move("start_run")

# --- set_waiting: run running → waiting; resume_run: waiting → running --------------
# Only if no wake-up came since the replay read the run (``b_wake``, the wake_seq it
# saw): a late replay must not park a run that a signal and a fresher replay moved on.
SET_WAITING = _run_move("set_waiting").where(runs.c.wake_seq == bindparam("b_wake", type_=Integer))
RESUME_RUN = _run_move("resume_run")

# --- succeed_run | fail_run: run running → succeeded | failed -------------------------
# The run that ended names what it owes its family (``Ledger._ended``): its parent, if
# it is a child run, and whether it has live children that end with it (detached ones
# outlive it); a run with neither owes nothing, and nothing more is read.
_LIVE_RUN = [RunStatus(s) for s in sorted(TRANSITIONS["cancel_run"].sources)]
_child = runs.alias("child")
_FAMILY = (
    runs.c.parent_id,
    runs.c.parent_step,
    exists()
    .where(
        _child.c.parent_id == RUN,
        _child.c.detached.is_(False),
        among(_child.c.status, _LIVE_RUN),
    )
    .label("live_children"),
)
FINISH_RUN = {
    status: _run_move(name, result=OUTPUT, error=ERROR, finished_at=now()).returning(*_FAMILY)
    for status, name in ((RunStatus.SUCCEEDED, "succeed_run"), (RunStatus.FAILED, "fail_run"))
}

# --- cancel_run: run queued | running | waiting | needs_decision → cancelled ----------
CANCEL_RUN = _run_move("cancel_run", error=ERROR, finished_at=now())

# --- revoke_lease: its steps running → pending, epoch+1 (their commits are fenced) --
REVOKE_LEASES = (
    _move("revoke_lease")
    .where(steps.c.run_id == RUN)
    .values(epoch=steps.c.epoch + 1, lease_owner=None, lease_expires_at=None)
)

# --- park_run_in_doubt: run running → needs_decision ("effect") ----------------------
PARK_RUN_IN_DOUBT = _run_move("park_run_in_doubt", decision=Decision.EFFECT)

# --- park_over_budget: run running → needs_decision ("budget"), if spend reached it --
PARK_OVER_BUDGET = _run_move("park_over_budget", decision=Decision.BUDGET).where(
    ~within_budget(RUN)
)

# --- resolve_run: run needs_decision → running ---------------------------------------
RESOLVE_RUN = _run_move("resolve_run", decision=None)

# --- raise_budget: run needs_decision ("budget") → running, each limit given replaced --
RAISE_BUDGET = _run_move(
    "raise_budget",
    decision=None,
    budget_tokens=func.coalesce(bindparam("b_tokens", type_=BigInteger), runs.c.budget_tokens),
    budget_cost=func.coalesce(bindparam("b_cost", type_=Float), runs.c.budget_cost),
).where(runs.c.decision == Decision.BUDGET)

# --- replay_run: run failed | running → running (a dead letter replayed) --------------
REPLAY_RUN = _run_move("replay_run", error=None, result=None, finished_at=None)


# --- record_step: (none) → pending (task, wait) | done (value); no-op on conflict ----


def _record_step(dialect: Any) -> Any:
    """Times are offsets from the database's clock, NULL for none (``now + NULL`` is
    NULL): ``b_redispatch_in`` (a task: the advance sends the wake-up itself, the
    sweeper steps in after grace), ``b_due_in`` (a timed wait), ``b_finished_in`` (a
    value, recorded done)."""
    return (
        dialect.insert(steps)
        .values(
            run_id=RUN,
            step_id=STEP,
            seq=SEQ,
            name=NAME,
            kind=bindparam("b_kind", type_=String),
            input=INPUT,
            status=bindparam("b_status", type_=String),
            output=OUTPUT,
            attempts=0,
            max_attempts=bindparam("b_max_attempts"),
            epoch=0,
            dispatches=0,
            created_at=now(),
            redispatch_at=now() + bindparam("b_redispatch_in", type_=Float),
            due_at=now() + bindparam("b_due_in", type_=Float),
            finished_at=now() + bindparam("b_finished_in", type_=Float),
            fanout=bindparam("b_fanout", type_=Integer),
        )
        .on_conflict_do_nothing()
    )


RECORD_STEP = {name: _record_step(dialect) for name, dialect in DIALECTS.items()}


# --- take_lease: step pending | due retry_wait | expired running → running ------------
# epoch+1 and attempts+1 in one write, only while the run is running, the attempt cap
# is not spent and the budget not reached (checked in the statement that starts the
# step: however many workers race, none starts a step once the budget is reached).
# TAKE[False] is for a run with no limits: instead of summing its tree's spend it
# checks that the run has none (a run created without limits never gets one: only
# raise_budget sets them, and only on a run parked over one), so Postgres does not set
# up the spend's recursive subplans at every step (bench/RESULTS.md, "2026-12-05").
def _take(limited: bool) -> Any:
    within = (
        (run_is(RUN, RunStatus.RUNNING), within_budget(RUN))
        if limited
        else (run_is(RUN, RunStatus.RUNNING, unlimited=True),)
    )
    return (
        _move("take_lease")
        .where(
            step_is(RUN, STEP),
            steps.c.kind == StepKind.TASK,
            steps.c.attempts < steps.c.max_attempts,
            takeable(now()),
            *within,
        )
        .values(
            epoch=steps.c.epoch + 1,
            attempts=steps.c.attempts + 1,
            lease_owner=OWNER,
            lease_expires_at=now() + LEASE,
            due_at=None,
            # An expired lease is the sweeper's cue; no other re-send is needed.
            redispatch_at=None,
            dispatches=0,
        )
        .returning(steps.c.epoch, steps.c.attempts, steps.c.name, steps.c.input, steps.c.fanout)
    )


# By whether the run has limits (``RunRow.limited``).
TAKE = {limited: _take(limited) for limited in (True, False)}


# --- heartbeat and release: running stays running, the lease moved (fenced) ----------
RENEW = _update(steps).where(held(RUN, STEP, EPOCH)).values(lease_expires_at=now() + LEASE)
RELEASE = (
    _update(steps)
    .where(held(RUN, STEP, EPOCH))
    .values(lease_expires_at=now() - 0.001, redispatch_at=None)
)


def _fenced(name: str) -> Any:
    """A step transition of the attempt holding ``b_epoch``: zero rows is a fenced write."""
    return _move(name).where(held(RUN, STEP, EPOCH))


# --- commit_output: step running → done, under the epoch held -----------------------
# Returns the step's fan-out: a branch is counted settled in it (none: not a branch).
COMMIT = (
    _fenced("commit_output")
    .values(
        output=OUTPUT,
        error=None,
        lease_owner=None,
        lease_expires_at=None,
        redispatch_at=None,
        finished_at=now(),
    )
    .returning(steps.c.fanout)
)

# --- schedule_retry: step running → retry_wait, its due time in the store -----------
# ``b_resend_after``: how long past the due time the sweeper waits before re-sending.
SCHEDULE_RETRY = _fenced("schedule_retry").values(
    due_at=now() + DELAY,
    error=ERROR,
    lease_owner=None,
    lease_expires_at=None,
    redispatch_at=now() + DELAY + bindparam("b_resend_after", type_=Float),
    dispatches=0,
)

# --- dead_letter: step running → dead (held); dead_letter_exhausted: step pending |
# --- due retry_wait | expired running → dead (its cap spent by crashed attempts) ----
_DEAD = dict(
    error=ERROR,
    lease_owner=None,
    lease_expires_at=None,
    redispatch_at=None,
    due_at=None,
    finished_at=now(),
)
_DEAD_ROW = (steps.c.name, steps.c.input, steps.c.attempts, steps.c.created_at)
DEAD_LETTER = _fenced("dead_letter").values(**_DEAD).returning(*_DEAD_ROW)
DEAD_LETTER_EXHAUSTED = (
    _move("dead_letter_exhausted")
    .where(
        step_is(RUN, STEP),
        steps.c.attempts >= steps.c.max_attempts,
        takeable(now()),
        run_is(RUN, RunStatus.RUNNING),
    )
    .values(**_DEAD)
    .returning(*_DEAD_ROW)
)

# --- replay_step: step dead → pending, a fresh attempt budget, COALESCE(new input) ----
# Decided by the letter: marked replayed only while its step is dead and its run failed
# or running; the step and run writes after it cannot miss (only a replay moves a step
# out of dead).
LETTER = bindparam("b_letter", type_=Integer)
_LETTER_STEP = (steps.c.run_id == dead_letters.c.run_id) & (
    steps.c.step_id == dead_letters.c.step_id
)
REPLAY_LETTER = (
    _update(dead_letters)
    .where(
        dead_letters.c.id == LETTER,
        dead_letters.c.replayed_at.is_(None),
        exists().where(_LETTER_STEP, status_in(TRANSITIONS["replay_step"])),
        run_is(dead_letters.c.run_id, *map(RunStatus, TRANSITIONS["replay_run"].sources)),
    )
    .values(replayed_at=now())
    .returning(dead_letters.c.run_id, dead_letters.c.step_id)
)
REPLAY_STEP = (
    _move("replay_step")
    .where(step_is(RUN, STEP))
    .values(
        attempts=0,
        error=None,
        finished_at=None,
        input=func.coalesce(INPUT, steps.c.input),
        redispatch_at=now() + GRACE,
        dispatches=0,
    )
)

# --- park_in_doubt: step running → in_doubt (held) -----------------------------------
PARK_IN_DOUBT = _fenced("park_in_doubt").values(
    lease_owner=None, lease_expires_at=None, redispatch_at=None
)

# --- resolve_done | resolve_retry: step in_doubt → done | pending (run needs_decision) -
_DECIDING = run_is(RUN, RunStatus.NEEDS_DECISION)
RESOLVE_DONE = (
    _move("resolve_done")
    .where(step_is(RUN, STEP), _DECIDING)
    .values(output=OUTPUT, finished_at=now())
)
RESOLVE_RETRY = (
    _move("resolve_retry")
    .where(step_is(RUN, STEP), _DECIDING)
    .values(
        # One more attempt allowed, whatever the cap spent.
        max_attempts=case(
            (steps.c.max_attempts > steps.c.attempts, steps.c.max_attempts),
            else_=steps.c.attempts + 1,
        ),
        redispatch_at=now() + GRACE,
        dispatches=0,
    )
)

# --- signals: kept while the run is live; deliver_signal: wait pending → done ----------
ADD_SIGNAL = (
    insert(signals)
    .from_select(
        ["run_id", "name", "payload", "created_at"],
        select(RUN, NAME, PAYLOAD, now()).where(run_is(RUN, *_LIVE_RUN)),
    )
    .returning(signals.c.id)
)
PENDING_WAITS = (
    select(steps.c.step_id, steps.c.name)
    .where(
        steps.c.run_id == RUN,
        steps.c.kind == StepKind.WAIT,
        status_in(TRANSITIONS["deliver_signal"]),
        steps.c.name.like("wait:%"),
    )
    .order_by(steps.c.seq)
)
OLDEST_SIGNAL = (
    select(signals.c.id, signals.c.payload)
    .where(signals.c.run_id == RUN, signals.c.name == NAME, signals.c.consumed_at.is_(None))
    .order_by(signals.c.id)
    .limit(1)
)
CONSUME_SIGNAL = (
    _update(signals)
    .where(signals.c.id == SIGNAL, signals.c.consumed_at.is_(None))
    .values(consumed_by=STEP, consumed_at=now())
)
DELIVER_SIGNAL = (
    _move("deliver_signal")
    .where(step_is(RUN, STEP), steps.c.kind == StepKind.WAIT)
    .values(output=PAYLOAD, finished_at=now())
)
# answer_wait: deliver_signal to one named wait of a live run; its signal kept, consumed
ANSWER_WAIT = DELIVER_SIGNAL.where(steps.c.name == WAIT_NAME, run_is(RUN, *_LIVE_RUN))
KEEP_ANSWER = insert(signals).values(
    run_id=RUN, name=NAME, payload=PAYLOAD, created_at=now(), consumed_by=STEP, consumed_at=now()
)

# --- fire_due_wait: wait pending → done (null), its due time reached, run live --------
DUE_WAIT = (
    (steps.c.kind == StepKind.WAIT)
    & status_in(TRANSITIONS["fire_due_wait"])
    & (steps.c.due_at <= now())
    & run_is(steps.c.run_id, RunStatus.RUNNING, RunStatus.WAITING)
)
FIRE_DUE_WAIT = (
    _move("fire_due_wait")
    .where(step_is(RUN, STEP), DUE_WAIT)
    .values(output="null", finished_at=now())
)
RUN_QUEUE = select(runs.c.queue, runs.c.workflow).where(runs.c.id == RUN)


# --- settle_child_done | settle_child_dead: a child step pending → done | dead ---------
# In the transaction that ends its child run (succeed_run, fail_run, cancel_run): the
# parent's step, named by the child's parent_id and parent_step, takes its outcome.
PARENT_OF = select(runs.c.parent_id, runs.c.parent_step).where(runs.c.id == RUN)
_CHILD_STEP = (step_is(RUN, STEP), steps.c.kind == StepKind.CHILD)
SETTLE_CHILD_DONE = (
    _move("settle_child_done").where(*_CHILD_STEP).values(output=OUTPUT, finished_at=now())
)
SETTLE_CHILD_DEAD = (
    _move("settle_child_dead").where(*_CHILD_STEP).values(error=ERROR, finished_at=now())
)
# A run's live children that end with it (detached ones outlive it), by runs.parent_id.
LIVE_CHILDREN = select(runs.c.id).where(
    runs.c.parent_id.in_(bindparam("b_ids", expanding=True)),
    runs.c.detached.is_(False),
    among(runs.c.status, _LIVE_RUN),
)
