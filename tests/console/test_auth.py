"""Who may use the console: HTTP basic, a trusted proxy's header, or nobody on loopback
(``--no-auth``); without any of them it refuses to start. Forms carry a per-user CSRF
token; flash lines are signed so a link cannot put words in the page."""

from __future__ import annotations

import itertools
import re
import signal
from dataclasses import replace

import httpx
import pytest
from starlette.testclient import TestClient

from fleet import BadInput, Fleet, Settings
from fleet.console import app
from fleet.console.auth import NEEDS_AUTH, is_loopback, parse_users
from fleet.testing import FleetProcess
from tests.console.conftest import AUTH, Web, basic
from tests.console.dom import parse
from tests.e2e.test_cli import fleet_cli, one_line_error
from tests.harness import Backend


def test_the_console_needs_a_way_to_know_its_users(client: Fleet) -> None:
    with pytest.raises(BadInput) as refused:
        app(client)
    assert str(refused.value) == NEEDS_AUTH
    for bad in ("nopassword", "ada:", ":pw", "ada:pw,,bob:pw"):
        with pytest.raises(BadInput, match="FLEET_CONSOLE_AUTH must be user:password"):
            parse_users(bad)
    assert parse_users("ada:pw:with:colons, bob:x") == {"ada": "pw:with:colons", "bob": "x"}
    env = {"FLEET_CONSOLE_AUTH": "eve:pw", "FLEET_CONSOLE_PROXY_HEADER": "X-User"}
    settings = Settings.from_env(env)
    assert (settings.console_auth, settings.console_proxy_header) == ("eve:pw", "X-User")
    assert "eve:pw" not in repr(settings), "a password is never in a repr"
    client.settings = replace(client.settings, console_auth="eve:pw")
    with TestClient(app(client)) as http:
        assert http.get("/runs", headers={"Authorization": basic("eve", "pw")}).status_code == 200


def test_basic_auth(client: Fleet) -> None:
    with TestClient(app(client, auth=AUTH)) as http:
        refused = http.get("/runs")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == 'Basic realm="fleet"'
        for header in (
            basic("ada", "wrong"),
            basic("mallory", "s3cret"),
            basic("ada", "s3cret") + "x",
            "Bearer abc",
        ):
            assert http.get("/runs", headers={"Authorization": header}).status_code == 401
        for user, password in (("ada", "s3cret"), ("bob", "hunter2")):
            ok = http.get("/runs", headers={"Authorization": basic(user, password)})
            assert ok.status_code == 200 and parse(ok.text).by_id("user").text == user
            # Only the console's own scripts run, and it is never framed by another site.
            assert "default-src 'self'" in ok.headers["content-security-policy"]
            assert ok.headers["x-frame-options"] == "DENY"
        # The vendored scripts hold nothing of the fleet's: public, and served locally.
        script = http.get("/static/htmx.min.js")
        assert script.status_code == 200 and "htmx" in script.text[:200]
        assert http.get("/static/sse.min.js").status_code == 200
        assert http.get("/events/run?id=x").status_code == 401
        assert http.post("/actions/cancel", data={"run_id": "x"}).status_code == 401


def test_a_trusted_proxys_header_names_the_user(client: Fleet) -> None:
    with TestClient(app(client, proxy_header="X-Forwarded-User")) as http:
        assert http.get("/runs").status_code == 401
        ok = http.get("/runs", headers={"X-Forwarded-User": "grace@example.com"})
        assert ok.status_code == 200
        assert parse(ok.text).by_id("user").text == "grace@example.com"


def test_no_auth_is_anonymous(client: Fleet) -> None:
    with TestClient(app(client, no_auth=True)) as http:
        assert parse(http.get("/runs").text).by_id("user").text == "anonymous"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_forms_are_signed_per_user_and_flash_lines_per_console(web: Web) -> None:
    auth = web.app.state.console.auth
    assert auth.csrf("ada") != auth.csrf("bob")
    assert parse(web.http.get("/inbox").text).has("main")
    forged = web.page("/runs?msg=your+session+expired,+go+to+evil.example")
    assert not forged.has(id="flash")


def test_cli_refuses_no_auth_off_loopback_and_without_auth(backend: Backend, client: Fleet) -> None:
    one_line_error(
        fleet_cli(backend, "console", "-A", "tests.flows", "--no-auth", "--host", "0.0.0.0"),
        "--no-auth is only allowed on a loopback host",
    )
    one_line_error(fleet_cli(backend, "console", "-A", "tests.flows"), "FLEET_CONSOLE_AUTH")


def test_cli_serves_the_console(backend: Backend, client: Fleet) -> None:
    client.enqueue("approval", run_id="served")
    env = backend.env(FLEET_CONSOLE_AUTH="ada:s3cret")
    proc = FleetProcess(
        "console", ["console", "-A", "tests.flows", "--port", "0"], env, backend.workdir
    )
    try:
        assert proc.wait_for_output("fleet console: http", 60), proc.output()
        found = re.search(r"fleet console: (http://127\.0\.0\.1:\d+/)", proc.output())
        assert found, proc.output()
        url = found.group(1)
        assert httpx.get(url + "runs").status_code == 401
        page = httpx.get(url + "runs", headers={"Authorization": basic("ada", "s3cret")})
        assert page.status_code == 200
        assert parse(page.text).by_id("runs").has("tr", data_run_id="served")
        # A live page's event stream, through the real server; open while it shuts down.
        headers = {"Authorization": basic("ada", "s3cret")}
        with httpx.stream("GET", url + "events/run?id=served", headers=headers) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.iter_lines()
            assert next(lines) == "event: update"
            assert "run-status" in "".join(itertools.islice(lines, 3))
            proc.signal(signal.SIGTERM)
            proc.popen.wait(timeout=15)
    finally:
        proc.stop()
