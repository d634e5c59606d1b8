"""Transcripts in the store: the statements that append messages and record
compactions (run by the ledger), the reads of them (run by ``Queries``), and a
per-process cache of each transcript's messages.

A message row is written once (an insert that is a no-op on conflict: racing replays
of one run write the same rows) and never updated, so what a process has read of a
transcript can be kept (``fleet/store/message_cache.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, String, bindparam, case, func, select
from sqlalchemy.engine import Connection

from fleet.errors import PayloadError
from fleet.states import StepStatus
from fleet.store.predicates import RUN, now
from fleet.store.schema import blobs, compactions, messages, steps
from fleet.store.transitions import DIALECTS

BLOB = "blob:"  # fleet.store.payloads.BLOB
NAME = bindparam("b_transcript", type_=String)
POS = bindparam("b_pos", type_=Integer)

# --- writes (the ledger's) ------------------------------------------------------------

APPEND = {
    name: dialect.insert(messages)
    .values(
        run_id=RUN,
        transcript=NAME,
        pos=POS,
        body=bindparam("b_body", type_=String),
        step_id=bindparam("b_step", type_=String),
        created_at=now(),
    )
    .on_conflict_do_nothing()
    for name, dialect in DIALECTS.items()
}
COMPACTION = {
    name: dialect.insert(compactions)
    .values(
        run_id=RUN,
        transcript=NAME,
        number=bindparam("b_number", type_=Integer),
        start=bindparam("b_start", type_=Integer),
        upto=bindparam("b_upto", type_=Integer),
        base=bindparam("b_base", type_=Integer),
        step_id=bindparam("b_step", type_=String),
        created_at=now(),
    )
    .on_conflict_do_nothing()
    for name, dialect in DIALECTS.items()
}


@dataclass(frozen=True)
class NewMessage:
    """A message a replay appended past the recorded end of its transcript."""

    transcript: str
    pos: int
    body: str  # inline JSON or a blob reference
    step_id: str | None


@dataclass(frozen=True)
class NewCompaction:
    transcript: str
    number: int
    start: int
    upto: int
    base: int | None
    step_id: str


def message_params(run_id: str, new: Sequence[NewMessage]) -> list[dict[str, Any]]:
    return [
        {
            "b_run": run_id,
            "b_transcript": m.transcript,
            "b_pos": m.pos,
            "b_body": m.body,
            "b_step": m.step_id,
        }
        for m in new
    ]


def compaction_params(run_id: str, new: Sequence[NewCompaction]) -> list[dict[str, Any]]:
    return [
        {
            "b_run": run_id,
            "b_transcript": c.transcript,
            "b_number": c.number,
            "b_start": c.start,
            "b_upto": c.upto,
            "b_base": c.base,
            "b_step": c.step_id,
        }
        for c in new
    ]


# --- reads (Queries') -----------------------------------------------------------------

# A message that is its producing step's output, unchanged, is recorded as this (not
# JSON, so never a message) and read as that output: an agent's replies are stored once.
SAME_AS_OUTPUT = "@output"
_PRODUCER = (steps.c.run_id == messages.c.run_id) & (steps.c.step_id == messages.c.step_id)
BODY = case((messages.c.body == SAME_AS_OUTPUT, steps.c.output), else_=messages.c.body)
_OF = messages.outerjoin(steps, _PRODUCER)

# The step whose output a message is recorded as (None: recorded as itself), so a
# replay can hand that step's output out as a copy of the message it already holds.
OUTPUT_OF = case((messages.c.body == SAME_AS_OUTPUT, messages.c.step_id), else_=None)
MESSAGES_FROM = (
    select(BODY, OUTPUT_OF)
    .select_from(_OF)
    .where(messages.c.run_id == RUN, messages.c.transcript == NAME, messages.c.pos >= POS)
    .order_by(messages.c.pos)
)
BOUNDED = MESSAGES_FROM.where(messages.c.pos < bindparam("b_end", type_=Integer))
WHOLE = (
    select(messages.c.pos, BODY.label("body"), messages.c.step_id, messages.c.created_at)
    .select_from(_OF)
    .where(messages.c.run_id == RUN, messages.c.transcript == NAME)
    .order_by(messages.c.pos)
)
# An operator's paged read (``fleet transcript`` prints a long one as it reads it):
# WHOLE from position b_pos, at most b_limit rows (its length: ``LENGTH``, below).
PAGE_FROM = WHOLE.where(messages.c.pos >= POS).limit(bindparam("b_limit", type_=Integer))
COMPACTIONS = (
    select(
        compactions.c.number,
        compactions.c.start,
        compactions.c.upto,
        compactions.c.base,
        compactions.c.step_id,
        steps.c.status,
        steps.c.output,
        compactions.c.created_at,
    )
    .join(
        steps,
        (steps.c.run_id == compactions.c.run_id) & (steps.c.step_id == compactions.c.step_id),
    )
    .where(compactions.c.run_id == RUN, compactions.c.transcript == NAME)
    .order_by(compactions.c.number)
)
NAMES = select(messages.c.transcript).where(messages.c.run_id == RUN).distinct()

# --- the console's reads (``Browse``): each bounded, an index range ------------------

# Messages before a position, newest first, at most a page (the primary key's range).
PAGE = (
    select(messages.c.pos, BODY.label("body"), messages.c.step_id, messages.c.created_at)
    .select_from(_OF)
    .where(
        messages.c.run_id == RUN,
        messages.c.transcript == NAME,
        messages.c.pos < bindparam("b_before", type_=Integer),
    )
    .order_by(messages.c.pos.desc())
    .limit(bindparam("b_limit", type_=Integer))
)
# Positions are 0, 1, 2…: the length is the last one's, plus one (one index probe).
LENGTH = select(func.coalesce(func.max(messages.c.pos) + 1, 0)).where(
    messages.c.run_id == RUN, messages.c.transcript == NAME
)
COMPACTION_COUNT = select(func.count()).where(
    compactions.c.run_id == RUN, compactions.c.transcript == NAME
)
# The compaction the model's view starts from: the latest whose summary is done.
CURRENT = (
    COMPACTIONS.where(steps.c.status == StepStatus.DONE)
    .order_by(None)
    .order_by(compactions.c.number.desc())
    .limit(1)
)


def names_of(limit: int) -> Any:
    """The first ``limit`` transcript names of run ``b_run``, in order, one index seek
    each (a skip scan: ``NAMES`` reads every message of the run)."""
    of_run = messages.c.run_id == RUN
    first = select(func.min(messages.c.transcript).label("name")).where(of_run)
    names = first.cte("names", recursive=True)
    after = select(func.min(messages.c.transcript)).where(
        of_run, messages.c.transcript > names.c.name
    )
    names = names.union_all(select(after.scalar_subquery()).where(names.c.name.is_not(None)))
    return select(names.c.name).where(names.c.name.is_not(None)).limit(limit)


def resolve_blobs(conn: Connection, bodies: list[str | None]) -> list[str]:
    """Message bodies with each blob reference replaced by the blob's text (one
    statement for all of them; none when no body is a reference): ``with_blobs``."""
    digests = {b[len(BLOB) :] for b in bodies if b is not None and b.startswith(BLOB)}
    if not digests:
        return with_blobs(bodies, {})
    rows = conn.execute(select(blobs.c.digest, blobs.c.body).where(blobs.c.digest.in_(digests)))
    return with_blobs(bodies, {digest: body for digest, body in rows})


def with_blobs(bodies: Sequence[str | None], found: Mapping[str, str]) -> list[str]:
    """Message bodies with each blob reference replaced by its text in ``found``
    (digest → text: the store's, or an exported history's). A body that is None is a
    message recorded as its step's output whose step is gone: refused."""
    if any(b is None for b in bodies):
        raise PayloadError("a message recorded as its step's output has no such output")
    out = []
    for body in bodies:
        assert body is not None
        if body.startswith(BLOB):
            text = found.get(body[len(BLOB) :])
            if text is None:
                raise PayloadError(f"message body {body} is missing from fleet_blobs")
            body = text
        out.append(body)
    return out
