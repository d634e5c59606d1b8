"""``fleet.console.app(fleet)``: the console as an ASGI app (Starlette), and the one
table of its routes.

Pages are read-only GETs (``pages``, ``run_page``, ``letters``, ``fleet_view``);
every change is a POST to ``/actions/<verb>`` (``actions``) that asks for
confirmation first; live regions are server-sent events (``live``). Everything is
rendered through Jinja2 with autoescape on (``render``): run ids, errors and payloads
come from users. Bad input of any kind is a ``Refused`` (or fleet's ``BadInput`` /
``UnknownRun``) and becomes a page with one line in ``#error``.
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fleet.app import Fleet
from fleet.console import (
    actions,
    fleet_view,
    letters,
    live,
    pages,
    run_page,
    transcript_view,
)
from fleet.console.auth import Auth, AuthMiddleware
from fleet.console.render import Console, Refused, refused_page, root
from fleet.errors import BadInput, StoreUnavailable, UnknownRun

STATIC = Path(__file__).parent / "static"


def app(
    fleet: Fleet,
    *,
    auth: str | None = None,
    proxy_header: str | None = None,
    trusted_proxies: str | None = None,
    host: str | None = None,
    no_auth: bool = False,
    secret: str | None = None,
    live_interval: float = 1.0,
    stream_seconds: float = 300.0,
) -> Starlette:
    """The operator's console for ``fleet``, to serve (``fleet console``) or mount.

    ``auth`` is ``user:password[,user2:pw2]`` for HTTP basic (default
    ``FLEET_CONSOLE_AUTH``); ``proxy_header`` the header a trusted reverse proxy sets
    to the user (default ``FLEET_CONSOLE_PROXY_HEADER``), taken only from a request
    whose peer address is in ``trusted_proxies`` (IPs or CIDR networks, comma-separated;
    default ``FLEET_CONSOLE_TRUSTED_PROXIES``, else loopback only); ``host``, the
    address the app is served on, if known: off loopback, a proxy header without
    trusted proxies is ``BadInput``. With neither auth nor header, ``no_auth`` must be
    given (everyone is "anonymous"), else ``BadInput``. ``secret`` signs the
    forms (default ``FLEET_CONSOLE_SECRET``, else random per process). Live pages ask
    the store every ``live_interval`` seconds per run or list watched, however many
    browsers watch; an event stream ends after ``stream_seconds`` (browsers reconnect).
    """
    who = Auth.configure(
        fleet.settings,
        auth=auth,
        proxy_header=proxy_header,
        no_auth=no_auth,
        secret=secret,
        trusted_proxies=trusted_proxies,
        host=host,
    )
    console = Console(fleet, who, live.Hub(live_interval), stream_seconds)
    web = Starlette(
        routes=routes(console),
        middleware=[Middleware(AuthMiddleware, auth=who)],
        exception_handlers={
            Refused: _refused,
            UnknownRun: _refused,
            BadInput: _refused,
            StoreUnavailable: _refused,
        },
    )
    web.state.console = console
    return web


def routes(c: Console) -> list[Route | Mount]:
    return [
        Route("/", lambda request: RedirectResponse(f"{root(request)}/runs", 303)),
        Route("/runs", pages.handler(c, pages.runs)),
        Route("/runs/{run_id:path}", pages.handler(c, run_page.show)),
        Route("/transcripts", pages.handler(c, transcript_view.more)),
        Route("/inbox", pages.handler(c, pages.inbox)),
        Route("/dead-letters", pages.handler(c, letters.index)),
        Route("/dead-letters/{letter_id}", pages.handler(c, letters.show)),
        Route("/fleet", pages.handler(c, fleet_view.show)),
        Route("/audit", pages.handler(c, pages.audit)),
        Route("/events/run", run_page.run_events(c)),
        Route("/events/runs", pages.runs_events(c)),
        Route("/actions/{verb}", actions.endpoint(c), methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]


async def _refused(request: Request, exc: Exception) -> Response:
    console: Console = request.app.state.console
    return refused_page(console, request, exc)
