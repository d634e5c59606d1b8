"""The ledger's family transitions: a run's cancel, and what a run that ends (succeeds,
fails or is cancelled) owes its family in the same transaction: its parent's child
step settled (the parent woken), its live children cancelled, theirs too. A run that
ends leaves nothing of its own running (DESIGN.md, invariant 11)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from fleet.errors import StoreUnavailable
from fleet.states import RunStatus
from fleet.store import audit
from fleet.store import transitions as sql
from fleet.store.engine import retryable
from fleet.store.step_ledger import StepLedger

# How many generations of children a run that ends cancels with it, at most.
MAX_GENERATIONS = 64
CANCEL_TRIES = 3  # a cancel Postgres aborted to break a deadlock is tried again


class Family(StepLedger):
    """A run's cancel and its end's derived writes for its parent and children."""

    def cancel_run(self, run_id: str, reason: str, action: audit.Action | None = None) -> bool:
        """cancel_run: any live state → cancelled. Leases of running steps are revoked in
        the same transaction (revoke_lease: running → pending, epoch+1), so their commits
        are fenced and their heartbeats fail; no step of a cancelled run can take a
        lease, and no advance replays it. False: the run had finished already.

        It locks the run, then its children; a child finishing at that moment locks
        itself, then its parent. Postgres breaks that deadlock by aborting one side: if
        it is this one, the cancel is tried again (a few times), never half-applied."""
        for tries_left in reversed(range(CANCEL_TRIES)):
            try:
                return self._cancel_once(run_id, reason, action)
            except StoreUnavailable as exc:
                if self.tx is not None or not tries_left or not retryable(exc):
                    raise
        raise AssertionError("unreachable")

    def _cancel_once(self, run_id: str, reason: str, action: audit.Action | None) -> bool:
        with self.db.begin(self.tx) as conn:
            params = {"b_run": run_id, "b_error": f"cancelled: {reason}"}
            if conn.execute(sql.CANCEL_RUN, params).rowcount != 1:
                return False  # not live: finished (or cancelled) already
            conn.execute(sql.REVOKE_LEASES, {"b_run": run_id})
            self._ended(conn, run_id, RunStatus.CANCELLED, reason)
            self._audit(conn, action, run_id)
            return True

    def _ended(
        self,
        conn: Connection,
        run_id: str,
        status: RunStatus,
        text: str | None,
        parent: Any = None,
    ) -> None:
        """What a run that has just ended owes its family, in its transaction: its
        parent's child step takes its outcome (the parent is woken), and its live
        children that are not detached are cancelled, theirs too, each settling its
        parent's step: a run that ends leaves nothing of its own running. ``parent``:
        the run's parent_id and parent_step, if its ending statement returned them."""
        self._settle_parent(conn, run_id, status, text, parent)
        why = f"parent run {run_id} {'cancelled' if status is RunStatus.CANCELLED else 'ended'}"
        generation = [run_id]
        for _ in range(MAX_GENERATIONS):
            generation = list(conn.execute(sql.LIVE_CHILDREN, {"b_ids": generation}).scalars())
            if not generation:
                return
            for child in generation:
                params = {"b_run": child, "b_error": f"cancelled: {why}"}
                if conn.execute(sql.CANCEL_RUN, params).rowcount == 1:
                    conn.execute(sql.REVOKE_LEASES, {"b_run": child})
                    self._settle_parent(conn, child, RunStatus.CANCELLED, why)

    def _settle_parent(
        self,
        conn: Connection,
        run_id: str,
        status: RunStatus,
        text: str | None,
        parent: Any = None,
    ) -> None:
        """A child run ended: settle_child_done (``text``: its result) or
        settle_child_dead (``text``: its error, or why it was cancelled, then named) on
        its parent's step; the parent is woken if that step was the last of its fan-out
        to settle (or no branch). ``parent``: its parent_id and parent_step, if known."""
        if parent is None:
            parent = conn.execute(sql.PARENT_OF, {"b_run": run_id}).first()
        if parent is None or parent.parent_id is None:
            return
        key = {"b_run": parent.parent_id, "b_step": parent.parent_step}
        if status is RunStatus.SUCCEEDED:
            settled = conn.execute(sql.SETTLE_CHILD_DONE, {**key, "b_output": text})
        else:
            line = (text or "no error recorded").partition("\n")[0][:2000]
            why = f"child run {run_id} {status}: {line}"
            settled = conn.execute(sql.SETTLE_CHILD_DEAD, {**key, "b_error": why})
        if settled.rowcount == 1 and self._branch_settled(conn, *key.values()):
            self._wake(conn, parent.parent_id)
