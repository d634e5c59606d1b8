"""``fleet limits``: each declared limit's use and room now, read from where the
limiter keeps them (Redis when the broker is, else the store): the steps holding a
concurrency slot, the requests and tokens of the last minute, the steps waiting for
room, and how long it stays paused after a provider's 429. A per-tenant limit shows a
row per tenant seen. Reads only.

With the broker's Redis unreachable (where the limiter keeps them), one line says so on
stderr and the table shows what the store knows: each limit's bounds and the steps
holding a live lease under it; the rest is unknown (``-``, null in JSON); exit 1.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

import typer
from redis.exceptions import RedisError
from rich.table import Table
from rich.text import Text

from fleet.app import Fleet
from fleet.limits import LimitUse
from fleet.ops.cli_common import AppOpt, console, err, guard, need_app, open_fleet, say
from fleet.ops.cli_common import broker_unreachable as unreachable
from fleet.ops.render import as_json, one_line
from fleet.store.browse import Browse
from fleet.worker.gate import uses


def limits(
    json_: Annotated[bool, typer.Option("--json", help="as JSON")] = False,
    app_: AppOpt = None,
) -> None:
    """Each limit's use, room and waiting steps."""

    def body() -> int:
        need_app(app_, "declares the limits with fleet.limit")
        fleet = open_fleet(app_)
        down = unreachable(fleet) if fleet.registry.limits else None
        if down is None:
            try:
                rows = limit_rows(fleet)
            except RedisError as exc:  # went down since: said, not retried
                down = f"broker unreachable ({one_line(exc)})"
        if down is not None:
            say(f"{down}: showing what the store knows (bounds, steps holding a lease)", to=err)
            rows = store_rows(fleet)
        if json_:
            print(as_json(rows))
        else:
            console.print(limits_table(rows))
        return 0 if down is None else 1

    raise typer.Exit(guard(body))


def limit_rows(fleet: Fleet) -> list[dict[str, Any]]:
    """One row per limit key: its bounds, use and room (None where it sets no bound)."""
    return [_row(fleet, use) for use in uses(fleet.runtime)]


def _row(fleet: Fleet, use: LimitUse) -> dict[str, Any]:
    limit = fleet.registry.limits[use.key.split("#", 1)[0]]

    def room(bound: int | None, used: int) -> int | None:
        return None if bound is None else max(0, bound - used)

    return {
        "limit": use.key,
        "running": use.running,
        "concurrency": limit.concurrency,
        "concurrency_room": room(limit.concurrency, use.running),
        "requests_last_minute": use.requests,
        "requests_per_minute": limit.requests_per_minute,
        "requests_room": room(limit.requests_per_minute, use.requests),
        "tokens_last_minute": use.tokens,
        "tokens_per_minute": limit.tokens_per_minute,
        "tokens_room": room(limit.tokens_per_minute, use.tokens),
        "waiting": use.waiting,
        "paused_for": round(use.paused_for, 1),
    }


def store_rows(fleet: Fleet) -> list[dict[str, Any]]:
    """Each declared limit's row as the store alone knows it: its bounds, and as running
    the steps holding a live lease that name it (a per-tenant limit: per tenant seen);
    its requests, tokens, waiting steps and pause are kept by the limiter (None)."""
    q, registry = fleet.runtime.queries, fleet.registry
    running: Counter[str] = Counter()
    for worker in Browse(fleet.runtime.db).workers():
        for run_id, step_id, _expires in worker.running:
            run, step = q.run_and_step(run_id, step_id)
            known = registry.steps.get(step.name) if step is not None else None
            for name in known.limits if known is not None and run is not None else ():
                running[registry.limits[name].key(run.tenant if run else None)] += 1
    keys = [n for n, limit in registry.limits.items() if not limit.per_tenant]
    rows = []
    for key in sorted({*keys, *running}):
        limit = registry.limits[key.split("#", 1)[0]]
        row = dict.fromkeys(_row_keys(), None)
        row.update(limit=key, running=running[key], concurrency=limit.concurrency)
        row.update(requests_per_minute=limit.requests_per_minute)
        row.update(tokens_per_minute=limit.tokens_per_minute)
        if limit.concurrency is not None:
            row["concurrency_room"] = max(0, limit.concurrency - running[key])
        rows.append(row)
    return rows


def _row_keys() -> tuple[str, ...]:
    return (
        "limit", "running", "concurrency", "concurrency_room", "requests_last_minute",
        "requests_per_minute", "requests_room", "tokens_last_minute", "tokens_per_minute",
        "tokens_room", "waiting", "paused_for",
    )  # fmt: skip


def limits_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("limit", "running", "requests/min", "tokens/min", "waiting", "paused")
    for r in rows:
        table.add_row(
            Text(r["limit"]),
            _used(r["running"], r["concurrency"]),
            _used(r["requests_last_minute"], r["requests_per_minute"]),
            _used(r["tokens_last_minute"], r["tokens_per_minute"]),
            Text("-" if r["waiting"] is None else str(r["waiting"])),
            Text(f"{r['paused_for']:.1f}s" if r["paused_for"] else "-"),
        )
    if not rows:
        table.caption = "no limits declared (fleet.limit)"
    return table


def _used(used: int | None, bound: int | None) -> Text:
    shown = "-" if used is None else str(used)  # None: unknown, the limiter unreachable
    return Text(shown if bound is None else f"{shown}/{bound}")
