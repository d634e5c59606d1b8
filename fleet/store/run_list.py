"""The run list's statements (``fleet/store/browse.py`` runs them): its filters, its
keyset on ``(created_at, id)`` newest first with an opaque cursor, and the grouped reads
of a page's progress and spend, for that page's runs only. Builds statements; reads
only, and only through ``Browse``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select, tuple_
from sqlalchemy.engine import Connection

from fleet.errors import BadInput
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.store.schema import attempts, runs, steps

MAX_PAGE = 500
# A distinct number per step status: a step that changes status changes their sum.
STATUS_CODE = {status.value: 1 << i for i, status in enumerate(StepStatus)}


def encode_cursor(created_at: float, run_id: str) -> str:
    """The opaque cursor of the page after the run at (created_at, run_id)."""
    raw = json.dumps([created_at, run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(created_at, id) of a cursor, or ``BadInput`` in one line."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, run_id = json.loads(raw)
        if type(created_at) not in (int, float) or not isinstance(run_id, str):
            raise ValueError
        if "\x00" in run_id:  # no run id holds one; Postgres text cannot
            raise ValueError
        return float(created_at), run_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise BadInput(f"page cursor {cursor!r:.80} is not one this console made") from None


@dataclass(frozen=True)
class RunFilter:
    """Which runs a list shows (``Browse.runs_page``, ``Browse.runs_fingerprint``):
    those matching every filter given. ``since`` and ``until`` bound ``created_at``
    (epoch seconds); ``q`` is a run id prefix (and finds child runs too); without
    ``children``, only runs with no parent."""

    status: str | None = None
    workflow: str | None = None
    tenant: str | None = None
    since: float | None = None
    until: float | None = None
    q: str | None = None
    children: bool = False


EVERY_RUN = RunFilter()


def filters(f: RunFilter, bytewise: bool = False) -> list[Any]:
    """The WHERE clauses of the run list's filters; bad values are ``BadInput``. With
    ``bytewise`` (ids sort by code point), an id prefix is a range of the id's index."""
    status, q = f.status, f.q
    where: list[Any] = []
    if status:
        if status not in {s.value for s in RunStatus}:
            raise BadInput(f"unknown status {status!r} (one of: {', '.join(RunStatus)})")
        where.append(runs.c.status == status)
    if f.workflow:
        where.append(runs.c.workflow == f.workflow)
    if f.tenant:
        where.append(runs.c.tenant == f.tenant)
    if f.since is not None:
        where.append(runs.c.created_at >= f.since)
    if f.until is not None:
        where.append(runs.c.created_at < f.until)
    if q:
        where.append(runs.c.id.startswith(q, autoescape=True))
        if bytewise and ord(q[-1]) < 0xD7FF:
            where += [runs.c.id >= q, runs.c.id < q[:-1] + chr(ord(q[-1]) + 1)]
    if not f.children and not q:  # a child's id is found by the search box all the same
        where.append(runs.c.parent_id.is_(None))
    return where


# The run list's columns, in RunListRow's order.
LISTED = [
    runs.c[name]
    for name in ("id", "workflow", "version", "tenant", "status")
    + ("created_at", "updated_at", "finished_at", "parent_id")
]


def listed(where: list[Any], after: str | None, limit: int, *columns: Any, more: int = 0) -> Any:
    """The list's page as a statement: ``columns`` of runs matching ``where``, newest
    first, after the cursor, at most ``limit`` (and ``more``: to see if a next is)."""
    if not 0 < limit <= MAX_PAGE:
        raise BadInput(f"limit must be 1-{MAX_PAGE}, got {limit}")
    stmt = select(*columns).where(*where)
    if after is not None:
        created_at, run_id = decode_cursor(after)
        stmt = stmt.where(tuple_(runs.c.created_at, runs.c.id) < tuple_(created_at, run_id))
    return stmt.order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit + more)


def step_marks() -> list[Any]:
    """Aggregates over a run's steps that change whenever one of them does: how many,
    leases taken (epochs), attempts, status (each status its own code), last finish."""
    code = case(STATUS_CODE, value=steps.c.status, else_=0)
    return [
        func.count(steps.c.step_id),
        func.coalesce(func.sum(steps.c.epoch), 0),
        func.coalesce(func.sum(steps.c.attempts), 0),
        func.coalesce(func.sum(code), 0),
        func.max(steps.c.finished_at),
    ]


def progress(conn: Connection, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per run of ``ids``: (task steps finished, task steps recorded). One query."""
    if not ids:
        return {}
    finished = func.sum(case((steps.c.status.in_([StepStatus.DONE, StepStatus.DEAD]), 1), else_=0))
    stmt = (
        select(steps.c.run_id, finished, func.count())
        .where(steps.c.run_id.in_(list(ids)), steps.c.kind == StepKind.TASK)
        .group_by(steps.c.run_id)
    )
    return {r: (int(d or 0), int(n)) for r, d, n in conn.execute(stmt).all()}


def spend(conn: Connection, ids: Sequence[str]) -> dict[str, tuple[int, float]]:
    """Per run of ``ids``: (tokens, cost) of its attempts and its descendants' (found
    through parent_id, as ``Fleet.usage`` does). One query."""
    if not ids:
        return {}
    family = (
        select(runs.c.id.label("root"), runs.c.id.label("id"))
        .where(runs.c.id.in_(list(ids)))
        .cte("family", recursive=True)
    )
    family = family.union_all(
        select(family.c.root, runs.c.id).where(runs.c.parent_id == family.c.id)
    )
    # Summed per run by a correlated subquery (an index range of its attempts each), not
    # joined: Postgres cannot size a recursive CTE and would hash the whole attempts table.
    mine = attempts.c.run_id == family.c.id
    tokens = select(func.sum(attempts.c.input_tokens + attempts.c.output_tokens)).where(mine)
    cost = select(func.sum(attempts.c.cost)).where(mine)
    each = select(
        family.c.root, tokens.scalar_subquery().label("t"), cost.scalar_subquery().label("c")
    ).subquery("each")
    stmt = select(each.c.root, func.sum(each.c.t), func.sum(each.c.c)).group_by(each.c.root)
    return {r: (int(t or 0), float(c or 0.0)) for r, t, c in conn.execute(stmt).all()}
