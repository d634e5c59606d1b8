"""The console's pages (GET), on SQLite and Postgres: what each shows, every value
escaped, bad input one line in ``#error`` with a 4xx."""

from __future__ import annotations

import time

import pytest

from fleet import Fleet
from fleet.console import pages
from fleet.errors import BadInput
from tests.console.conftest import Web
from tests.console.dom import Node, parse
from tests.harness import Cluster, InlineBroker, poll

HOSTILE = "<script>alert(1)</script>[bold]"
# A run id cannot hold "/" (those are child runs'): the same attack without it.
HOSTILE_ID = "<script>alert(1)<script>[bold]"


def _nav_and_user(doc: Node) -> None:
    nav = doc.one("nav")
    for href in ("/runs", "/inbox", "/dead-letters", "/fleet", "/audit"):
        assert nav.one("a", href=href)
    assert doc.by_id("user").text == "ada"


def test_runs_list_filters_search_and_pages(
    web: Web, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = client.enqueue("chain", 2, run_id="done-1", tenant="acme")
    inline.drain()
    waiting = client.enqueue("approval", run_id="waits-1")
    inline.drain()
    assert done.status() == "succeeded" and waiting.status() == "waiting"

    assert web.http.get("/", follow_redirects=False).headers["location"] == "/runs"
    doc = web.page("/runs")
    _nav_and_user(doc)
    table = doc.by_id("runs")
    row = table.one("tr", data_run_id="done-1")
    assert row.one("td", class_="status").text == "succeeded"
    assert row.one("a").get("href") == "/runs/done-1"
    assert "2/2" in row.text and "acme" in row.text
    assert table.one("tr", data_run_id="waits-1").one("td", class_="status").text == "waiting"
    assert doc.by_id("filters").has("select", name="status")
    tbody = table.one("tbody")
    assert tbody.get("sse-connect") == "/events/runs?"

    only = web.page("/runs?status=waiting").by_id("runs")
    assert only.has("tr", data_run_id="waits-1") and not only.has("tr", data_run_id="done-1")
    by_tenant = web.page("/runs?tenant=acme").by_id("runs")
    assert [r.get("data-run-id") for r in by_tenant.all("tr") if r.get("data-run-id")] == ["done-1"]
    assert not web.page("/runs?since=2099-01-01").by_id("runs").has("tr", data_run_id="done-1")
    assert web.page("/runs?since=1h").by_id("runs").has("tr", data_run_id="done-1")
    # Search: an exact id goes to the run, a prefix lists what starts with it.
    exact = web.http.get("/runs?q=done-1", follow_redirects=False)
    assert exact.status_code == 303 and exact.headers["location"] == "/runs/done-1"
    prefix = web.page("/runs?q=wait").by_id("runs")
    assert prefix.has("tr", data_run_id="waits-1") and not prefix.has("tr", data_run_id="done-1")

    # Keyset paging: two per page, the third run on the next one.
    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    client.enqueue("approval", run_id="waits-2")
    first = web.page("/runs")
    href = first.by_id("next-page").get("href")
    assert href and "after=" in href
    second = web.page(href)
    listed = {r.get("data-run-id") for r in first.all("tr") + second.all("tr")}
    assert {"done-1", "waits-1", "waits-2"} <= listed
    assert not second.has(id="next-page")


def test_bad_filters_are_one_line_and_400(web: Web) -> None:
    for query, words in (
        ("status=bogus", "unknown status 'bogus'"),
        ("since=yesterday", "since 'yesterday' is neither a duration"),
        ("after=not-a-cursor", "is not one this console made"),
    ):
        response = web.http.get(f"/runs?{query}")
        assert response.status_code == 400, query
        assert words in parse(response.text).by_id("error").text


def test_run_page_shows_steps_attempts_usage_and_nothing_unescaped(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("echo_back", HOSTILE, run_id=HOSTILE_ID)
    inline.drain()
    response = web.http.get("/runs/" + HOSTILE_ID.replace("<", "%3C").replace(">", "%3E"))
    assert response.status_code == 200
    assert "<script>alert" not in response.text and "&lt;script&gt;alert(1)" in response.text
    doc = parse(response.text)
    assert doc.one("h1").text == HOSTILE_ID
    assert doc.by_id("run-status").text == "succeeded"
    assert "echo_back" in doc.by_id("run-meta").text
    assert HOSTILE in doc.by_id("result").text
    steps = doc.by_id("steps")
    row = steps.one("tr", data_step_id="echo#1")
    assert row.one("td", class_="status").text == "done"
    assert HOSTILE in row.text  # its input and output, as text
    # One attempt: its facts are the step's row, no table of attempts under it.
    assert not steps.has("tr", data_attempts_of="echo#1")
    assert "its attempt started" in (row.all("td")[5].get("title") or "")
    assert "saved by resume" in doc.by_id("usage").text
    live = doc.by_id("run-live")
    assert (
        live.get("sse-connect") == "/events/run?id=%3Cscript%3Ealert%281%29%3Cscript%3E%5Bbold%5D"
    )


def test_a_retried_step_lists_its_attempts_under_it(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("retrying", 1, run_id="retried")

    def settled() -> bool:
        # Each waiting message once per look: the retry, delivered before its 0.5 s
        # delay is over, is sent again; draining would deliver it 1,000 times in a row,
        # which a fast host does within the delay.
        for _ in range(len(inline.sent)):
            inline.step()
        return run.status() == "succeeded"

    poll(settled, 30, "the retried run to succeed")
    steps = web.page("/runs/retried").by_id("steps")
    assert steps.one("tr", data_step_id="flaky#1").one("td", class_="status").text == "done"
    attempts = steps.one("tr", data_attempts_of="flaky#1")
    assert [td.text for td in attempts.all("td", class_="outcome")] == ["failed", "done"]
    assert "provider timed out (attempt 1)" in attempts.text


def test_a_failed_run_shows_its_error_and_traceback(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("refusing", run_id="fails")
    inline.drain()
    doc = web.page("/runs/fails")
    assert doc.by_id("run-status").text == "failed"
    error = doc.by_id("error")
    assert "NonRetryable: permission denied" in error.one("p", class_="message").text
    assert "Traceback" in error.one("pre", class_="traceback").text
    assert doc.one("tr", data_step_id="refuse#1").one("td", class_="status").text == "dead"


def test_unknown_run_is_a_404_with_one_line(web: Web) -> None:
    response = web.http.get("/runs/" + "nope%3Cb%3E")
    assert response.status_code == 404
    assert parse(response.text).by_id("error").text == "unknown run 'nope<b>'"
    assert "<b>'" not in response.text


def test_child_runs_are_a_tree_and_their_pages_open(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("brood", 2, run_id="family")
    inline.drain()
    assert client.run("family").status() == "succeeded"
    doc = web.page("/runs/family")
    links = [a.get("href") for a in doc.by_id("children").all("a")]
    assert len(links) == 2 and all(h and h.startswith("/runs/family/") for h in links)
    child = web.page(links[0] or "")
    assert child.one("a", class_="parent").get("href") == "/runs/family"


def test_inbox_lists_runs_waiting_on_a_signal(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id=HOSTILE_ID, tenant="t1")
    client.enqueue("chain", 1, run_id="not-waiting")
    inline.drain()
    doc = web.page("/inbox")
    row = doc.by_id("inbox").one("tr", data_run_id=HOSTILE_ID)
    assert "approval" in row.text and "t1" in row.text
    form = row.one("form", class_="decide")
    assert form.one("input", name="run_id").get("value") == HOSTILE_ID
    assert form.one("input", name="name").get("value") == "approval"
    assert form.one("input", name="wait_id").get("value") == "wait:approval#1"
    assert form.one("input", name="csrf").get("value") == web.csrf
    assert form.has("textarea", name="comment")
    assert form.has("button", name="decision", value="approve")
    assert form.has("button", name="decision", value="reject")
    assert not doc.by_id("inbox").has("tr", data_run_id="not-waiting")
    run = web.page("/runs/" + HOSTILE_ID.replace("<", "%3C").replace(">", "%3E"))
    assert "approval" in run.by_id("waits").text


def test_dead_letters_list_and_page(web: Web, client: Fleet, inline: InlineBroker) -> None:
    client.enqueue("refusing", run_id="dl-run")
    inline.drain()
    (letter,) = client.dead_letters()
    doc = web.page("/dead-letters")
    row = doc.by_id("dead-letters").one("tr", data_letter_id=str(letter.id))
    assert "dl-run" in row.text and "refuse#1" in row.text and "permission denied" in row.text
    assert row.one("td", class_="replayed").text == "no"
    assert doc.by_id("replay-all").has("input", name="rate")
    assert web.page("/dead-letters?workflow=other").by_id("dead-letters").has("tr", class_="empty")
    assert (
        web.page("/dead-letters?run=dl-run")
        .by_id("dead-letters")
        .has("tr", data_letter_id=str(letter.id))
    )

    page = web.page(f"/dead-letters/{letter.id}")
    assert "NonRetryable" in page.one("span", class_="error-type").text
    assert "Traceback" in page.one("pre", class_="traceback").text
    form = page.by_id("replay")
    assert form.get("action") == "/actions/replay"
    assert '"permission denied"' in form.one("textarea", name="input").text
    assert web.http.get("/dead-letters/999").status_code == 404
    bad = web.http.get("/dead-letters/x1")
    assert bad.status_code == 400 and "is not a number" in parse(bad.text).by_id("error").text


def test_dead_letters_list_shows_the_newest_and_counts_the_rest(
    web: Web, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleet.console import letters

    for i in range(3):
        client.enqueue("refusing", run_id=f"dl-{i}")
        inline.drain()
    ids = [d.id for d in client.dead_letters()]
    client.replay(ids[0])
    inline.drain()  # it fails again: a fourth letter
    ids = [d.id for d in client.dead_letters(include_replayed=True)]
    monkeypatch.setattr(letters, "SHOWN", 2)
    doc = web.page("/dead-letters")
    listed = [r.get("data-letter-id") for r in doc.by_id("dead-letters").all("tr")]
    newest = sorted(ids, reverse=True)
    assert listed[1:] == [str(i) for i in newest[:2]], "newest first, two of them"
    count = doc.by_id("letters-count").text
    assert count.startswith("4 dead letter(s), 3 not replayed") and "2 more" in count
    narrowed = web.page("/dead-letters?run=dl-1")
    assert narrowed.by_id("letters-count").text == "1 dead letter(s), 1 not replayed."
    with pytest.raises(BadInput, match="limit must be between 1 and 10000, got 0"):
        web.app.state.console.browse.dead_letters(limit=0)


def test_fleet_page_shows_queue_depth_workers_limits_incidents(web: Web, client: Fleet) -> None:
    # Nothing consumes the broker here: the run's wake-up waits on its queue.
    client.enqueue("chain", 1, run_id="queued-1")
    doc = web.page("/fleet")
    queue = client.registry.workflow("chain").queue(client.settings.queue)
    depth = doc.by_id("queues").one("tr", data_queue=queue).one("td", class_="depth").text
    assert depth == "1"
    # Every queue this app's workers consume, a run on it or not; the store is not
    # scanned for them.
    queues = doc.by_id("queues")
    assert [r.get("data-queue") for r in queues.all("tr") if r.get("data-queue")] == sorted(
        client.registry.queues(client.settings.queue)
    )
    idle = client.registry.workflow("refusing").queue(client.settings.queue)
    assert queues.one("tr", data_queue=idle).one("td", class_="depth").text == "0"
    assert doc.by_id("workers").has("tr", class_="empty")
    assert "no limits are declared" in doc.by_id("limits").text
    assert doc.by_id("incidents")
    client.limit("provider<x>", concurrency=2, requests_per_minute=60)
    limits = web.page("/fleet").by_id("limits")
    row = limits.one("tr", data_limit="provider<x>")
    assert "0/2 running" in row.text and "0/60 requests/min" in row.text


def test_audit_page_lists_actions_newest_first(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="a1")
    client.enqueue("approval", run_id="a2")
    inline.drain()
    client.cancel("a1", by="carol", why=HOSTILE)
    client.cancel("a2", by="dave", why="second")
    response = web.http.get("/audit")
    assert "<script>alert" not in response.text
    body = [r for r in parse(response.text).by_id("audit").all("tr") if r.get("data-audit-id")]
    assert [("dave" in r.text, "carol" in r.text) for r in body] == [(True, False), (False, True)]
    assert HOSTILE in body[1].text and "cancel" in body[1].text


def test_mounted_under_a_prefix_every_link_keeps_it(client: Fleet, inline: InlineBroker) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from fleet.console import app
    from tests.console.conftest import AUTH, basic

    client.enqueue("approval", run_id="m1")
    inline.drain()
    console = app(client, auth=AUTH, secret="s")
    outer = Starlette(routes=[Mount("/ops", app=console)])
    with TestClient(outer, headers={"Authorization": basic("ada", "s3cret")}) as http:
        assert http.get("/ops/", follow_redirects=False).headers["location"] == "/ops/runs"
        doc = parse(http.get("/ops/runs").text)
        assert doc.one("nav").one("a", href="/ops/inbox")
        assert doc.by_id("runs").one("tr", data_run_id="m1").one("a").get("href") == "/ops/runs/m1"
        assert http.get("/ops/static/console.css", headers={"Authorization": ""}).status_code == 200
        token = console.state.console.auth.csrf("ada")
        done = http.post(
            "/ops/actions/cancel",
            data={"csrf": token, "run_id": "m1", "confirm": "yes"},
            follow_redirects=False,
        )
        assert done.status_code == 303 and done.headers["location"].startswith("/ops/runs/m1?")
    assert client.run("m1").status() == "cancelled"


def test_incidents_are_counted_per_kind_per_five_minutes() -> None:
    from fleet.console.fleet_view import BUCKET, incident_table

    now = 10_000.0
    start = (now - 3600) // BUCKET * BUCKET
    current = now // BUCKET * BUCKET
    rows = [
        (start, "takeover", 2),
        (start + 2 * BUCKET, "takeover", 1),
        (current, "fenced_write", 4),
    ]
    buckets, kinds = incident_table(rows, now)
    assert buckets[0] == start and buckets[-1] <= now < buckets[-1] + BUCKET
    assert kinds["takeover"][:3] == [2, 0, 1] and sum(kinds["takeover"]) == 3
    assert kinds["fenced_write"][-1] == 4 and list(kinds) == ["fenced_write", "takeover"]


def test_incidents_are_counted_under_the_five_minutes_they_happened_in(
    web: Web, client: Fleet
) -> None:
    """Issue 48, item 20: a takeover at 00:47:27 was counted under 00:40, one at 00:49:00
    and an error at 00:51:16 under 00:45. Incidents recorded at those minutes and
    seconds (of the hour before the store's now) are each under their own bucket."""
    from sqlalchemy import insert

    from fleet.store.schema import incidents

    now = web.app.state.console.browse.now()
    # A quarter hour 20-35 minutes ago, read as 00:45: its first five minutes end at
    # 00:50, which the test's incidents are on either side of.
    q = (now - 1200) // 900 * 900
    at = {
        "takeover": [q + 2 * 60 + 27, q + 4 * 60],  # 00:47:27, 00:49:00
        "fenced_write": [q + 6 * 60 + 16, q + 5 * 60],  # 00:51:16, 00:50:00
        "duplicate_delivery": [q + 9 * 60 + 59.9],  # 00:54:59.9
    }
    with client.runtime.db.begin() as conn:  # written as they were at those times
        for kind, times in at.items():
            for t in times:
                conn.execute(insert(incidents).values(kind=kind, run_id="r", at=t))
    table = web.page("/fleet").by_id("incidents")
    labels = [th.text for th in table.one("thead").all("th")][1:-1]
    found = {}
    for row in table.all("tr"):
        if row.get("data-kind"):
            counts = [int(td.text) for td in row.all("td")[1:-1]]
            found[row.get("data-kind")] = {k: n for k, n in zip(labels, counts, strict=True) if n}
    first, second = (time.strftime("%H:%M", time.gmtime(b)) for b in (q, q + 300))
    assert found == {
        "takeover": {first: 2},
        "fenced_write": {second: 2},
        "duplicate_delivery": {second: 1},
    }, found


def test_an_unreachable_broker_is_one_line_and_the_store_is_still_shown(
    client: Fleet, cluster: Cluster
) -> None:
    """Issue 48, item 6: with the broker away, /fleet answered 500 (the limits' use is
    read from the broker's Redis)."""
    from dataclasses import replace

    from starlette.testclient import TestClient

    from fleet.console import app
    from tests.console.conftest import AUTH, basic

    cluster.worker("w1")
    run = client.enqueue("chain", 2, 30.0, run_id="holding")  # a step that holds its lease
    poll(lambda: any(s.status == "running" for s in run.steps()), 60, "a step to be running")
    away = client.with_settings(replace(client.settings, broker_url="redis://127.0.0.1:1/0"))
    away.limit("provider", concurrency=2)
    with TestClient(
        app(away, auth=AUTH), headers={"Authorization": basic("ada", "s3cret")}
    ) as http:
        response = http.get("/fleet")
    assert response.status_code == 200, response.text[-2000:]
    doc = parse(response.text)
    line = doc.by_id("broker-down").text
    assert line.startswith("the broker is unreachable (") and "\n" not in line, line
    assert "127.0.0.1:1" in line
    depths = {td.text for td in doc.by_id("queues").all("td", class_="depth")}
    assert depths == {"unavailable"}
    assert "unavailable" in doc.by_id("limits").text
    # What the store knows: the worker holding a lease, the incidents table.
    (held,) = [r for r in doc.by_id("workers").all("tr") if r.get("data-worker")]
    assert (held.get("data-worker") or "").startswith("w1:") and "holding" in held.text
    assert doc.by_id("incidents")


def test_a_step_with_a_fenced_or_lost_attempt_is_marked_an_incident() -> None:
    from fleet.console.run_page import step_views
    from fleet.store.rows import AttemptRow, StepRow

    def step(step_id: str) -> StepRow:
        return StepRow(
            "r",
            step_id,
            1,
            "work",
            "task",
            "[]",
            "done",
            "1",
            None,
            2,
            5,
            2,
            None,
            None,
            None,
            None,
            0,
            0.0,
            1.0,
            None,
        )

    def attempt(step_id: str, epoch: int, outcome: str) -> AttemptRow:
        return AttemptRow(
            "r", step_id, epoch, epoch, f"w{epoch}", outcome, None, 0.0, 1.0, None, 1, 10, 5, 0.01
        )

    views = step_views(
        [step("a"), step("b")],
        [attempt("a", 1, "lost"), attempt("a", 2, "done"), attempt("b", 1, "done")],
    )
    assert [(v.row.step_id, v.incident, v.workers, v.tokens) for v in views] == [
        ("a", True, ["w1", "w2"], 30),
        ("b", False, ["w1"], 15),
    ]
    assert views[0].retries == 1 and views[0].duration == 1.0
