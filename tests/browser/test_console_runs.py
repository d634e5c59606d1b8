"""Finding runs and watching them move, in a real browser: the search box leads to the
run page, the run page and the runs list follow a run live (server-sent events, no
reload), and a hostile run id is shown as text."""

from __future__ import annotations

import re

from playwright.sync_api import Dialog, Page, expect

from fleet import Fleet
from tests.browser.conftest import SQLITE_ONLY, Console
from tests.harness import poll


def test_a_run_is_found_by_its_id_from_the_search_box(
    console: Console, client: Fleet, page: Page
) -> None:
    wanted = client.enqueue("chain", 2, tenant="acme")
    others = [client.enqueue("chain", 1, tenant="globex") for _ in range(2)]
    assert wanted.wait(timeout=30) == 1

    page.goto(console.url("/runs"))
    expect(page.locator(f'table#runs tr[data-run-id="{others[0].id}"]')).to_be_visible()

    # The tenant filter keeps acme's one run.
    page.fill("form#filters input[name=tenant]", "acme")
    page.press("form#filters input[name=tenant]", "Enter")
    page.wait_for_url(re.compile(r"[?&]tenant=acme(&|$)"))
    rows = page.locator("table#runs tbody tr[data-run-id]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-run-id", wanted.id)
    page.fill("form#filters input[name=tenant]", "")

    # A prefix narrows the list to the runs whose ids start with it.
    prefix = wanted.id[:10]
    page.fill("form#filters input[name=q]", prefix)
    page.press("form#filters input[name=q]", "Enter")
    page.wait_for_url(re.compile(rf"[?&]q={prefix}(&|$)"))
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-run-id", wanted.id)

    # The whole id leads straight to the run's page.
    page.fill("form#filters input[name=q]", wanted.id)
    page.press("form#filters input[name=q]", "Enter")
    page.wait_for_url(console.run_page(wanted.id))
    expect(page.locator("h1")).to_contain_text(wanted.id)
    expect(page.locator("#run-status")).to_have_text("succeeded")
    expect(page.locator("#run-meta")).to_contain_text("chain")
    expect(page.locator("table#steps tr[data-step-id]")).to_have_count(2)


def test_the_run_page_follows_a_run_live_without_a_reload(
    console: Console, client: Fleet, page: Page
) -> None:
    run = client.enqueue("approval")
    poll(lambda: run.status() == "waiting", 30, "the run to wait for its approval")

    page.goto(console.run_url(run.id))
    expect(page.locator("#run-status")).to_have_text("waiting")
    steps = page.locator("table#steps tr[data-step-id]")
    before = steps.count()
    assert before >= 1, "the first step is done before the wait"
    # A full navigation would drop this: it proves what follows came in place.
    page.evaluate("window.__stayed = true")

    client.signal(run.id, "approval", {"approved": True})

    expect(page.locator("#run-status")).to_have_text("succeeded")
    expect(steps).to_have_count(before + 1)
    assert page.evaluate("window.__stayed === true"), "the page was reloaded"


def test_the_runs_list_shows_a_new_run_and_its_end_without_a_reload(
    console: Console, client: Fleet, page: Page
) -> None:
    page.goto(console.url("/runs"))
    expect(page.locator("table#runs")).to_be_visible()
    page.evaluate("window.__stayed = true")

    run = client.enqueue("chain", 2)

    row = page.locator(f'table#runs tr[data-run-id="{run.id}"]')
    expect(row.locator("td.status")).to_have_text("succeeded")
    assert page.evaluate("window.__stayed === true"), "the page was reloaded"


@SQLITE_ONLY
def test_a_hostile_run_id_is_shown_as_text(console: Console, client: Fleet, page: Page) -> None:
    hostile = "<img src=x onerror=alert(1)>"
    run = client.enqueue("chain", 1, run_id=hostile)
    assert run.wait(timeout=30) == 0
    dialogs: list[str] = []

    def record(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", record)

    # goto returns after the load event, by which time a broken image has fired onerror.
    page.goto(console.url("/runs"))
    row = page.locator(f'table#runs tr[data-run-id="{hostile}"]')
    expect(row).to_have_count(1)
    expect(row).to_contain_text(hostile)
    row.locator("a[href]").first.click()
    expect(page.locator("h1")).to_contain_text(hostile)
    expect(page.locator("#run-status")).to_have_text("succeeded")

    page.goto(console.url("/runs"))
    page.fill("form#filters input[name=q]", hostile)
    page.press("form#filters input[name=q]", "Enter")
    expect(page.locator("h1")).to_contain_text(hostile)

    assert page.locator("img[src=x]").count() == 0
    assert dialogs == [], f"a run id ran as script: {dialogs}"


def test_older_messages_load_in_place_newest_first(
    console: Console, client: Fleet, page: Page
) -> None:
    """Issue 48, item 9: the run page shows a page of its transcript, newest first;
    "load older messages" brings the next page in place (htmx), not a new page."""
    run = client.enqueue("tool_agent", 120, 60)  # 126 messages
    assert run.wait(timeout=60)
    page.goto(console.run_url(run.id))
    listed = page.locator('section.transcript[data-name="main"] ol[reversed] li.message')
    expect(listed).to_have_count(50)
    expect(listed.first).to_have_attribute("value", "125")
    expect(page.locator("table#steps tr[data-step-id=call_read_0]")).to_contain_text("read_note")
    page.evaluate("window.__stayed = true")
    more = page.locator('section.transcript[data-name="main"] li.more a')
    more.click()
    expect(listed).to_have_count(100)
    expect(listed.nth(99)).to_have_attribute("value", "26")
    expect(page.locator("li.marker")).to_contain_text("messages 0–59 summarized")
    more.click()
    expect(listed).to_have_count(126)
    expect(listed.last).to_have_attribute("value", "0")
    expect(more).to_have_count(0)
    assert page.evaluate("window.__stayed === true"), "the page was reloaded"
