"""The totals retention keeps of what it deletes (``fleet_pruned_totals``): the figures
the metrics count from rows (attempts by outcome and by duration, incidents by kind,
dead letters, tokens and cost by workflow and model), summed over the rows of the runs
a prune deletes, in the transaction that deletes them.

The rule: a ``_total`` counter never goes back when retention deletes its rows. The
metrics' figures (``Queries.figures``) are the live rows' counts plus these totals, and
a label set once seen stays (at its pruned total) after its last row has gone. Only
``Ledger.prune_trees`` writes here (``add_pruned``, before its deletes); nothing else
deletes a row these figures count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Float, String, bindparam, case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import BindParameter

from fleet.store.rows import Figures
from fleet.store.schema import attempts, dead_letters, incidents, pruned_totals, runs

# The step duration histogram's bucket bounds (seconds): the metrics' buckets, and the
# ones pruned attempts are counted in.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)

# Counter names, and the labels each is kept by (in this order).
ATTEMPTS = "attempts"  # outcome
FINISHED = "attempts_finished"  # (none): attempts with a finish time
SECONDS = "attempt_seconds"  # (none): their durations' sum
WITHIN = "attempts_within"  # le: finished attempts that took at most le seconds
INCIDENTS = "incidents"  # kind
DEAD_LETTERS = "dead_letters"  # (none)
INPUT_TOKENS = "input_tokens"  # workflow, model
OUTPUT_TOKENS = "output_tokens"  # workflow, model
COST = "cost"  # workflow, model
SPEND_COUNTERS = (INPUT_TOKENS, OUTPUT_TOKENS, COST)

Key = tuple[str, tuple[str, ...]]

_IDS: BindParameter[Any] = bindparam("b_ids", expanding=True)


def durations(buckets: Sequence[float], *where: Any) -> Any:
    """Finished attempts (of ``where``): how many took at most each bucket's bound, how
    many there are, and their durations' sum."""
    duration = attempts.c.finished_at - attempts.c.started_at
    return select(
        *[func.coalesce(func.sum(case((duration <= b, 1), else_=0)), 0) for b in buckets],
        func.count(),
        func.coalesce(func.sum(duration), 0.0),
    ).where(attempts.c.finished_at.is_not(None), *where)


def spend(*where: Any) -> Any:
    """Tokens in, out and cost of attempts (of ``where``), by the run's workflow and the
    attempt's model."""
    return (
        select(
            runs.c.workflow,
            attempts.c.model,
            func.sum(attempts.c.input_tokens),
            func.sum(attempts.c.output_tokens),
            func.sum(attempts.c.cost),
        )
        .where(runs.c.id == attempts.c.run_id, *where)
        .group_by(runs.c.workflow, attempts.c.model)
    )


_ATTEMPTS = (
    select(attempts.c.outcome, func.count())
    .where(attempts.c.run_id.in_(_IDS))
    .group_by(attempts.c.outcome)
)
_DURATIONS = durations(DURATION_BUCKETS, attempts.c.run_id.in_(_IDS))
_INCIDENTS = (
    select(incidents.c.kind, func.count())
    .where(incidents.c.run_id.in_(_IDS))
    .group_by(incidents.c.kind)
)
_DEAD_LETTERS = select(func.count()).where(dead_letters.c.run_id.in_(_IDS))
_SPEND = spend(runs.c.id.in_(_IDS))


def _upsert(dialect: Any) -> Any:
    """Insert a total, or add to the one there (an upsert, safe against a racing one)."""
    stmt = dialect.insert(pruned_totals).values(
        counter=bindparam("b_counter", type_=String),
        labels=bindparam("b_labels", type_=String),
        value=bindparam("b_value", type_=Float),
    )
    return stmt.on_conflict_do_update(
        index_elements=[pruned_totals.c.counter, pruned_totals.c.labels],
        set_={"value": pruned_totals.c.value + stmt.excluded.value},
    )


_ADD = {"postgresql": _upsert(postgresql), "sqlite": _upsert(sqlite)}
_ALL = select(pruned_totals.c.counter, pruned_totals.c.labels, pruned_totals.c.value)


