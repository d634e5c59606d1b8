"""Live pages: one shared watcher per thing watched asks the store at most once per
interval however many browsers subscribe, renders only when the fingerprint changed,
and stops with its last subscriber; the event streams carry the rendered region."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from fleet import Fleet
from fleet.console import app, live
from fleet.console.live import KEEP_ALIVE_FRAME, Hub, sse
from fleet.store.browse import RunFilter
from tests.console.conftest import AUTH, USER, basic
from tests.console.dom import parse
from tests.harness import InlineBroker

INTERVAL = 0.05


class Store:
    """A stand-in for the store's fingerprint and the region's render, counting calls."""

    def __init__(self) -> None:
        self.mark = "v1"
        self.fingerprints = 0
        self.renders = 0
        self.lock = threading.Lock()

    def fingerprint(self) -> str:
        with self.lock:
            self.fingerprints += 1
            return self.mark

    def render(self) -> str:
        with self.lock:
            self.renders += 1
            return f"<p>{self.mark}</p>"


def browser(console: object) -> httpx.AsyncClient:
    """Signed-in requests straight to the console's ASGI app, several at once."""
    transport = httpx.ASGITransport(app=console)  # type: ignore[arg-type]
    headers = {"Authorization": basic(*USER)}
    return httpx.AsyncClient(transport=transport, base_url="http://console", headers=headers)


def test_many_subscribers_share_one_watcher_polling_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, hub, subscribers, seconds = Store(), Hub(INTERVAL), 25, 1.0
    formatted: list[str] = []

    def counted_sse(html: str) -> str:
        formatted.append(html)
        return sse(html)

    monkeypatch.setattr(live, "sse", counted_sse)

    async def subscriber(seen: list[str]) -> None:
        async for frame in hub.stream("run-1", store.fingerprint, store.render, seconds):
            if frame != KEEP_ALIVE_FRAME:
                seen.append(frame)

    async def scenario() -> list[list[str]]:
        seen: list[list[str]] = [[] for _ in range(subscribers)]
        tasks = [asyncio.create_task(subscriber(s)) for s in seen]
        await asyncio.sleep(seconds / 2)
        assert len(hub.watchers) == 1 and hub.watchers["run-1"].subscribers == subscribers
        store.mark = "v2"
        await asyncio.gather(*tasks)
        return seen

    started = time.monotonic()
    seen = asyncio.run(scenario())
    elapsed = time.monotonic() - started
    assert all(s == [sse("<p>v1</p>"), sse("<p>v2</p>")] for s in seen), seen[0]
    assert store.renders == 2, "rendered once per change, not once per subscriber"
    assert formatted == ["<p>v1</p>", "<p>v2</p>"], "each version formatted once for all"
    # About one fingerprint per interval for all 25 together (25 per interval if each
    # subscriber asked on its own).
    assert store.fingerprints <= elapsed / INTERVAL + 2, (store.fingerprints, elapsed)
    assert store.fingerprints >= 0.5 * seconds / INTERVAL
    assert hub.watchers == {}, "the last subscriber stopped the watcher"


def test_streams_arriving_together_share_one_existence_check_and_a_watched_run_none() -> None:
    hub, checks = Hub(INTERVAL), []

    def exists() -> bool:
        checks.append(1)
        time.sleep(0.05)  # the store's answer takes a while: the others arrive meanwhile
        return True

    async def scenario() -> None:
        assert all(await asyncio.gather(*(hub.admit("run-1", exists) for _ in range(10))))
        assert len(checks) == 1
        store = Store()
        stream = hub.stream("run-1", store.fingerprint, store.render, 0.3)
        assert await anext(stream) == sse("<p>v1</p>")
        assert await hub.admit("run-1", exists), "its watcher runs: no question asked"
        assert len(checks) == 1
        await stream.aclose()
        assert not await hub.admit("gone", lambda: False)

    asyncio.run(scenario())
    assert hub.watchers == {}


def test_the_watcher_stops_asking_once_nobody_watches() -> None:
    store, hub = Store(), Hub(INTERVAL)

    async def scenario() -> None:
        async for _ in hub.stream("k", store.fingerprint, store.render, 0.2):
            pass
        asked = store.fingerprints
        await asyncio.sleep(5 * INTERVAL)
        assert store.fingerprints == asked

    asyncio.run(scenario())
    assert hub.watchers == {}


def test_an_event_carries_every_line_of_the_region() -> None:
    assert sse("<p>a</p>\n<p>b</p>") == "event: update\ndata: <p>a</p>\ndata: <p>b</p>\n\n"
    assert sse("") == ": keep-alive\n\n"


