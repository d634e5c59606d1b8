"""The ledger's upkeep: writes that change no status. The sweeper's claims on
stalled steps and runs (their statements in ``fleet/store/sweeps.py``), incidents,
dead messages, blobs, model spend, and retention's deletes. Each statement is built
once; each method is one short transaction (the caller's, for a ledger bound with
``within``).

``LedgerBase`` also holds the derived writes every transition shares (a run's
wake-up, the attempt log, intents, incidents): ``fleet/store/ledger.py`` composes
it into the one ``Ledger`` callers see.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Self

from sqlalchemy import (
    BigInteger,
    Float,
    String,
    bindparam,
    delete,
    func,
    insert,
    not_,
)
from sqlalchemy import select as _select
from sqlalchemy import update as _update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import BindParameter

from fleet.states import (
    AttemptOutcome,
    Incident,
    IntentOutcome,
    StepStatus,
)
from fleet.store import derived, driver, pruning, totals
from fleet.store import transitions as sql
from fleet.store.engine import Database, Transaction
from fleet.store.predicates import (
    EPOCH,
    RUN,
    STEP,
    now,
)
from fleet.store.schema import attempts, blobs, dead_messages, runs
from fleet.store.sweeps import (
    CLAIM_RUN,
    CLAIM_STEP,
    STALLED_RUNS,
    STALLED_STEPS,
    STRANDED_SIGNALS,
    Stalled,
)

log = logging.getLogger("fleet.ledger")

# --- spend, blobs, dead messages ------------------------------------------------------
# Spend is added to the attempt that spent it, fenced or not: it was really spent.
ADD_USAGE = (
    _update(attempts)
    .where(attempts.c.run_id == RUN, attempts.c.step_id == STEP, attempts.c.epoch == EPOCH)
    .values(
        calls=attempts.c.calls + 1,
        input_tokens=attempts.c.input_tokens + bindparam("b_in", type_=BigInteger),
        output_tokens=attempts.c.output_tokens + bindparam("b_out", type_=BigInteger),
        cost=attempts.c.cost + bindparam("b_cost", type_=Float),
        # No model named ("" or None): the one recorded stays.
        model=func.coalesce(func.nullif(bindparam("b_model", type_=String), ""), attempts.c.model),
    )
)
DIGEST = bindparam("b_digest", type_=String)
PUT_BLOB = {
    name: dialect.insert(blobs)
    .values(
        digest=DIGEST,
        size=bindparam("b_size"),
        body=bindparam("b_body", type_=String),
        created_at=now(),
    )
    .on_conflict_do_update(index_elements=[blobs.c.digest], set_={"created_at": now()})
    for name, dialect in sql.DIALECTS.items()
}
SET_ASIDE = insert(dead_messages).values(
    queue=bindparam("b_queue", type_=String),
    reason=bindparam("b_reason", type_=String),
    body=bindparam("b_body", type_=String),
    at=now(),
)
IDS: BindParameter[Any] = bindparam("b_ids", expanding=True)
PURGE_MESSAGES = delete(dead_messages).where(dead_messages.c.id.in_(IDS))
PURGE_ALL_MESSAGES = delete(dead_messages)

# --- retention: deletes of whole trees of runs and every row of theirs, re-checked ----
CUTOFF = bindparam("b_cutoff", type_=Float)
ROOTS: BindParameter[Any] = bindparam("b_roots", expanding=True)
# Every run of the trees, locked (Postgres): a run row another transaction is writing is
# skipped, never waited on, and its tree then kept. Then the trees are read again.
_FAMILY = pruning.family(ROOTS, CUTOFF)
PRUNE_LOCK = (
    _select(runs.c.id).where(runs.c.id.in_(_select(_FAMILY.c.id))).with_for_update(skip_locked=True)
)
PRUNE_CHILDREN = {
    pruning.short_name(table): delete(table).where(table.c.run_id.in_(IDS))
    for table in pruning.CHILDREN
}
PRUNE_RUNS = delete(runs).where(runs.c.id.in_(IDS), pruning.prunable(CUTOFF))
PRUNE_BLOBS = delete(blobs).where(
    blobs.c.digest.in_(bindparam("b_digests", expanding=True)),
    pruning.stale_blob(bindparam("b_grace_seconds", type_=Float)),
    *[not_(found) for found in pruning.referenced()],
)

# A dead message's body is kept up to this many bytes of UTF-8.
DEAD_MESSAGE_MAX_BYTES = 64 * 1024


def clip_text(text: str, max_bytes: int) -> str:
    """At most ``max_bytes`` of UTF-8, whole characters only; no NUL (Postgres text
    cannot hold one) and no lone surrogate (not encodable)."""
    data = text.encode("utf-8", "backslashreplace").replace(b"\x00", b"\\x00")
    return data[:max_bytes].decode("utf-8", "ignore")


class LedgerBase:
    """The store, the grace period, and the derived writes every transition shares.

    ``tx``: the transaction every method runs in, if this ledger was bound to one
    (``within``); None: each method opens and commits its own."""

    def __init__(self, db: Database, grace: float = 5.0, tx: Transaction | None = None) -> None:
        self.db = db
        self.grace = grace
        self.tx = tx

    def within(self, tx: Transaction) -> Self:
        """This ledger with every method run in ``tx``, committed or rolled back with it."""
        return type(self)(self.db, self.grace, tx)

    def _wake(self, conn: Connection, run_id: str) -> None:
        """Note that the run needs replaying; the sweeper re-sends if the advance is lost."""
        driver.run(conn, derived.WAKE, {"b_run": run_id, "b_grace": self.grace})

    @staticmethod
    def _branch_settled(conn: Connection, run_id: str, step_id: str) -> bool:
        """Count a step that has just settled (done or dead) in its fan-out. True: the
        run is to be woken, as the step is no branch, or the last of its fan-out to
        settle; False: siblings are still unsettled, and a replay would only stop at
        them again (so a fan-out of N costs one replay, not N). Every transition into
        done or dead of a step that can be a branch calls it, in its transaction."""
        row = driver.run(conn, derived.SETTLE_BRANCH, {"b_run": run_id, "b_step": step_id}).first()
        return row is None or row.settled >= row.size

    @staticmethod
    def _branch_unsettled(conn: Connection, run_id: str, step_id: str) -> None:
        """The step left done or dead again (a dead letter replayed): uncount it."""
        conn.execute(derived.UNSETTLE_BRANCH, {"b_run": run_id, "b_step": step_id})

    @staticmethod
    def _close_attempt(
        conn: Connection,
        run_id: str,
        step_id: str,
        epoch: int,
        outcome: AttemptOutcome,
        error: str | None = None,
    ) -> None:
        params = {"b_run": run_id, "b_step": step_id, "b_epoch": epoch}
        driver.run(conn, derived.CLOSE_ATTEMPT, {**params, "b_outcome": outcome, "b_error": error})

    @staticmethod
    def _settle_intents(
        conn: Connection,
        run_id: str,
        step_id: str,
        outcome: IntentOutcome,
        *,
        epoch: int | None = None,
        before: int | None = None,
    ) -> None:
        """Close open intents of a step: the one of ``epoch``, those before ``before``, or all."""
        params: dict[str, Any] = {"b_run": run_id, "b_step": step_id, "b_outcome": outcome}
        if epoch is not None:
            conn.execute(derived.SETTLE_INTENT, {**params, "b_epoch": epoch})
        elif before is not None:
            conn.execute(derived.SETTLE_INTENTS_BEFORE, {**params, "b_epoch": before})
        else:
            conn.execute(derived.SETTLE_ALL_INTENTS, params)

    @staticmethod
    def _incident(
        conn: Connection,
        kind: Incident,
        run_id: str | None,
        step_id: str | None,
        epoch: int | None,
        worker: str | None,
        detail: str | None = None,
    ) -> None:
        conn.execute(
            derived.INCIDENT,
            {
                "b_kind": kind,
                "b_run": run_id,
                "b_step": step_id,
                "b_epoch": epoch,
                "b_owner": worker,
                "b_detail": detail,
            },
        )


class Upkeep(LedgerBase):
    """Writes that change no status: claims, incidents, spend, blobs, deletes."""

    # --- the sweeper's claims -------------------------------------------------

    def claim_stalled_steps(self, limit: int = 500) -> list[Stalled]:
        """Steps that need an execute message the store has no sign was answered:
        takeable now and past their re-send time. Claiming pushes the re-send time
        out (linear back-off), so concurrent sweepers and a long backlog do not
        multiply messages."""
        with self.db.begin(self.tx) as conn:
            claimed: list[Stalled] = []
            for run_id, step_id in conn.execute(STALLED_STEPS, {"b_limit": limit}).all():
                key = {"b_run": run_id, "b_step": step_id}
                row = conn.execute(CLAIM_STEP, {**key, "b_grace": self.grace}).first()
                if row is None:
                    continue  # no longer stalled since it was listed: nothing to re-send
                queue, workflow = conn.execute(sql.RUN_QUEUE, key).one()
                abandoned = row.status == StepStatus.RUNNING
                claimed.append(Stalled(run_id, step_id, queue, workflow, row.name, abandoned))
            return claimed

    def stranded_signals(self, limit: int = 500) -> list[tuple[str, str]]:
        """Live runs with a kept signal and a pending wait for it that no hand-over
        met (``STRANDED_SIGNALS``); (run_id, queue) each, for ``deliver_signals``."""
        with self.db.begin(self.tx) as conn:
            rows = conn.execute(STRANDED_SIGNALS, {"b_limit": limit}).all()
            return [(str(run_id), str(queue)) for run_id, queue in rows]

    def claim_stalled_runs(self, limit: int = 500) -> list[tuple[str, str]]:
        """Runs with a wake-up no replay has answered (a lost advance message), past
        their re-send time. Returns (run_id, queue)."""
        with self.db.begin(self.tx) as conn:
            ids = list(conn.execute(STALLED_RUNS, {"b_limit": limit}).scalars())
            claimed: list[tuple[str, str]] = []
            for run_id in ids:
                row = conn.execute(CLAIM_RUN, {"b_run": run_id, "b_grace": self.grace}).first()
                if row is not None:  # None: answered since it was listed
                    claimed.append((run_id, row.queue))
            return claimed

    # --- incidents --------------------------------------------------------------

    def incident(
        self,
        kind: Incident,
        run_id: str | None,
        step_id: str | None = None,
        epoch: int | None = None,
        worker: str | None = None,
        detail: str | None = None,
    ) -> None:
        with self.db.begin(self.tx) as conn:
            self._incident(conn, kind, run_id, step_id, epoch, worker, detail)

    # --- spend and blobs --------------------------------------------------------------

    def add_usage(
        self,
        run_id: str,
        step_id: str,
        epoch: int,
        *,
        model: str | None,
        input_tokens: int,
        output_tokens: int,
        cost: float,
    ) -> None:
        """Add spend to the attempt that spent it, fenced or not: it was really spent."""
        with self.db.begin(self.tx) as conn:
            conn.execute(
                ADD_USAGE,
                {
                    "b_run": run_id,
                    "b_step": step_id,
                    "b_epoch": epoch,
                    "b_model": model,
                    "b_in": input_tokens,
                    "b_out": output_tokens,
                    "b_cost": cost,
                },
            )

    def put_blob(self, digest: str, body: str) -> None:
        """Store a large value once. If the same content is there already, only its
        ``created_at`` moves to now: retention never deletes a blob stored (or stored
        again) within its grace period, so a writer that is about to reference it is safe
        (see ``prune_blobs``)."""
        with self.db.begin(self.tx) as conn:
            params = {"b_digest": digest, "b_size": len(body.encode()), "b_body": body}
            conn.execute(PUT_BLOB[conn.dialect.name], params)

    # --- dead messages: broker messages that were not fleet's -------------------------

    def set_aside_message(self, queue: str, reason: str, raw: str) -> int:
        """Keep a message the broker delivered that is not fleet's (see fleet.envelope),
        once; its id. Each value is clipped here, whatever the caller sends."""
        with self.db.begin(self.tx) as conn:
            result = conn.execute(
                SET_ASIDE,
                {
                    "b_queue": clip_text(queue, 200),
                    "b_reason": clip_text(reason, 1000),
                    "b_body": clip_text(raw, DEAD_MESSAGE_MAX_BYTES),
                },
            )
            key = result.inserted_primary_key
            assert key is not None
            return int(key[0])

    def purge_dead_messages(self, ids: list[int] | None) -> int:
        """Delete the dead messages with these ids (None: all of them); how many went."""
        if ids is not None and not ids:
            return 0
        with self.db.begin(self.tx) as conn:
            if ids is None:
                return int(conn.execute(PURGE_ALL_MESSAGES).rowcount)
            return int(conn.execute(PURGE_MESSAGES, {"b_ids": ids}).rowcount)

    # --- retention ----------------------------------------------------------------
    # Deletes, not transitions: a finished run and every row of its own go together.
    # fleet/worker/retention.py decides when, fleet/store/pruning.py says what may go;
    # each call here is one short transaction that re-checks that rule on what it deletes.

    def prune_trees(self, roots: Sequence[str], cutoff: float) -> dict[str, int]:
        """Delete the trees of these root runs (``pruning.family``), each only if every run
        of it is still prunable at ``cutoff``, whole: its runs with their steps, attempts,
        intents, signals, dead letters, incidents, messages. In one transaction that
        first locks (Postgres) every run of the trees, then reads them again: a tree with
        a run that changed since it was listed (a dead letter replayed: failed → running),
        or that another transaction holds, is left whole. What the metrics count of the
        rows deleted is added to the kept totals (``totals.add_pruned``) in the same
        transaction. The run rows' own DELETE re-checks the rule once more; a miss undoes
        the batch, totals too. Returns the rows deleted per table (``runs``, ``steps``…)."""
        with self.db.begin(self.tx) as conn:
            params = {"b_roots": list(roots), "b_cutoff": cutoff}
            locked = set(conn.execute(PRUNE_LOCK, params).scalars())
            ids = []
            for tree in pruning.tree_members(conn, roots, cutoff).values():
                if all(not live and member in locked for member, live in tree):
                    ids += [member for member, _ in tree]
            if not ids:
                return {}
            batch = conn.begin_nested()
            totals.add_pruned(conn, ids)  # before the rows it counts go
            counts = {
                name: conn.execute(stmt, {"b_ids": ids}).rowcount
                for name, stmt in PRUNE_CHILDREN.items()
            }
            counts["runs"] = conn.execute(PRUNE_RUNS, {"b_ids": ids, "b_cutoff": cutoff}).rowcount
            if counts["runs"] != len(ids):
                # Zero rows for some run: it changed under the lock. None of the batch goes.
                batch.rollback()
                log.warning("retention: a run changed while its batch was pruned; batch undone")
                return {}
            batch.commit()
            return counts

    def prune_blobs(self, after: str, limit: int, grace: float) -> tuple[int, str]:
        """Of the next ``limit`` blobs after digest ``after``, delete those no row
        references, unless stored (or stored again) in the last ``grace`` seconds. The
        reference check is part of the DELETE itself, so a reference committed before it
        keeps the blob; a writer that has just stored the blob and not yet committed its
        reference is protected by ``grace`` (``put_blob`` moves ``created_at`` to now).
        Returns how many were deleted and the last digest looked at ("" at the end)."""
        with self.db.begin(self.tx) as conn:
            digests = pruning.next_blobs(conn, after, limit)
            if not digests:
                return 0, ""
            params = {"b_digests": digests, "b_grace_seconds": grace}
            return conn.execute(PRUNE_BLOBS, params).rowcount, digests[-1]