def counted(conn: Connection, run_ids: Sequence[str]) -> dict[Key, float]:
    """What the metrics count from the rows of these runs, by counter and labels."""
    found: dict[Key, float] = {}
    ids = {"b_ids": list(run_ids)}
    for outcome, n in conn.execute(_ATTEMPTS, ids).all():
        found[(ATTEMPTS, (str(outcome),))] = n
    *within, n, seconds = conn.execute(_DURATIONS, ids).one()
    if n:
        found[(FINISHED, ())], found[(SECONDS, ())] = n, seconds
        for bound, m in zip(DURATION_BUCKETS, within, strict=True):
            found[(WITHIN, (str(bound),))] = m
    for kind, n in conn.execute(_INCIDENTS, ids).all():
        found[(INCIDENTS, (str(kind),))] = n
    if letters := conn.execute(_DEAD_LETTERS, ids).scalar_one():
        found[(DEAD_LETTERS, ())] = letters
    for workflow, model, tin, tout, cost in conn.execute(_SPEND, ids).all():
        labels = (str(workflow), model or "")
        found[(INPUT_TOKENS, labels)] = tin or 0
        found[(OUTPUT_TOKENS, labels)] = tout or 0
        found[(COST, labels)] = cost or 0.0
    return found


def add_pruned(conn: Connection, run_ids: Sequence[str]) -> None:
    """Add what the metrics count from these runs' rows to the kept totals: called by
    the ledger in the transaction that deletes the rows, before it does. In key order,
    so two prunes at once lock the same rows in the same order."""
    if not run_ids:
        return
    insert = _ADD[conn.dialect.name]
    for (counter, labels), value in sorted(counted(conn, run_ids).items()):
        params = {"b_counter": counter, "b_labels": _encode(labels), "b_value": float(value)}
        conn.execute(insert, params)


def pruned(conn: Connection) -> dict[Key, float]:
    """Every kept total, by counter and labels."""
    return {(c, _decode(labels)): float(v) for c, labels, v in conn.execute(_ALL).all()}


def _encode(labels: tuple[str, ...]) -> str:
    return json.dumps(list(labels), ensure_ascii=False)


def _decode(text: str) -> tuple[str, ...]:
    values: Any = json.loads(text)
    return tuple(str(v) for v in values)


def with_pruned(
    f: Figures,
    buckets: Sequence[float],
    spend: dict[tuple[str, str], tuple[int, int, float]],
    kept: dict[Key, float],
) -> Figures:
    """The live rows' figures ``f`` (``spend``: their tokens in, out and cost by
    workflow and model) with the ``kept`` totals added, for ``Queries.figures``."""
    counts = {ATTEMPTS: dict(f.attempts), INCIDENTS: dict(f.incidents)}
    plain = {DEAD_LETTERS: float(f.dead_letters), FINISHED: float(f.duration_count)}
    plain[SECONDS] = f.duration_sum
    within = dict(zip(buckets, f.duration_buckets, strict=True))
    money = {key: list(row) for key, row in spend.items()}
    for (counter, labels), value in kept.items():
        if counter in counts:
            counts[counter][labels[0]] = counts[counter].get(labels[0], 0) + int(value)
        elif counter in plain:
            plain[counter] += value
        elif counter == WITHIN and float(labels[0]) in within:
            within[float(labels[0])] += int(value)
        elif counter in SPEND_COUNTERS:
            row = money.setdefault((labels[0], labels[1]), [0, 0, 0.0])
            row[SPEND_COUNTERS.index(counter)] += value
    return replace(
        f,
        attempts=counts[ATTEMPTS],
        incidents=counts[INCIDENTS],
        dead_letters=int(plain[DEAD_LETTERS]),
        duration_count=int(plain[FINISHED]),
        duration_sum=plain[SECONDS],
        duration_buckets=[within[b] for b in buckets],
        spend=[(w, m, int(i), int(o), float(c)) for (w, m), (i, o, c) in sorted(money.items())],
    )
