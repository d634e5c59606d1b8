"""Each main page of the console, shown with runs in every state and photographed: the
README's images (``./dev screenshots`` writes them to docs/console/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from fleet import Fleet
from tests.browser.conftest import Console
from tests.browser.screenshots import PAGES, shoot
from tests.harness import poll


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_every_main_page_renders_and_is_photographed(
    console: Console, client: Fleet, page: Page, tmp_path: Path
) -> None:
    done = [
        client.enqueue("chain", 3, run_id=f"report-{i}", tenant=("acme", "globex")[i % 2])
        for i in range(3)
    ]
    waiting = client.enqueue("approval", run_id="refund-approval-7", tenant="acme")
    failed = client.enqueue("counted_fan", 3, [1], False, run_id="import-batch-12")
    busy = client.enqueue("chain", 3, 30.0, run_id="crawl-long", tenant="globex")
    poll(
        lambda: (
            all(r.status() == "succeeded" for r in done)
            and waiting.status() == "waiting"
            and failed.status() == "failed"
            and busy.status() == "running"
        ),
        60,
        "runs in every state",
    )
    (letter,) = client.dead_letters(failed.id)
    shots: list[Path] = []

    page.goto(console.url("/runs"))
    expect(page.locator(f'table#runs tr[data-run-id="{busy.id}"]')).to_be_visible()
    shots.append(shoot(page, "runs", tmp_path))

    page.goto(console.run_url(waiting.id))
    expect(page.locator("#run-status")).to_have_text("waiting")
    expect(page.locator("#waits")).to_contain_text("approval")
    shots.append(shoot(page, "run", tmp_path))

    page.goto(console.url("/inbox"))
    expect(page.locator(f'table#inbox tr[data-run-id="{waiting.id}"]')).to_be_visible()
    shots.append(shoot(page, "inbox", tmp_path))

    page.goto(console.url(f"/dead-letters/{letter.id}"))
    expect(page.locator("form#replay textarea[name=input]")).to_be_visible()
    shots.append(shoot(page, "dead-letter", tmp_path))

    page.goto(console.url("/fleet"))
    expect(page.locator("table#workers")).to_contain_text(busy.id)
    expect(page.locator("table#queues")).to_be_visible()
    shots.append(shoot(page, "fleet", tmp_path))

    assert [p.stem for p in shots] == list(PAGES)
    for path in shots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
