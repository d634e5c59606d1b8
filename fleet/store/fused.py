"""On Postgres, a step's transition and the derived writes it always makes, as one
statement: data-modifying CTEs (``WITH c AS (UPDATE … RETURNING …), a AS (UPDATE …)
SELECT …``), so a step costs a round trip per decision instead of one per write.

Each is built from the same statements the plain path runs one by one
(``fleet/store/transitions.py``, ``fleet/store/derived.py``): the deciding write is
the first CTE, and every derived write is conditioned on its RETURNING rows, so a
write that was fenced or refused changes nothing else, as on the plain path, where
the ledger runs the derived writes only after the deciding one applied. All parts
see the snapshot the statement started with, never each other's writes; none of
these reads what another part writes. SQLite keeps the plain path (it has no
data-modifying CTEs, and its round trips are function calls).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, literal, literal_column, or_, select, true
from sqlalchemy.dialects import postgresql

from fleet.states import AttemptOutcome, Incident
from fleet.store import derived
from fleet.store import transitions as sql
from fleet.store.predicates import OWNER, RUN, STEP, now
from fleet.store.schema import attempts, fanouts, incidents, runs

# --- commit_output: the commit, its attempt closed, the run woken (unless a branch) ---
# Zero rows: fenced (nothing written; the ledger records the fenced attempt). One row:
# ``fanout`` is the step's fan-out (the ledger counts the branch settled and wakes the
# run itself if it was the last), or NULL: the run was woken, the rest of the row is
# the run as the wake-up left it.
_committed = sql.COMMIT.cte("committed")
_closed = (
    derived.CLOSE_ATTEMPT.where(exists(select(_committed.c.fanout)))
    .values(outcome=AttemptOutcome.DONE, error=None)
    .cte("closed")
)
_woken = (
    derived.WAKE.where(exists(select(_committed.c.fanout).where(_committed.c.fanout.is_(None))))
    .returning(*runs.c)
    .cte("woken")
)
COMMIT_AND_WAKE: Any = (
    select(_committed.c.fanout, *_woken.c)
    .select_from(_committed.outerjoin(_woken, true()))
    .add_cte(_closed)
)

# --- commit_output of a branch: the same, the branch counted settled in its fan-out
# (``derived.SETTLE_BRANCH`` of the fan-out the commit returned), and the run woken if
# this branch was the last to settle, or the step is no branch. The count's row lock
# serialises the branches settling at once, as the statement on its own does: exactly one
# of them sees ``settled >= size``. Zero rows: fenced. One row: the run as the wake-up
# left it, or NULLs (a branch whose siblings have not all settled: no wake-up).
_settled = derived.SETTLE.where(
    fanouts.c.run_id == RUN, fanouts.c.fanout == select(_committed.c.fanout).scalar_subquery()
).cte("settled")
_last = exists(select(_settled.c.settled).where(_settled.c.settled >= _settled.c.size))
_woken_if_last = (
    derived.WAKE.where(
        or_(exists(select(_committed.c.fanout).where(_committed.c.fanout.is_(None))), _last)
    )
    .returning(*runs.c)
    .cte("woken")
)
COMMIT_AND_SETTLE: Any = (
    select(_committed.c.fanout, *_woken_if_last.c)
    .select_from(_committed.outerjoin(_woken_if_last, true()))
    .add_cte(_closed, _settled)
)


# --- take_lease: the lease taken, the attempt that held the epoch before marked lost,
# and this attempt's row opened. Zero rows: not taken (the ledger asks why).
# ``lost``: how many attempts were marked lost (a takeover, if any); ``fanout``: the
# step's fan-out, if it is a branch.
# --- take_lease_at_commit: the same, and a takeover's incident noted in the statement,
# as incidents are, in the transaction that met them (the ledger reads this one's rows
# only after the COMMIT, too late to write the incident on its own).
# Each by whether the run has limits, as ``transitions.TAKE``.
def _take_and_open(limited: bool) -> tuple[Any, Any]:
    taken = sql.TAKE[limited].cte("taken")
    lost = (
        derived.MARK_LOST.where(exists(select(taken.c.epoch)))
        .returning(attempts.c.epoch)
        .cte("lost")
    )
    opened = (
        attempts.insert()
        .from_select(
            ["run_id", "step_id", "epoch", "attempt", "worker", "started_at"]
            + list(derived.ATTEMPT_STARTS),
            select(
                RUN,
                STEP,
                taken.c.epoch,
                taken.c.attempts,
                OWNER,
                now(),
                *(literal(v, attempts.c[k].type) for k, v in derived.ATTEMPT_STARTS.items()),
            ),
        )
        .cte("opened")
    )
    take_and_open = select(
        taken.c.epoch,
        taken.c.attempts,
        taken.c.name,
        taken.c.input,
        select(literal_column("count(*)")).select_from(lost).scalar_subquery().label("lost"),
        taken.c.fanout,
    ).add_cte(opened)
    noted = (
        incidents.insert()
        .from_select(
            ["kind", "run_id", "step_id", "epoch", "worker", "at"],
            select(literal(Incident.TAKEOVER.value), RUN, STEP, taken.c.epoch, OWNER, now()).where(
                exists(select(lost.c.epoch))
            ),
        )
        .cte("noted")
    )
    return take_and_open, take_and_open.add_cte(noted)


_TAKES = {limited: _take_and_open(limited) for limited in (True, False)}
TAKE_AND_OPEN: dict[bool, Any] = {limited: pair[0] for limited, pair in _TAKES.items()}
TAKE_OPEN_AND_NOTE: dict[bool, Any] = {limited: pair[1] for limited, pair in _TAKES.items()}

# --- record_steps of one step that ends a replay: the step, and the run marked advanced
_recorded = sql.RECORD_STEP["postgresql"].cte("recorded")
RECORD_AND_ADVANCE: Any = derived.MARK_ADVANCED.add_cte(_recorded)

# The dialect these are for (the ledger runs them only there).
DIALECT: str = postgresql.dialect.name

# Every one of them writes (a meter that counts writing statements asks here).
WRITES: tuple[Any, ...] = (
    COMMIT_AND_WAKE,
    COMMIT_AND_SETTLE,
    *TAKE_AND_OPEN.values(),
    *TAKE_OPEN_AND_NOTE.values(),
    RECORD_AND_ADVANCE,
)
