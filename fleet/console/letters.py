"""Dead letters (GET): the list, filtered by workflow and run, with a form to replay
every matching one at a rate; one letter with its error, traceback and input, the
input editable in the page before it is replayed (``/actions/replay``).

The input is edited as the store records it (``fleet.codec``): a secret is its marker
``{"$fleet_secret": "NAME"}``, never its value nor its repr, so it goes back a secret;
an input sent back as it was shown replays the letter as recorded.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fleet import codec
from fleet.bounds import INT32, whole
from fleet.console.render import Console, Refused, page
from fleet.errors import BadInput, PayloadError
from fleet.records import DeadLetterInfo

# The list shows the newest this many (a filter narrows it).
SHOWN = 200


def letter_id(text: str) -> int:
    """A dead letter's id (a positive 32-bit number) from a path or a form; 400 if not."""
    try:
        return whole(text, "dead letter id", low=1, high=INT32)
    except BadInput:
        raise Refused(400, f"dead letter id {text!r:.60} is not a number") from None


def find(c: Console, text: str) -> DeadLetterInfo:
    """The dead letter with id ``text``, or 404."""
    number = letter_id(text)
    row = c.fleet.runtime.queries.dead_letter(number)
    if row is None:
        raise Refused(404, f"unknown dead letter {number}")
    return DeadLetterInfo.from_row(row, c.fleet.runtime.payloads.load)


def recorded(value: Any) -> str:
    """``value`` as the store records it (secrets as their markers), indented."""
    text = codec.encode(value, what="input", limit=sys.maxsize)
    return json.dumps(json.loads(text), indent=2, ensure_ascii=False)


def from_recorded(text: str) -> Any:
    """A value edited as ``recorded`` shows it: JSON (bounded as every form's,
    ``codec.parse_json_arg``) read as the store reads it (markers become secrets)."""
    try:
        codec.parse_json_arg(text, what="input")
        return codec.decode(text)
    except PayloadError as exc:
        raise Refused(400, str(exc)) from None


def unchanged(value: Any, letter: DeadLetterInfo) -> bool:
    """Whether ``value`` is the letter's input as recorded (``1`` is not ``true``)."""
    return letter.input is not None and recorded(value) == recorded(letter.input)


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
    shown = "" if letter.input is None else recorded(letter.input)
    return page(
        c,
        request,
        "dead_letter.html",
        letter=letter,
        input_text=shown,
        title=f"dead letter {letter.id}",
    )
