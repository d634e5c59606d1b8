"""The console refuses a browser without credentials, and an action POSTed without the
page's CSRF token, however well signed in: nothing changes."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser, Page, expect
from playwright.sync_api import Error as PlaywrightError

from fleet import Fleet
from tests.browser.conftest import SQLITE_ONLY, USER, Console
from tests.harness import poll


@SQLITE_ONLY
def test_pages_are_refused_without_credentials(
    console: Console, client: Fleet, browser: Browser
) -> None:
    run = client.enqueue("chain", 1)
    pages = [console.url(p) for p in ("/runs", "/inbox", "/dead-letters", "/fleet", "/audit")]
    pages.append(console.run_url(run.id))
    anonymous = browser.new_context()
    guessing = browser.new_context(http_credentials={"username": USER, "password": "guess"})
    try:
        page, wrong = anonymous.new_page(), guessing.new_page()
        for url in pages:
            # With nothing to answer the challenge, Chromium gives up on the page.
            with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(url)
            refused = anonymous.request.get(url)
            assert refused.status == 401, url
            assert refused.headers.get("www-authenticate", "").startswith("Basic realm=")
            assert run.id not in refused.text()

            shown = wrong.goto(url)
            assert shown is not None and shown.status == 401, url
            assert run.id not in wrong.content()
    finally:
        anonymous.close()
        guessing.close()


@SQLITE_ONLY
def test_an_action_without_the_pages_csrf_token_is_refused(
    console: Console, client: Fleet, page: Page
) -> None:
    run = client.enqueue("approval")
    poll(lambda: run.status() == "waiting", 30, "the run to wait for its approval")
    page.goto(console.run_url(run.id))
    token = page.locator("form#cancel input[name=csrf]").input_value()
    assert token
    form = {"run_id": run.id, "why": "forged", "confirm": "yes"}

    for forged in ({}, {"csrf": ""}, {"csrf": "0" * len(token)}):
        response = page.request.post(
            console.url("/actions/cancel"), form={**form, **forged}, max_redirects=0
        )
        assert response.status == 403, (forged, response.status)
        assert "reload the page" in response.text()
        assert run.status() == "waiting", "a refused action changed nothing"

    # The same form with the page's token is the one that acts.
    response = page.request.post(
        console.url("/actions/cancel"), form={**form, "csrf": token}, max_redirects=0
    )
    assert response.status == 303
    assert run.status() == "cancelled"
    page.reload()
    expect(page.locator("#run-status")).to_have_text("cancelled")
