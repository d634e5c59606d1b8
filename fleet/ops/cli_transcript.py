"""``fleet transcript``: a run's conversation as a person reads it (roles, tool calls
and their results, the step that produced each message, compactions marked), the
model's view of it, its compactions, or any of them as JSON. The views are
``fleet.ops.render_transcript``'s.

The rule: a transcript of any length is printed as it is read, a page of ``PAGE``
messages at a time (``Queries.transcript_head``, then ``transcript_page``), never held
whole; piped, its lines go out as their plain text, unwrapped (Rich's layout of 20,000
messages took seconds).
Exit codes as everywhere: 0 shown; 2 bad usage (two views at once, a bad name) or an
unknown run, with one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.text import Text

from fleet.app import Fleet
from fleet.errors import BadInput
from fleet.ops.cli_common import AppOpt, console, guard, open_fleet
from fleet.ops.render import as_json
from fleet.ops.render_transcript import (
    render_compactions,
    transcript_json,
    transcript_json_text,
    transcript_lines,
)
from fleet.registry import check_name
from fleet.transcripts import DEFAULT, MessageInfo, TranscriptInfo

PAGE = 500  # messages read, laid out and printed at a time


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
        pages = Pages(open_fleet(app_), run_id, name)
        if view == "compactions":
            if json_:
                print(as_json(transcript_json(pages.head, view)))
            else:
                console.print(render_compactions(pages.head, pages.length))
        elif json_:
            emit_text(transcript_json_text(pages.head, view, pages.messages))
        else:
            emit(transcript_lines(pages.head, pages.length, view, pages.messages))

    guard(body)


class Pages:
    """A transcript read a page at a time: ``head`` (its run, name and compactions, no
    message), ``length`` and ``messages(start)``, the messages from position ``start``
    on, each page read as the one before is used. Unknown run: ``UnknownRun``."""

    def __init__(self, fleet: Fleet, run_id: str, name: str) -> None:
        check_name(name, "transcript")
        fleet.run(run_id)  # the run must exist; a name it never wrote to is empty
        self.fleet, self.run_id, self.name = fleet, run_id, name
        comps, self.length = fleet.runtime.queries.transcript_head(run_id, name)
        self.head = self._info([], comps)

    def messages(self, start: int) -> Iterator[MessageInfo]:
        read = self.fleet.runtime.queries.transcript_page
        while True:
            rows = read(self.run_id, self.name, start, PAGE)
            yield from self._info(rows, []).messages
            if len(rows) < PAGE:
                return
            start = rows[-1][0] + 1

    def _info(self, rows: list[Any], comps: list[Any]) -> TranscriptInfo:
        load = self.fleet.runtime.payloads.load
        return TranscriptInfo.from_rows(self.run_id, self.name, rows, comps, load)


def emit(lines: Iterable[Text]) -> None:
    """Print ``lines`` a batch at a time as they are made: through Rich on a terminal
    (styles, wrapping); piped, their plain text (Rich prints no style there), one line
    each as it was made, not wrapped."""
    batch: list[Text] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= PAGE:
            _flush(batch)
    _flush(batch)


def emit_text(pieces: Iterable[str]) -> None:
    """Write ``pieces`` of text a batch at a time as they are made, then a newline."""
    batch: list[str] = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) >= PAGE:
            console.file.write("".join(batch))
            batch.clear()
    console.file.write("".join(batch) + "\n")


def _flush(batch: list[Text]) -> None:
    if console.is_terminal:
        console.print(Group(*batch))
    else:
        console.file.write("".join(line.plain + "\n" for line in batch))
    batch.clear()


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
