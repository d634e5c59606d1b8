"""What every ``fleet`` command shares: the two consoles, the ``-A`` option, the guard
that turns fleet's errors into one line and an exit code (2 bad usage or input, 1
anything else that failed), and the checks of options several commands take. A module
of its own so that every command module (``cli_runs``, ``cli_admin``, ``cli_messages``)
uses the same ones; ``fleet.ops.cli`` assembles them into the ``fleet`` command."""

from __future__ import annotations

import getpass
import math
import os
import sys
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from fleet.app import Fleet
from fleet.errors import BadInput, FleetError, StoreUnavailable
from fleet.ops.loader import load_fleet
from fleet.ops.render import one_line

# Piped output (scripts, CI logs) is not cut to 80 columns: ids must stay whole.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 1000)

AppOpt = Annotated[
    str | None, typer.Option("-A", "--app", help="application module, e.g. myapp.flows")
]
LogLevelOpt = Annotated[str, typer.Option("--loglevel", "-l")]
T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL")


def guard(fn: Callable[[], T]) -> T:
    """Run a command body, turning fleet's errors into one line and an exit code."""
    try:
        return fn()
    except (BadInput, StoreUnavailable) as exc:
        error(exc)
        raise typer.Exit(2) from None
    except FleetError as exc:
        error(exc)
        raise typer.Exit(1) from None


def error(exc: Exception) -> None:
    # The message may quote a run id or an error from the store: text, never markup.
    err.print(Text.assemble(("error:", "red"), " ", one_line(exc)), soft_wrap=True)


def say(*parts: str | tuple[str, str], to: Console = console) -> None:
    """Print a message whose values are literal text (``(text, style)`` for a styled part)."""
    to.print(
        Text.assemble(
            *(one_line(p) if isinstance(p, str) else (one_line(p[0]), p[1]) for p in parts)
        ),
        soft_wrap=True,
    )


def open_fleet(target: str | None, *, schema: bool = True, create: bool = False) -> Fleet:
    """The app's Fleet, its store checked. Only ``create`` (worker, sweeper) may create
    the embedded store; every read and operator command finds it as it is."""
    fleet = load_fleet(target)
    if schema:
        fleet.ensure_schema(create=create)
    return fleet


def need_app(target: str | None, why: str) -> None:
    """``BadInput`` unless ``-A`` named an app: without one, no workflow, step or limit
    is registered, and a command that needs them would say "unknown" or "none"."""
    if not target:
        raise BadInput(f"no app loaded: pass -A APP, the module that {why} (e.g. -A myapp.flows)")


def broker_unreachable(fleet: Fleet) -> str | None:
    """None if the broker answers within a few seconds; otherwise one line saying why.
    Asked once, not retried: an operator's command reports, it does not wait."""
    try:
        with fleet.celery.connection_for_read() as conn:
            conn.ensure_connection(max_retries=0, timeout=3)
    except Exception as exc:  # kombu's OperationalError, or a transport's own error
        return f"broker unreachable ({one_line(exc)})"
    return None


def check_broker(fleet: Fleet) -> None:
    """``BadInput`` if no transport carries ``FLEET_BROKER_URL`` (an unknown scheme, its
    library missing, a malformed address): a worker or sweeper says so before starting.
    The URL itself is not shown: it may hold a password."""
    try:
        with fleet.celery.connection_for_read() as conn:
            conn.get_transport_cls()
    except (KeyError, ImportError, ValueError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise BadInput(f"FLEET_BROKER_URL cannot be used: {one_line(reason)}") from None


def actor() -> str:
    """Who a steering command acts as in the audit: ``cli:<login name>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (OSError, KeyError):  # no login name in the environment or the password file
        return f"cli:uid {os.getuid()}"


# Seconds past this overflow a timer or the platform's clock (about 31 years).
MAX_SECONDS = 1e9


def positive(value: float, option: str, most: float = MAX_SECONDS) -> float:
    """A finite number above zero, at most ``most``, or one line naming the option (NaN
    passes ``<= 0``)."""
    if not math.isfinite(value) or value <= 0 or value > most:
        raise BadInput(f"{option} must be a positive number up to {most:g}, got {value}")
    return value


def check_loglevel(loglevel: str) -> str:
    if loglevel.upper() not in LOG_LEVELS:
        raise BadInput(f"--loglevel {loglevel!r}: one of {', '.join(LOG_LEVELS)}")
    return loglevel
