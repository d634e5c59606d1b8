"""What every page of the console shares: the ``Console`` (the fleet, its reads, who
is signed in, the live hub), the Jinja2 environment (autoescape always on: every
value from the store or a user is text, never markup), the formats values are shown
in, and ``Refused``, the one-line refusal a page or an action answers bad input with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined
from starlette.requests import Request
from starlette.responses import HTMLResponse

from fleet.app import Fleet
from fleet.console.auth import Auth
from fleet.durations import ago
from fleet.errors import StoreUnavailable, UnknownRun
from fleet.store.browse import Browse

if TYPE_CHECKING:
    from fleet.console.live import Hub

NAV = [
    ("/runs", "Runs"),
    ("/inbox", "Inbox"),
    ("/dead-letters", "Dead letters"),
    ("/fleet", "Fleet"),
    ("/audit", "Audit"),
]
# What a page shows of a stored value before "…" (the run page shows many).
CLIP = 300
# Every page: only this console's own scripts, styles and forms, never framed, never
# cached (it shows live state and carries a CSRF token).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class Refused(Exception):
    """Bad input to a page or an action: ``status`` and the one line ``#error`` shows."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status
        self.line = line


@dataclass
class Console:
    """One console app's state: the fleet it shows, its read-only store reads, how
    users are known, the live hub and how long an event stream lasts."""

    fleet: Fleet
    auth: Auth
    hub: Hub
    stream_seconds: float

    def __post_init__(self) -> None:
        self.browse = Browse(self.fleet.runtime.db)
        self.env = environment()

    def fragment(self, template: str, **context: Any) -> str:
        """A template rendered on its own (a live region, a table body)."""
        return self.env.get_template(template).render(**context)


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("fleet.console", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        when=when,
        ago=ago,
        clip=clip,
        first_line=first_line,
        pretty=pretty,
        path=path,
        money=money,
        stored=stored,
        role=role,
        said=said,
    )
    env.globals.update(nav=NAV, urlencode=urlencode)
    return env


def page(
    console: Console, request: Request, template: str, status: int = 200, **context: Any
) -> HTMLResponse:
    """A whole page: the layout's nav, the signed-in user, the flash and error lines."""
    user = request.scope["state"]["user"]
    msg = request.query_params.get("msg", "")
    flash = msg if msg and console.auth.signed(msg, request.query_params.get("sig", "")) else ""
    html = console.env.get_template(template).render(
        user=user,
        csrf=console.auth.csrf(user),
        flash=flash,
        error=context.pop("error", ""),
        here=request.url.path,
        root=root(request),
        app=console.fleet.name,
        **context,
    )
    return HTMLResponse(html, status, headers=HEADERS)


def root(request: Request) -> str:
    """Where the console is mounted ("" at the top of its own server)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def refused_page(console: Console, request: Request, exc: Exception) -> HTMLResponse:
    """The page bad input gets: its status and one line naming what was wrong."""
    if isinstance(exc, Refused):
        status, line = exc.status, exc.line
    elif isinstance(exc, UnknownRun):
        status, line = 404, str(exc)
    elif isinstance(exc, StoreUnavailable):
        status, line = 503, str(exc)
    else:
        status, line = 400, str(exc)
    return page(console, request, "refused.html", status, error=first_line(line), title="refused")


def no_nul(fields: Mapping[str, str], what: str) -> None:
    """``Refused`` (400) naming the first of ``fields`` (query parameters, path segments,
    form fields: ``what``) that holds a NUL byte. No text fleet keeps holds one (ids and
    names are printable, Postgres text cannot), so none can match; on Postgres it
    would not even reach the query."""
    for name, value in fields.items():
        if "\x00" in name or "\x00" in value:
            raise Refused(400, f"{what} {name!r} holds a NUL byte")


def flash_query(console: Console, msg: str) -> str:
    """The query string that shows ``msg`` in the next page's ``#flash``."""
    return urlencode({"msg": msg, "sig": console.auth.sign(msg)})


# --- formats ---------------------------------------------------------------------------


def when(ts: float | None) -> str:
    """A stored time (the database's clock, seconds) as UTC."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z"


def clip(text: Any, n: int = CLIP) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= n else s[: n - 1] + "…"


def first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0] if lines else ""


def pretty(value: Any) -> str:
    """A loaded value as indented JSON (what JSON cannot hold shown as its repr)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=repr)


def path(run_id: str) -> str:
    """A run id in a URL path (child ids keep their ``/``)."""
    return quote(run_id, safe="/")


def money(cost: float | None) -> str:
    return f"${cost or 0.0:.4f}"


def stored(text: str | None) -> str:
    """A recorded value as the page shows it: clipped JSON text, or a reference."""
    if text is None:
        return "-"
    if text.startswith("blob:"):
        return f"stored by reference {text.removeprefix('blob:')}"
    return clip(text)


def role(message: Any) -> str:
    return str(message.get("role", "?")) if isinstance(message, dict) else "?"


def said(message: Any) -> str:
    """A transcript message's text, or the whole message as JSON (tool calls)."""
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) and content else pretty(message)
