"""An operator's actions, clicked in a real browser: approve a waiting run from the inbox,
replay a dead letter with its input corrected in the page, cancel a run. Each takes two
clicks (the action, then its confirmation), lands on the run's page and is audited."""

from __future__ import annotations

import json
from typing import Any

from playwright.sync_api import Page, expect

from fleet import Fleet
from tests.browser.conftest import USER, Console, confirm
from tests.harness import poll, same


def test_a_waiting_run_is_approved_from_the_inbox_and_finishes(
    console: Console, client: Fleet, page: Page
) -> None:
    run = client.enqueue("approval")
    bystander = client.enqueue("approval")
    poll(
        lambda: run.status() == bystander.status() == "waiting",
        30,
        "both runs to wait for their approval",
    )

    page.goto(console.url("/inbox"))
    row = page.locator(f'table#inbox tr[data-run-id="{run.id}"]')
    expect(row).to_contain_text("approval")
    expect(page.locator(f'table#inbox tr[data-run-id="{bystander.id}"]')).to_be_visible()
    row.locator("form.decide textarea[name=comment]").fill("numbers check out")
    row.locator("form.decide button[name=decision][value=approve]").click()
    confirm(page, "numbers check out")

    page.wait_for_url(console.run_page(run.id))
    expect(page.locator("#flash")).not_to_be_empty()
    expect(page.locator("#run-status")).to_have_text("succeeded")
    expect(page.locator("#audit")).to_contain_text(USER)
    decision = {"approved": True, "by": USER, "comment": "numbers check out"}
    assert same(run.wait(timeout=5), {"decision": decision})
    assert bystander.status() == "waiting", "only the approved run moved"

    page.goto(console.url("/inbox"))
    expect(page.locator(f'table#inbox tr[data-run-id="{bystander.id}"]')).to_be_visible()
    expect(page.locator(f'table#inbox tr[data-run-id="{run.id}"]')).to_have_count(0)


def _without_the_bad_item(text: str) -> str:
    """The letter's input as shown (``[[1, [1]]]`` as its arguments, ``{"args": ...}``
    or the bare list), with item 1 no longer marked bad."""
    shown: Any = json.loads(text)
    args = shown["args"] if isinstance(shown, dict) else shown
    assert same(args, [[1, [1]]]), f"the page shows the step's input: {text}"
    args[0][1] = []
    return json.dumps(shown, indent=2)


def test_a_dead_letter_is_replayed_with_its_input_corrected_in_the_page(
    console: Console, client: Fleet, page: Page
) -> None:
    run = client.enqueue("counted_fan", 3, [1], False)
    poll(lambda: run.status() == "failed", 30, "the run to fail on item 1")
    (letter,) = client.dead_letters(run.id)

    # Why it failed, from its page: the error, the step's traceback.
    page.goto(console.run_url(run.id))
    expect(page.locator("#run-status")).to_have_text("failed")
    expect(page.locator("#error")).to_contain_text("item 1 is bad")
    expect(page.locator("#error pre.traceback").last).to_contain_text("NonRetryable")

    page.goto(console.url("/dead-letters"))
    row = page.locator(f'table#dead-letters tr[data-letter-id="{letter.id}"]')
    expect(row).to_contain_text("item 1 is bad")
    row.locator(f'a[href$="/dead-letters/{letter.id}"]').first.click()

    expect(page.locator("body")).to_contain_text("item 1 is bad")
    editor = page.locator("form#replay textarea[name=input]")
    editor.fill(_without_the_bad_item(editor.input_value()))
    page.click("form#replay button[type=submit]")
    confirm(page, "item 1 was fine after all")

    page.wait_for_url(console.run_page(run.id))
    expect(page.locator("#run-status")).to_have_text("succeeded")
    assert run.wait(timeout=5) == [0, 1, 2]
    (replayed,) = client.dead_letters(run.id, include_replayed=True)
    assert replayed.replayed_at is not None
    expect(page.locator("#audit")).to_contain_text("item 1 was fine after all")


def test_a_run_is_cancelled_from_its_page(console: Console, client: Fleet, page: Page) -> None:
    run = client.enqueue("approval")
    poll(lambda: run.status() == "waiting", 30, "the run to wait for its approval")

    page.goto(console.run_url(run.id))
    expect(page.locator("#run-status")).to_have_text("waiting")
    page.click("form#cancel button[type=submit]")
    # The confirmation changes nothing by itself.
    expect(page.locator("form#confirm")).to_be_visible()
    assert run.status() == "waiting"
    confirm(page, "the customer withdrew the request")

    page.wait_for_url(console.run_page(run.id))
    expect(page.locator("#run-status")).to_have_text("cancelled")
    expect(page.locator("#audit")).to_contain_text("the customer withdrew the request")
    assert run.status() == "cancelled"
    expect(page.locator("form#cancel")).to_have_count(0)
