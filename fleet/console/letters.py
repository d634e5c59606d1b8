"""Dead letters (GET): the list, filtered by workflow and run, with a form to replay
every matching one at a rate; one letter with its error, traceback and input, the
input editable in the page before it is replayed (``/actions/replay``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from fleet.console.render import Console, Refused, page
from fleet.records import DeadLetterInfo

# The list shows the newest this many (a filter narrows it).
SHOWN = 200


def letter_id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 2**31:
        raise Refused(400, f"dead letter id {text!r} is not a number")
    return int(text)


def find(c: Console, text: str) -> DeadLetterInfo:
    """The dead letter with id ``text``, or 404."""
    number = letter_id(text)
    row = c.fleet.runtime.queries.dead_letter(number)
    if row is None:
        raise Refused(404, f"unknown dead letter {number}")
    return DeadLetterInfo.from_row(row, c.fleet.runtime.payloads.load)


def index(c: Console, request: Request) -> Response:
    workflow = request.query_params.get("workflow", "").strip()
    run = request.query_params.get("run", "").strip()
    found = c.browse.dead_letters(run_id=run or None, workflow=workflow or None, limit=SHOWN)
    load = c.fleet.runtime.payloads.load
    return page(
        c,
        request,
        "dead_letters.html",
        letters=[DeadLetterInfo.from_row(r, load) for r in found.rows],
        total=found.total,
        outstanding=found.outstanding,
        workflow=workflow,
        run=run,
    )


def show(c: Console, request: Request) -> Response:
    letter = find(c, request.path_params["letter_id"])
    return page(c, request, "dead_letter.html", letter=letter, title=f"dead letter {letter.id}")
