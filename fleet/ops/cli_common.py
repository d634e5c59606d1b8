"""What every ``fleet`` command shares: the two consoles, the ``-A`` option and the
guard that turns fleet's errors into one line and an exit code (2 bad usage or input,
1 anything else that failed). A module of its own so that sub-apps (``fleet messages``)
use the same ones as ``fleet.cli``, which imports them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from fleet.errors import BadInput, FleetError, StoreUnavailable
from fleet.ops.render import one_line

# Piped output (scripts, CI logs) is not cut to 80 columns: ids must stay whole.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 1000)

AppOpt = Annotated[
    str | None, typer.Option("-A", "--app", help="application module, e.g. myapp.flows")
]
T = TypeVar("T")


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
