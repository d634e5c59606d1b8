"""Who may use the console: HTTP basic, a trusted proxy's header, or nobody on loopback
(``--no-auth``); without any of them it refuses to start. Forms carry a per-user CSRF
token; flash lines are signed so a link cannot put words in the page."""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import socket
from collections.abc import Iterator
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
    proxy = ("10.0.0.5", 40000)
    console = app(client, proxy_header="X-Forwarded-User", trusted_proxies="10.0.0.0/24")
    with TestClient(console, client=proxy) as http:
        assert http.get("/runs").status_code == 401
        ok = http.get("/runs", headers={"X-Forwarded-User": "grace@example.com"})
        assert ok.status_code == 200
        assert parse(ok.text).by_id("user").text == "grace@example.com"


def _who(console: object, peer: str, **headers: str) -> str | int:
    """The user the console signs a request from ``peer`` in as, or its status."""
    with TestClient(console, client=(peer, 40000)) as http:  # type: ignore[arg-type]
        response = http.get("/runs", headers=headers)
    if response.status_code != 200:
        return response.status_code
    return parse(response.text).by_id("user").text


def test_the_proxy_header_counts_only_from_a_trusted_proxy(client: Fleet) -> None:
    """Issue 48, item 13: the header signed in anyone who sent it, over basic auth."""
    forged = {"X-Remote-User": "mallory"}
    ada = {"Authorization": basic("ada", "s3cret")}
    listed = app(
        client, auth=AUTH, proxy_header="X-Remote-User", trusted_proxies="10.0.0.5, fd00::/8"
    )
    assert _who(listed, "203.0.113.9", **forged) == 401, "from anyone else: ignored"
    assert _who(listed, "203.0.113.9", **forged, **ada) == "ada", "basic auth, not the header"
    assert _who(listed, "127.0.0.1", **forged) == 401, "loopback is not listed"
    assert _who(listed, "testclient", **forged) == 401, "not an address at all"
    assert _who(listed, "10.0.0.5", **forged, **ada) == "mallory", "the proxy's word wins"
    assert _who(listed, "::ffff:10.0.0.5", **forged) == "mallory", "a dual-stack IPv4 peer"
    assert _who(listed, "fd00::7", **forged) == "mallory"
    assert _who(listed, "10.0.0.6", **forged) == 401
    # Without a list, only a proxy on this host (loopback) is trusted.
    local = app(client, proxy_header="X-Remote-User")
    assert _who(local, "127.0.0.1", **forged) == "mallory"
    assert _who(local, "::1", **forged) == "mallory"
    assert _who(local, "192.0.2.2", **forged) == 401


def test_a_proxy_header_off_loopback_needs_its_trusted_proxies(client: Fleet) -> None:
    from fleet.console.auth import NEEDS_PROXIES

    for host in ("0.0.0.0", "::", "192.0.2.2", "example.com"):
        with pytest.raises(BadInput) as refused:
            app(client, proxy_header="X-Remote-User", host=host)
        assert str(refused.value) == NEEDS_PROXIES.format(host=host)
        assert "FLEET_CONSOLE_TRUSTED_PROXIES" in str(refused.value)
    app(client, proxy_header="X-Remote-User", host="127.0.0.1")
    app(client, proxy_header="X-Remote-User", host="0.0.0.0", trusted_proxies="10.0.0.5")
    app(client, auth=AUTH, host="0.0.0.0")  # no header: nothing to trust
    for bad in ("10.0.0.300", "proxy.internal", "10.0.0.5,,10.0.0.6", "10.0.0.0/33"):
        with pytest.raises(BadInput, match="FLEET_CONSOLE_TRUSTED_PROXIES must be IP"):
            app(client, proxy_header="X-Remote-User", trusted_proxies=bad)
    env = {"FLEET_CONSOLE_PROXY_HEADER": "X-User", "FLEET_CONSOLE_TRUSTED_PROXIES": "10.0.0.5"}
    client.settings = Settings.from_env(env)
    assert client.settings.console_trusted_proxies == "10.0.0.5"
    assert _who(app(client, host="0.0.0.0"), "10.0.0.5", **{"X-User": "grace"}) == "grace"


def _outward_address() -> str | None:
    """This host's address on its way out (not loopback), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if is_loopback(address) else address


@contextlib.contextmanager
def _served_off_loopback(backend: Backend, trusted: str) -> Iterator[tuple[str, str]]:
    """``fleet console --host 0.0.0.0`` with basic auth (ada) and the header
    X-Remote-User trusted from ``trusted`` ("outward": this host's outward address):
    (outward address, port) while it serves."""
    outward = _outward_address()
    if outward is None:
        pytest.skip("this host has no address but loopback")
    env = backend.env(
        FLEET_CONSOLE_AUTH="ada:s3cret",
        FLEET_CONSOLE_PROXY_HEADER="X-Remote-User",
        FLEET_CONSOLE_TRUSTED_PROXIES=outward if trusted == "outward" else trusted,
    )
    argv = ["console", "-A", "tests.flows", "--host", "0.0.0.0", "--port", "0"]
    proc = FleetProcess("console", argv, env, backend.workdir)
    try:
        assert proc.wait_for_output("fleet console: http", 60), proc.output()
        found = re.search(r"fleet console: http://0\.0\.0\.0:(\d+)/", proc.output())
        assert found, proc.output()
        yield outward, found.group(1)
    finally:
        proc.stop()


def test_through_the_real_server_the_header_is_ignored_from_elsewhere(
    backend: Backend, client: Fleet
) -> None:
    with _served_off_loopback(backend, "127.0.0.1") as (outward, port):
        forged = {"X-Remote-User": "mallory"}
        away = httpx.get(f"http://{outward}:{port}/runs", headers=forged)
        assert away.status_code == 401, "mallory, not from the proxy, is not signed in"
        ada = httpx.get(
            f"http://{outward}:{port}/runs",
            headers={**forged, "Authorization": basic("ada", "s3cret")},
        )
        assert ada.status_code == 200 and parse(ada.text).by_id("user").text == "ada"
        proxied = httpx.get(f"http://127.0.0.1:{port}/runs", headers={"X-Remote-User": "grace"})
        assert proxied.status_code == 200 and parse(proxied.text).by_id("user").text == "grace"


def test_through_the_real_server_a_forwarded_for_header_makes_no_one_a_proxy(
    backend: Backend, client: Fleet
) -> None:
    """The proxy is this host's outward address; a local user writes that address into
    X-Forwarded-For. The connection's peer (loopback) decides: not signed in."""
    with _served_off_loopback(backend, "outward") as (outward, port):
        spoofed = {"X-Remote-User": "mallory", "X-Forwarded-For": outward}
        claimed = httpx.get(f"http://127.0.0.1:{port}/runs", headers=spoofed)
        assert claimed.status_code == 401, "the claim is not the peer"
        real = httpx.get(f"http://{outward}:{port}/runs", headers={"X-Remote-User": "grace"})
        assert real.status_code == 200 and parse(real.text).by_id("user").text == "grace"


def test_cli_refuses_a_proxy_header_off_loopback_without_trusted_proxies(
    backend: Backend, client: Fleet
) -> None:
    env = backend.env(FLEET_CONSOLE_PROXY_HEADER="X-Remote-User")
    one_line_error(
        fleet_cli(backend, "console", "-A", "tests.flows", "--host", "0.0.0.0", env=env),
        "FLEET_CONSOLE_TRUSTED_PROXIES",
    )


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
