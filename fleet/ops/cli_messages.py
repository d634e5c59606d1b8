"""``fleet messages``: the broker messages workers refused and set aside (see
fleet.envelope): list them, show one, purge them.

The rule: a dead message is hostile input. Every stored value is printed as plain
text, never as Rich markup (a body may hold ``[/]``), and control characters shown
escaped. Errors are one line and exit 2, as everywhere in the CLI (fleet.cli_common's
guard; fleet/cli.py adds this sub-app).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from fleet.bounds import INT32, whole
from fleet.errors import BadInput
from fleet.ops.cli_common import AppOpt, console, guard
from fleet.ops.loader import load_fleet
from fleet.ops.render import ago, clip, one_line, plain
from fleet.records import DeadMessageInfo

messages_app = typer.Typer(
    help="Broker messages workers refused and set aside: list, show, purge.",
    no_args_is_help=True,
)

# Ids are a 32-bit integer column on Postgres.
MAX_ID = INT32


def messages_table(rows: list[DeadMessageInfo]) -> Table:
    table = Table(title="dead messages")
    for col in ("id", "queue", "set aside", "reason", "message"):
        table.add_column(col, no_wrap=col in ("id", "queue"))
    for m in rows:
        table.add_row(
            str(m.id),
            plain(m.queue),
            ago(m.at),
            plain(one_line(clip(m.reason, 120))),
            plain(one_line(clip(m.body, 80))),
        )
    return table


def decoded_body(raw: str) -> str | None:
    """The body inside a kombu envelope, base64 decoded, if it is one; else None."""
    try:
        envelope = json.loads(raw)
        body = envelope["body"]
        if envelope["properties"]["body_encoding"] != "base64":
            return None
        return base64.b64decode(body, validate=True).decode("utf-8", "backslashreplace")
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        return None


def message_view(m: DeadMessageInfo) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for key, value in (
        ("dead message", str(m.id)),
        ("queue", m.queue),
        ("set aside", ago(m.at)),
        ("reason", m.reason),
    ):
        head.add_row(key, plain(value))
    parts: list[Any] = [head, Text("message (raw, at most 64 KiB):", style="bold"), plain(m.body)]
    body = decoded_body(m.body)
    if body is not None:
        parts += [Text("its body, decoded:", style="bold"), plain(body)]
    return Group(*parts)


@messages_app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="at most this many, newest first")] = 50,
    app_: AppOpt = None,
) -> None:
    """A table of dead messages, newest first."""

    def body() -> None:
        whole(limit, "--limit", low=1, high=INT32)
        fleet = load_fleet(app_)
        rows = fleet.dead_messages(limit=limit)
        console.print(messages_table(rows))

    guard(body)


@messages_app.command("show")
def show(message_id: int, app_: AppOpt = None) -> None:
    """One dead message: its queue, why it was refused, the raw message."""

    def body() -> None:
        if not 0 < message_id <= MAX_ID:
            raise BadInput(f"unknown dead message {message_id}")
        fleet = load_fleet(app_)
        fleet.ensure_schema()
        row = fleet.runtime.queries.dead_message(message_id)
        if row is None:
            raise BadInput(f"unknown dead message {message_id}")
        # soft_wrap: the raw message stays as it was, not cut into lines.
        console.print(message_view(row), soft_wrap=True)

    guard(body)


@messages_app.command("purge")
def purge(
    message_ids: Annotated[list[int] | None, typer.Argument(help="dead message ids")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every dead message")] = False,
    app_: AppOpt = None,
) -> None:
    """Delete dead messages: the ones named, or --all."""

    def body() -> None:
        if all_ == bool(message_ids):
            raise BadInput("give dead message ids, or --all")
        fleet = load_fleet(app_)
        purged = fleet.purge_dead_messages(None if all_ else list(message_ids or []))
        console.print(Text(f"{purged} dead message(s) purged"))

    guard(body)
