"""The ``fleet`` command line (Typer + Rich): every command, named in one place.

The commands live by concern: runs in ``cli_runs``, the fleet's processes, schema,
dead letters and retention in ``cli_admin``, set-aside broker messages in
``cli_messages``, a run's conversation in ``cli_transcript``, a run replayed locally
and its history exported in ``cli_replay``; what they share in ``cli_common``. Exit
codes: 0 success; 1 the run or command failed; 2 bad usage or bad input, with one line
naming what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from fleet.errors import BadInput
from fleet.ops import cli_admin, cli_console, cli_limits, cli_replay, cli_runs, cli_transcript
from fleet.ops.cli_common import console, guard
from fleet.ops.cli_messages import messages_app


def demo(
    which: Annotated[
        str, typer.Argument(help="research (the default) or agent: the tool-using notes agent")
    ] = "research",
    keep: Annotated[
        bool, typer.Option(help="keep the state in ./.fleet for fleet runs and fleet status")
    ] = False,
    database_url: Annotated[
        str | None, typer.Option(help="a Postgres URL instead of SQLite")
    ] = None,
    broker_url: Annotated[
        str | None, typer.Option(help="a Redis URL instead of the filesystem")
    ] = None,
) -> None:
    """The research agent end to end: a worker killed mid-run, the run resumed.

    fleet demo agent: the same for a tool-using agent's conversation."""
    code = guard(
        lambda: _demo(which)(console, keep=keep, database_url=database_url, broker_url=broker_url)
    )
    raise typer.Exit(code)


def _demo(which: str) -> Callable[..., int]:
    from fleet.ops.demo import run_demo
    from fleet.ops.demo_agent import run_agent_demo

    demos: dict[str, Callable[..., int]] = {"research": run_demo, "agent": run_agent_demo}
    if which not in demos:
        raise BadInput(f"no demo named {which!r}: try {' or '.join(demos)}")
    return demos[which]


# In the order ``fleet --help`` lists them.
COMMANDS: dict[str, Callable[..., None]] = {
    "demo": demo,
    "worker": cli_admin.worker,
    "sweeper": cli_admin.sweeper,
    "enqueue": cli_runs.enqueue,
    "runs": cli_runs.runs,
    "status": cli_runs.status,
    "watch": cli_runs.watch,
    "transcript": cli_transcript.transcript,
    "replay": cli_replay.replay,
    "export": cli_replay.export,
    "limits": cli_limits.limits,
    "metrics": cli_admin.metrics,
    "console": cli_console.console,
    "signal": cli_runs.signal_,
    "resolve": cli_runs.resolve,
    "cancel": cli_runs.cancel,
    "prune": cli_admin.prune,
}
DB_COMMANDS: dict[str, Callable[..., None]] = {"upgrade": cli_admin.db_upgrade}
DLQ_COMMANDS: dict[str, Callable[..., None]] = {
    "list": cli_admin.dlq_list,
    "show": cli_admin.dlq_show,
    "replay": cli_admin.dlq_replay,
}


def _group(help: str, commands: dict[str, Callable[..., None]]) -> typer.Typer:
    group = typer.Typer(help=help, no_args_is_help=True)
    for name, command in commands.items():
        group.command(name)(command)
    return group


app = typer.Typer(
    help="fleet: durable execution for long, multi-step agent runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(_group("The store's schema.", DB_COMMANDS), name="db")
app.add_typer(_group("Dead-lettered steps: list, show, replay.", DLQ_COMMANDS), name="dlq")
app.add_typer(messages_app, name="messages")
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)


def main(argv: list[str] | None = None) -> Any:
    return app(args=argv)


if __name__ == "__main__":
    main()
