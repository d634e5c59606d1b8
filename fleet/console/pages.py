"""The console's list pages (GET): runs (filtered, searched, paged by keyset, live),
the approval inbox, the audit log; and ``handler``, which runs a page's reads on
Starlette's thread pool (fleet's reads are blocking calls)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from fleet.console.live import stream_response
from fleet.console.render import Console, Refused, no_nul, page, path, root
from fleet.durations import parse_duration
from fleet.errors import BadInput
from fleet.states import RunStatus
from fleet.store.browse import RunFilter

FILTERS = ("status", "workflow", "tenant", "since", "until", "q")
PAGE_SIZE = 50
STATUSES = [s.value for s in RunStatus]


def handler(c: Console, fn: Callable[[Console, Request], Response]) -> Callable[..., Any]:
    """An endpoint running ``fn(console, request)`` off the event loop."""

    async def endpoint(request: Request) -> Response:
        checked(request)
        return await run_in_threadpool(fn, c, request)

    endpoint.__name__ = fn.__name__
    return endpoint


def checked(request: Request) -> None:
    """A request's path segments and query parameters, refused (400) if any holds a
    NUL byte."""
    no_nul(request.path_params, "path segment")
    no_nul(request.query_params, "query parameter")


def _moment(text: str, name: str) -> tuple[str, float]:
    """``2h`` as ``("ago", 7200.0)`` (that long before the store's clock says now) or
    an ISO date/time (UTC unless it says) as ``("at", timestamp)``."""
    if text[:1].isdigit() and text[-1:].isalpha() and "-" not in text:
        try:
            return "ago", parse_duration(text, name)
        except BadInput:
            pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise Refused(
            400, f"{name} {text!r} is neither a duration (like 2h or 3d) nor an ISO date"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return "at", moment.timestamp()


def runs_key(params: Mapping[str, str]) -> tuple[tuple[str, Any], ...]:
    """The runs list's filters from a query string, checked and normalised: only the
    list's own parameters, stripped, empty ones left out, ``since``/``until`` as what
    they mean (``1h`` and ``60m`` alike). Two query strings showing the same list have
    the same key (the live list's watcher is shared by it)."""
    found: list[tuple[str, Any]] = []
    for name in FILTERS:
        value: Any = params.get(name, "").strip()
        if not value:
            continue
        if name == "status" and value not in STATUSES:
            raise Refused(400, f"unknown status {value!r} (one of: {', '.join(RunStatus)})")
        if name in ("since", "until"):
            value = _moment(value, name)
        found.append((name, value))
    return tuple(found)


def runs_filters(c: Console, key: tuple[tuple[str, Any], ...]) -> RunFilter:
    """The ``RunFilter`` of a ``runs_key``, for ``Browse.runs_page`` and
    ``Browse.runs_fingerprint`` (a page of ``PAGE_SIZE``); "ago" is measured on the
    store's clock, now."""
    found = dict(key)
    for name in ("since", "until"):
        if name in found:
            kind, value = found[name]
            found[name] = c.browse.now() - value if kind == "ago" else value
    return RunFilter(**found)


def runs_rows(c: Console, filters: RunFilter, root: str) -> str:
    """The runs table's body for these filters (what the live list sends)."""
    return c.fragment("runs_rows.html", rows=_page(c, filters, None).rows, root=root)


def _page(c: Console, filters: RunFilter, after: str | None) -> Any:
    try:
        return c.browse.runs_page(filters, after, PAGE_SIZE)
    except BadInput as exc:  # a cursor from elsewhere
        raise Refused(400, str(exc)) from None


def runs(c: Console, request: Request) -> Response:
    params = request.query_params
    raw = {name: params.get(name, "") for name in FILTERS}
    try:
        filters = runs_filters(c, runs_key(params))
    except Refused as exc:
        return page(
            c,
            request,
            "runs.html",
            400,
            error=exc.line,
            raw=raw,
            rows=[],
            next_href=None,
            events=None,
            statuses=STATUSES,
        )
    q = filters.q
    if q and c.fleet.runtime.queries.run(q) is not None:
        return RedirectResponse(f"{root(request)}/runs/{path(q)}", 303)
    after = params.get("after") or None
    found = _page(c, filters, after)
    query = {k: v for k, v in raw.items() if v}
    next_href = None
    if found.next:
        next_href = "/runs?" + urlencode({**query, "after": found.next})
    return page(
        c,
        request,
        "runs.html",
        raw=raw,
        rows=found.rows,
        next_href=next_href,
        # Only the first page is live: a later page is a fixed window of older runs.
        events=None if after else "/events/runs?" + urlencode(query),
        statuses=STATUSES,
    )


def inbox(c: Console, request: Request) -> Response:
    return page(c, request, "inbox.html", waits=c.browse.waiting_on_signal())


def audit(c: Console, request: Request) -> Response:
    return page(c, request, "audit.html", rows=c.browse.audit(limit=200))


def positive(text: str, name: str, default: float | None = None) -> float | None:
    """A positive finite number from a form field (empty: ``default``)."""
    if not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise Refused(400, f"{name} {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise Refused(400, f"{name} must be a positive number, got {text!r}")
    return value


def runs_events(c: Console) -> Callable[[Request], Any]:
    """``/events/runs?<filters>``: the runs table's body, as the listed runs change."""

    async def endpoint(request: Request) -> Response:
        checked(request)
        normalised = runs_key(request.query_params)
        filters = await run_in_threadpool(runs_filters, c, normalised)
        base = root(request)
        # Keyed by the normalised filters only: a parameter the list does not read, the
        # order or spelling of the ones it does ("1h", "60m") make no watcher of their
        # own; "since=2h" is one list for every watcher (measured from its first).
        key = ("runs", base, normalised)
        return stream_response(
            c.hub.stream(
                key,
                lambda: c.browse.runs_fingerprint(filters, limit=PAGE_SIZE),
                lambda: runs_rows(c, filters, base),
                c.stream_seconds,
            )
        )

    return endpoint