def test_event_streams_send_the_run_region_and_the_runs_rows(
    client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="<live>")
    inline.drain()
    # Long enough for the watcher's first query and render on a loaded CI host (a 0.3 s
    # stream once ended before its first event there): each stream here lasts this long.
    console = app(client, auth=AUTH, live_interval=INTERVAL, stream_seconds=2.0)
    with TestClient(console, headers={"Authorization": basic(*USER)}) as http:
        response = http.get("/events/run", params={"id": "<live>"})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.text.startswith("event: update\n")
        region = "\n".join(
            line.removeprefix("data: ")
            for line in response.text.splitlines()
            if line.startswith("data: ")
        )
        doc = parse(region)
        assert doc.by_id("run-status").text == "waiting"
        assert "<live>" not in response.text
        rows = http.get("/events/runs", params={"status": "waiting"})
        assert 'data-run-id="&lt;live&gt;"' in rows.text
        unknown = http.get("/events/run", params={"id": "nope"})
        assert unknown.status_code == 404
        assert parse(unknown.text).by_id("error").text == "unknown run 'nope'"
        bad = http.get("/events/runs", params={"status": "bogus"})
        assert bad.status_code == 400
    assert console.state.console.hub.watchers == {}


def test_ten_browsers_on_one_run_cost_one_fingerprint_query_per_interval(
    client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="watched")
    inline.drain()
    interval, seconds, browsers = 0.1, 1.0, 10
    console = app(client, auth=AUTH, live_interval=interval, stream_seconds=seconds)
    browse = console.state.console.browse
    asked: list[str] = []
    real = browse.run_fingerprint

    def counted(run_id: str) -> str | None:
        asked.append(run_id)
        return real(run_id)

    browse.run_fingerprint = counted
    queries = client.runtime.queries
    checked: list[str] = []
    real_run = queries.run

    def counted_run(run_id: str) -> object:
        checked.append(run_id)
        return real_run(run_id)

    queries.run = counted_run  # type: ignore[method-assign]

    async def watch_all() -> list[httpx.Response]:
        async with browser(console) as http:
            return await asyncio.gather(
                *(http.get("/events/run", params={"id": "watched"}) for _ in range(browsers))
            )

    started = time.monotonic()
    responses = asyncio.run(watch_all())
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 and 'id="run-status"' in r.text for r in responses)
    assert elapsed < 3 * seconds, "the ten streams were open at the same time"
    # One watcher for the ten: about one query per interval, never one per browser.
    assert 0 < len(asked) <= elapsed / interval + 2, (len(asked), elapsed)
    assert set(asked) == {"watched"}
    # The run is read twice: one check that it exists for the ten browsers, and the
    # region's one render (not ten of each).
    assert checked == ["watched", "watched"], checked


def test_a_fingerprint_is_one_statement(client: Fleet, inline: InlineBroker) -> None:
    from sqlalchemy import event

    client.enqueue("approval", run_id="fp")
    inline.drain()
    browse = app(client, auth=AUTH).state.console.browse
    browse.runs_fingerprint()  # learns the collation once
    sent: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if not statement.startswith("BEGIN"):  # SQLite's own, not a statement sent
            sent.append(statement)

    event.listen(client.runtime.db.engine, "before_cursor_execute", seen)
    try:
        assert browse.run_fingerprint("fp") is not None
        assert browse.runs_fingerprint(RunFilter(status="waiting"))
    finally:
        event.remove(client.runtime.db.engine, "before_cursor_execute", seen)
    assert len(sent) == 2, sent


def test_junk_parameters_do_not_split_the_runs_lists_watcher(
    client: Fleet, inline: InlineBroker
) -> None:
    """Issue 48, item 10: ``/events/runs?x=1`` … ``x=40`` was 40 watchers, each asking
    the store every interval. The watcher is keyed by the list's normalised filters."""
    client.enqueue("approval", run_id="listed")
    inline.drain()
    # Streams long enough for all 44 to be open at once on a loaded host.
    interval, seconds = 0.1, 4.0
    console = app(client, auth=AUTH, live_interval=interval, stream_seconds=seconds)
    hub = console.state.console.hub
    browse = console.state.console.browse
    asked: list[object] = []
    real = browse.runs_fingerprint

    def counted(*args: object, **kwargs: object) -> str:
        asked.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    browse.runs_fingerprint = counted  # type: ignore[method-assign]
    # The same list, written 44 ways: junk parameters, order, spaces, "1h" and "60m".
    queries = [{"status": "waiting", f"x{i}": str(i)} for i in range(40)]
    queries += [
        {"status": " waiting ", "since": "1h"},
        {"since": "60m", "status": "waiting"},
        {"since": "3600s", "status": "waiting", "q": ""},
        {"status": "waiting", "since": "1h", "after": "junk"},
    ]
    watchers: list[int] = []

    async def count_watchers() -> None:
        """The watchers once every stream is open (all subscribed), within the streams."""
        deadline = time.monotonic() + seconds / 2
        while sum(w.subscribers for w in list(hub.watchers.values())) < len(queries):
            assert time.monotonic() < deadline, "the streams did not all open"
            await asyncio.sleep(0.01)
        watchers.append(len(hub.watchers))

    async def watch_all() -> list[httpx.Response]:
        async with browser(console) as http:
            found = await asyncio.gather(
                *(http.get("/events/runs", params=q) for q in queries), count_watchers()
            )
            return [r for r in found if r is not None]

    started = time.monotonic()
    responses = asyncio.run(watch_all())
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 and 'data-run-id="listed"' in r.text for r in responses)
    # Two lists: "waiting", and "waiting since an hour ago" (however it was written).
    assert watchers == [2], watchers
    assert 0 < len(asked) <= 2 * (elapsed / interval + 2), (len(asked), elapsed)
