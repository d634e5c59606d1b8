"""``fleet transcript``: a run's conversation as a person reads it (roles, tool calls
and their results, the step that produced each message, compactions marked), the
model's view of it, its compactions, or any of them as JSON. A thin shell over
``Fleet.transcript``; the views are ``fleet.ops.render_transcript``'s.

Exit codes as everywhere: 0 shown; 2 bad usage (two views at once, a bad name) or an
unknown run, with one line.
"""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.errors import BadInput
from fleet.ops.cli_common import AppOpt, console, guard, open_fleet
from fleet.ops.render import as_json
from fleet.ops.render_transcript import render_compactions, render_transcript, transcript_json
from fleet.transcripts import DEFAULT


def transcript(
    run_id: str,
    name: Annotated[str, typer.Option("--name", help="the transcript's name")] = DEFAULT,
    raw: Annotated[
        bool, typer.Option("--raw", help="every message, compactions marked (the default)")
    ] = False,
    window: Annotated[
        bool, typer.Option("--window", help="the model's view: the summary, then what follows")
    ] = False,
    compactions: Annotated[
        bool, typer.Option("--compactions", help="the compactions: what each covers, its status")
    ] = False,
    json_: Annotated[bool, typer.Option("--json", help="as JSON, nothing clipped")] = False,
    app_: AppOpt = None,
) -> None:
    """A run's transcript: its messages, the model's view, or its compactions.

    --raw (the default): every message, compactions marked; --window: the model's view,
    the summary then what follows; --compactions: what each covers, its status."""

    def body() -> None:
        view = pick_view(raw=raw, window=window, compactions=compactions)
        info = open_fleet(app_).transcript(run_id, name)
        if json_:
            print(as_json(transcript_json(info, view)))
        elif view == "compactions":
            console.print(render_compactions(info))
        else:
            console.print(render_transcript(info, view=view))

    guard(body)


def pick_view(*, raw: bool, window: bool, compactions: bool) -> str:
    """The one view asked for (``raw`` when none is), or one line of bad usage."""
    chosen = [
        flag for flag, on in (("raw", raw), ("window", window), ("compactions", compactions)) if on
    ]
    if len(chosen) > 1:
        raise BadInput(
            f"give at most one of --raw, --window, --compactions (got --{' --'.join(chosen)})"
        )
    return chosen[0] if chosen else "raw"
