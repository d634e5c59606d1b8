"""``fleet replay`` and ``fleet export``: a recorded run replayed in this process (no
step body run, nothing written: ``fleet.testing.replay``), and a run's history written
out as one JSON document (``fleet.testing.export``) that ``fleet replay --file`` replays
with no database.

The rule: ``replay`` exits 0 when the code replays the run as recorded (to its end, or
to the steps it stands before), 1 on non-determinism with one line naming the first
step that differs, 2 on bad input (no app, an unknown run, a store missing or
unreachable, a file that is not a history) with one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Annotated, Any

import typer

from fleet import testing
from fleet.errors import BadInput
from fleet.ops.cli_common import AppOpt, console, guard, need_app
from fleet.ops.loader import load_fleet
from fleet.ops.render import as_json, replay_view
from fleet.records import Replay

DatabaseOpt = Annotated[
    str | None,
    typer.Option(help="the store to read (default: the app's, FLEET_DATABASE_URL)"),
]


def replay(
    run_id: Annotated[
        str | None, typer.Argument(help="the run's id (with --file: the file's run)")
    ] = None,
    app_: AppOpt = None,
    database_url: DatabaseOpt = None,
    workflow: Annotated[
        str | None,
        typer.Option(help="replay with this registered workflow, not the run's version"),
    ] = None,
    file: Annotated[
        str | None,
        typer.Option("--file", help="a history fleet export wrote: no database needed"),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="what it reached, as JSON")] = False,
) -> None:
    """Replay a recorded run here: no step body runs, nothing is written.

    Prints where the replay ended (result or error) or the steps it stands before and
    the signal it waits for. Exit 0: the code replays the run as recorded; 1: it does
    not (the first step that differs is named); 2: bad input."""

    def body() -> Replay:
        need_app(app_, "defines the run's workflow")
        if run_id is None and file is None:
            raise BadInput("give the RUN to replay, or --file HISTORY (written by fleet export)")
        if file is not None and database_url is not None:
            raise BadInput("give --file or --database-url, not both: a history needs no store")
        fleet = load_fleet(app_)
        return testing.replay(
            run_id, fleet=fleet, database_url=database_url, workflow=workflow, history=file
        )

    got = guard(body)
    if json_:
        print(as_json(asdict(got)))
    else:
        console.print(replay_view(got))


def export(run_id: str, app_: AppOpt = None, database_url: DatabaseOpt = None) -> None:
    """A run's recorded history as one JSON document: fleet export RUN > run.json.

    The run, its steps, transcripts, signals, child runs' ends and large values, as the
    store keeps them: a secret by its name only. fleet replay --file run.json -A APP
    replays it with no database."""

    def body() -> dict[str, Any]:
        fleet = load_fleet(app_) if app_ else None
        return testing.export(run_id, fleet=fleet, database_url=database_url)

    document = guard(body)
    # UTF-8 whatever the locale: JSON's own encoding (RFC 8259), every string kept as it is.
    text = json.dumps(document, ensure_ascii=False, indent=1)
    sys.stdout.flush()
    sys.stdout.buffer.write(text.encode() + b"\n")
    sys.stdout.buffer.flush()
