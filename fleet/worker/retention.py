"""Retention: finished trees of runs are deleted, with everything of theirs, in bounded
batches.

The rule (``fleet/store/pruning.py``; DESIGN invariant 15, retention never changes a
live run's story): a run goes only with its whole tree (its root and every descendant,
attached or detached, at any depth), and a tree goes only when every run of it finished
(succeeded, failed or cancelled) longer ago than the retention, none of them a failed
run with a dead letter not yet replayed (replaying it resumes the run). With its runs go
their steps, attempts, intents, signals, dead letters, incidents and messages, and then
the blobs nothing references any more. A live run, every run of its tree, and every row
of theirs, are never touched: its children, their spend (which its budget counts) and
its ``fleet status`` stay. What the metrics counted of the deleted rows is kept as
totals (``fleet/store/totals.py``), so no counter goes back.

Batches, not one statement: each batch of whole trees (``batch`` runs, or one larger
tree alone) is one short transaction (the ledger's ``prune_trees``), so a running
fleet's step commits wait for at most one batch, and a prune stopped half way leaves
every tree either whole or gone. ``fleet prune`` walks the roots once; the sweeper,
with ``FLEET_RETENTION`` set, prunes one batch per tick and, once it has caught up,
looks again only every ``RetentionSweep.every`` seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

from fleet.errors import BadInput
from fleet.store.pruning import PruneReads
from fleet.worker.runtime import Runtime

log = logging.getLogger("fleet.retention")

BATCH = 200  # runs per transaction (whole trees): a few thousand rows, tens of milliseconds
SWEEP_BATCH = 100  # runs per sweeper tick (whole trees)
BLOB_BATCH = 500  # blobs per transaction (each checked against every referencing column)
# A blob stored (or stored again) this recently is never deleted: a writer may be about
# to commit the row that references it (see Ledger.prune_blobs).
BLOB_GRACE = 3600.0
# Once caught up, the sweeper looks for newly prunable runs at most this often.
SWEEP_EVERY = 60.0


@dataclass
class PruneResult:
    """What a prune deleted (or, with ``dry_run``, would delete): rows per table, and
    ``kept``, the failed runs old enough but kept for an outstanding dead letter."""

    runs: int = 0
    steps: int = 0
    attempts: int = 0
    intents: int = 0
    signals: int = 0
    dead_letters: int = 0
    incidents: int = 0
    messages: int = 0
    compactions: int = 0
    fanouts: int = 0
    blobs: int = 0
    kept: int = 0
    dry_run: bool = False

    def add(self, counts: dict[str, int]) -> None:
        for name, n in counts.items():
            setattr(self, name, getattr(self, name) + n)

    def counts(self) -> dict[str, int]:
        """Every count, by table name (``dry_run`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dry_run"}


def prune(
    rt: Runtime, finished_before: float, *, dry_run: bool = False, batch: int = BATCH
) -> PruneResult:
    """Delete the trees of runs all finished ``finished_before`` seconds ago or earlier
    (on the store's clock) and everything of theirs, then the blobs nothing references
    any more; with ``dry_run``, count them (the same trees, batch by batch) and delete
    nothing."""
    if not 0 <= finished_before < float("inf"):
        raise BadInput(f"finished_before must be a number of seconds >= 0, got {finished_before}")
    if batch < 1:
        raise BadInput(f"batch must be at least 1, got {batch}")
    reads = PruneReads(rt.db)
    cutoff = rt.queries.now() - finished_before
    result = PruneResult(dry_run=dry_run)
    next_root: str | None = ""
    while next_root is not None:
        trees = reads.prunable_trees(cutoff, next_root, batch)
        if trees.roots and dry_run:
            result.add(reads.tree_counts(trees.roots, cutoff))
        elif trees.roots:
            result.add(rt.ledger.prune_trees(trees.roots, cutoff))
        next_root = trees.after
    after = ""
    while True:
        if dry_run:
            freed, after = reads.blobs_freed(after, BLOB_BATCH, BLOB_GRACE, cutoff)
        else:
            freed, after = rt.ledger.prune_blobs(after, BLOB_BATCH, BLOB_GRACE)
        result.blobs += freed
        if not after:
            break
    result.kept = reads.kept_for_dead_letters(cutoff)
    return result


class RetentionSweep:
    """The sweeper's share of retention, at most one batch per tick: runs while there is
    a backlog, then (after a pass that deleted runs) blobs. Once a pass is over, the next
    one starts ``every`` seconds later: a pass that finds nothing still reads the tables,
    so it must not come every tick."""

    def __init__(self, rt: Runtime, retention: float, batch: int = SWEEP_BATCH) -> None:
        self.rt = rt
        self.retention = retention
        self.batch = batch
        # No point looking more often than a run takes to become prunable.
        self.every = max(min(SWEEP_EVERY, retention), rt.settings.sweep_interval)
        self._reads = PruneReads(rt.db)
        self._runs_after = ""  # cursors: roots and digests up to here were seen this pass
        self._blobs_after: str | None = None  # None: not walking the blobs
        self._pruned = 0  # runs deleted in this pass
        self._next = 0.0  # monotonic time of the next pass

    def tick(self) -> PruneResult | None:
        """One batch of runs or of blobs; None when it is not time for a pass yet."""
        if self._blobs_after is not None:
            return self._blob_batch()
        if time.monotonic() < self._next:
            return None
        cutoff = self.rt.queries.now() - self.retention
        trees = self._reads.prunable_trees(cutoff, self._runs_after, self.batch)
        result = PruneResult()
        if trees.roots:
            result.add(self.rt.ledger.prune_trees(trees.roots, cutoff))
            self._pruned += result.runs
            log.info(
                "retention pruned %d run(s) finished over %.0fs ago (%d steps)",
                result.runs,
                self.retention,
                result.steps,
            )
        if trees.after is not None:
            self._runs_after = trees.after
            return result
        # The pass over the runs is over: walk the blobs if runs went, then rest.
        self._runs_after = ""
        self._next = time.monotonic() + self.every
        if self._pruned:
            self._blobs_after, self._pruned = "", 0
        return result

    def _blob_batch(self) -> PruneResult:
        assert self._blobs_after is not None
        freed, after = self.rt.ledger.prune_blobs(self._blobs_after, BLOB_BATCH, BLOB_GRACE)
        self._blobs_after = after or None
        if freed:
            log.info("retention deleted %d blob(s) nothing references", freed)
        return PruneResult(blobs=freed)
