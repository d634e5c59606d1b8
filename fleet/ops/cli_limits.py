"""``fleet limits``: each declared limit's use and room now, read from where the
limiter keeps them (Redis when the broker is, else the store): the steps holding a
concurrency slot, the requests and tokens of the last minute, the steps waiting for
room, and how long it stays paused after a provider's 429. A per-tenant limit shows a
row per tenant seen. Reads only.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from fleet.app import Fleet
from fleet.limits import LimitUse
from fleet.ops.cli_common import AppOpt, console, guard, need_app, open_fleet
from fleet.ops.render import as_json
from fleet.worker.gate import uses


def limits(
    json_: Annotated[bool, typer.Option("--json", help="as JSON")] = False,
    app_: AppOpt = None,
) -> None:
    """Each limit's use, room and waiting steps."""

    def body() -> None:
        need_app(app_, "declares the limits with fleet.limit")
        fleet = open_fleet(app_)
        rows = limit_rows(fleet)
        if json_:
            print(as_json(rows))
        else:
            console.print(limits_table(rows))

    guard(body)


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


def limits_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("limit", "running", "requests/min", "tokens/min", "waiting", "paused")
    for r in rows:
        table.add_row(
            Text(r["limit"]),
            _used(r["running"], r["concurrency"]),
            _used(r["requests_last_minute"], r["requests_per_minute"]),
            _used(r["tokens_last_minute"], r["tokens_per_minute"]),
            Text(str(r["waiting"])),
            Text(f"{r['paused_for']:.1f}s" if r["paused_for"] else "-"),
        )
    if not rows:
        table.caption = "no limits declared (fleet.limit)"
    return table


def _used(used: int, bound: int | None) -> Text:
    return Text(f"{used}" if bound is None else f"{used}/{bound}")
