"""What retention may delete, as SQL: the rule for a prunable tree of runs, the rows
that belong to it, and the blobs they reference. Reads only; the deletes are the
ledger's (``Ledger.prune_trees`` and ``Ledger.prune_blobs``), which re-check these
conditions in their own transaction.

Blobs are collected by a walk over fleet_blobs, not from the rows a prune deleted: a
blob nothing references and not stored for ``grace`` seconds goes, whichever run (or
failed writer) left it behind.

A run is prunable when it has finished (succeeded, failed or cancelled) before the
cutoff, unless it failed with a dead letter not yet replayed: replaying that letter
resumes the run, so it is still actionable and is kept (``fleet dlq list`` shows it). A
succeeded or cancelled run's outstanding dead letters cannot be replayed and go with it.

Runs go by tree, never one by one (DESIGN invariant 15: retention never changes a live
run's story). A tree is a root (a run with no parent, or whose parent is gone) and every
descendant through ``parent_id``, attached or detached, at any depth; it goes only when
every run of it is prunable, and then whole, in one transaction. So a live run keeps
every child it has had (its spend, which its budget counts, and its ``fleet status``),
and no run is left pointing at a deleted parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, exists, func, literal, not_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import CTE

from fleet.states import RunStatus
from fleet.store.engine import Database, db_now
from fleet.store.schema import (
    attempts,
    blobs,
    compactions,
    dead_letters,
    fanouts,
    incidents,
    intents,
    messages,
    runs,
    signals,
    steps,
)

FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
BLOB_PREFIX = "blob:"  # fleet.payloads.BLOB: how a row references a stored blob

# The tables whose rows belong to a run (deleted with it), children before the run row
# (fleet_steps has a foreign key to fleet_runs). Each is found by an index on run_id.
CHILDREN = (
    attempts,
    intents,
    signals,
    dead_letters,
    incidents,
    messages,
    compactions,
    fanouts,
    steps,
)

# Every column that may hold a ``blob:<sha256>`` reference, with its run id column.
BLOB_COLUMNS = (
    (runs.c.args, runs.c.id),
    (runs.c.result, runs.c.id),
    (steps.c.input, steps.c.run_id),
    (steps.c.output, steps.c.run_id),
    (signals.c.payload, signals.c.run_id),
    (dead_letters.c.input, dead_letters.c.run_id),
    (messages.c.body, messages.c.run_id),
)


def outstanding_dead_letter() -> Any:
    """The run (``fleet_runs`` in the enclosing query) has a dead letter not replayed."""
    return exists().where(dead_letters.c.run_id == runs.c.id, dead_letters.c.replayed_at.is_(None))


def prunable(cutoff: float | ColumnElement[float]) -> Any:
    """A ``fleet_runs`` row retention may delete: finished at or before ``cutoff`` (seconds on
    the store's clock), and not a failed run whose dead letter may still be replayed."""
    return and_(
        runs.c.status.in_([s.value for s in FINISHED]),
        runs.c.finished_at <= cutoff,
        or_(runs.c.status != RunStatus.FAILED, not_(outstanding_dead_letter())),
    )


def is_root() -> Any:
    """The run (``fleet_runs`` in the enclosing query) tops its tree: it has no parent,
    or its parent row is gone (pruned alone, before trees were)."""
    parent = runs.alias("parent")
    return or_(runs.c.parent_id.is_(None), not_(exists().where(parent.c.id == runs.c.parent_id)))


def family(roots: Sequence[str] | Any, cutoff: float | ColumnElement[float]) -> CTE:
    """Every run of the trees of ``roots``: (root, id, live), ``live`` 1 for a run not
    prunable at ``cutoff`` (its whole tree stays), else 0. Walked down ``parent_id``
    (indexed) from the roots: a tree is found in a few index reads per run of it. A
    root's parent is null or gone, so no cycle is reachable from one."""
    live = case((prunable(cutoff), 0), else_=1)
    top = (
        select(runs.c.id.label("root"), runs.c.id.label("id"), live.label("live"))
        .where(runs.c.id.in_(roots))
        .cte("family", recursive=True)
    )
    below = select(top.c.root, runs.c.id, live).where(runs.c.parent_id == top.c.id)
    return top.union_all(below)


def tree_sizes(
    conn: Connection, roots: Sequence[str], cutoff: float | ColumnElement[float]
) -> dict[str, tuple[int, int]]:
    """Per root of ``roots``: (runs in its tree, runs of it not prunable at ``cutoff``)."""
    if not roots:
        return {}
    tree = family(list(roots), cutoff)
    stmt = select(tree.c.root, func.count(), func.sum(tree.c.live)).group_by(tree.c.root)
    return {root: (int(n), int(live or 0)) for root, n, live in conn.execute(stmt).all()}


def tree_members(
    conn: Connection, roots: Sequence[str], cutoff: float | ColumnElement[float]
) -> dict[str, list[tuple[str, int]]]:
    """Per root of ``roots``: each run of its tree, with its ``live`` flag (``family``)."""
    if not roots:
        return {}
    tree = family(list(roots), cutoff)
    found: dict[str, list[tuple[str, int]]] = {}
    for root, run_id, live in conn.execute(select(tree.c.root, tree.c.id, tree.c.live)).all():
        found.setdefault(root, []).append((run_id, int(live)))
    return found


@dataclass(frozen=True)
class Trees:
    """A batch of whole trees to prune: their roots and how many runs they hold, and
    the cursor to list the next batch from (None: every root has been looked at)."""

    roots: list[str]
    runs: int
    after: str | None


def next_trees(conn: Connection, cutoff: float, after: str, limit: int) -> Trees:
    """The next batch of prunable trees whose roots' ids are greater than ``after``, in
    id order: whole trees of together at most ``limit`` runs (a tree larger than that
    alone). A root is listed only if it is prunable itself; its tree is taken only if
    every run of it is. The cursor walks the roots once, whatever is kept."""
    stmt = (
        select(runs.c.id)
        .where(prunable(cutoff), is_root(), runs.c.id > after)
        .order_by(runs.c.id)
        .limit(limit)
    )
    listed = list(conn.execute(stmt).scalars())
    sizes = tree_sizes(conn, listed, cutoff)
    roots: list[str] = []
    total = 0
    for root in listed:
        size, live = sizes.get(root, (0, 1))  # not found: gone since it was listed
        if not live:
            if roots and total + size > limit:
                return Trees(roots, total, after)  # this root heads the next batch
            roots.append(root)
            total += size
        after = root
    return Trees(roots, total, after if len(listed) == limit else None)


def blob_reference() -> Any:
    """``'blob:' || fleet_blobs.digest``: how a row refers to the blob of the outer query."""
    return literal(BLOB_PREFIX) + blobs.c.digest


def referenced(spared_cutoff: float | None = None) -> list[Any]:
    """One EXISTS per reference column: some row refers to the blob of the outer query.
    With ``spared_cutoff``, rows of runs prunable at that cutoff do not count (what a
    dry run asks: would the blob still be referenced once they are gone?)."""
    found = []
    for column, run_id in BLOB_COLUMNS:
        where = [column == blob_reference()]
        if spared_cutoff is not None:
            if column.table is runs:
                where.append(not_(prunable(spared_cutoff)))
            else:
                going = select(runs.c.id).where(prunable(spared_cutoff))
                where.append(run_id.not_in(going))
        found.append(exists().where(*where))
    return found


def child_counts(conn: Connection, run_ids: Sequence[str]) -> dict[str, int]:
    """How many rows of each child table belong to these runs."""
    return {
        short_name(table): int(
            conn.execute(
                select(func.count()).select_from(table).where(table.c.run_id.in_(list(run_ids)))
            ).scalar_one()
        )
        for table in CHILDREN
    }


def short_name(table: Any) -> str:
    """``fleet_dead_letters`` → ``dead_letters``: the name a prune result counts it under."""
    return str(table.name).removeprefix("fleet_")


def next_blobs(conn: Connection, after: str, limit: int) -> list[str]:
    """The next ``limit`` blob digests after ``after``: a cursor over fleet_blobs."""
    stmt = select(blobs.c.digest).where(blobs.c.digest > after).order_by(blobs.c.digest)
    return list(conn.execute(stmt.limit(limit)).scalars())


def stale_blob(grace: float | ColumnElement[float]) -> Any:
    """The blob was last stored over ``grace`` seconds ago (``put_blob`` renews it)."""
    return blobs.c.created_at < db_now() - grace


class PruneReads:
    """The reads retention needs; each in its own short transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def prunable_trees(self, cutoff: float, after: str, limit: int) -> Trees:
        """The next batch of whole prunable trees after root ``after`` (``next_trees``)."""
        with self.db.begin(read=True) as conn:
            return next_trees(conn, cutoff, after, limit)

    def tree_counts(self, roots: Sequence[str], cutoff: float) -> dict[str, int]:
        """A dry run's batch: how many runs, and rows of each child table, the trees of
        ``roots`` hold (what ``Ledger.prune_trees`` would delete)."""
        with self.db.begin(read=True) as conn:
            members = tree_members(conn, roots, cutoff)
            ids = [run_id for tree in members.values() for run_id, _ in tree]
            return {"runs": len(ids), **child_counts(conn, ids)}

    def blobs_freed(self, after: str, limit: int, grace: float, cutoff: float) -> tuple[int, str]:
        """A dry run's ``Ledger.prune_blobs``: of the next ``limit`` blobs after digest
        ``after``, how many that one would delete once the runs prunable at ``cutoff`` are
        gone. Returns the count and the last digest looked at ("" when none was left)."""
        with self.db.begin() as conn:
            digests = next_blobs(conn, after, limit)
            if not digests:
                return 0, ""
            freed = conn.execute(
                select(func.count()).where(
                    blobs.c.digest.in_(digests),
                    stale_blob(grace),
                    *[not_(found) for found in referenced(spared_cutoff=cutoff)],
                )
            ).scalar_one()
            return int(freed), digests[-1]

    def kept_for_dead_letters(self, cutoff: float) -> int:
        """Failed runs finished before ``cutoff`` kept for an outstanding dead letter."""
        with self.db.begin() as conn:
            stmt = select(func.count()).where(
                runs.c.status == RunStatus.FAILED,
                runs.c.finished_at <= cutoff,
                outstanding_dead_letter(),
            )
            return int(conn.execute(stmt).scalar_one())
