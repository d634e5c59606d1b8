"""The console in a real browser: Debian's Chromium driven by Playwright (pytest-playwright's
``page``), against ``fleet console`` started as a process beside real workers.

No browser is ever downloaded: Playwright launches ``/usr/bin/chromium`` (``apt-get install
chromium``; ``.ci/run`` installs it). Without it the tests skip on a laptop and fail in CI.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from playwright.sync_api import Browser, BrowserType, Page, Playwright, expect, sync_playwright

from fleet import Fleet
from fleet.testing import FleetProcess
from tests.harness import APP, Backend, Cluster, backend_while

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Nothing of Chromium's own reaches the network (there is none in CI): no first-run
# fetches, component updates, sync, or QUIC probes.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
USER, PASSWORD = "alice", "secret"
CONSOLE_READY = "fleet console: http"
# Every expect() and wait in a browser test: the workers are real processes on a busy machine.
DEADLINE_MS = 20_000
expect.set_options(timeout=DEADLINE_MS)
# For what the browser is shown whatever the store (escaping, auth): the embedded default.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


# A browser test drives the console's pages; what they read and write on each store is
# tested on both by tests/console (in process). Here the flows run on the production
# store, Postgres + Redis, and SQLITE_ONLY ones on the embedded default.
@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield from backend_while(request.param, tmp_path)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# Playwright's sync API keeps an event loop running in this thread while it is started.
# pytest-playwright starts it once per session, so every later test in the same xdist
# worker (an asyncio.run() of the async client's tests) would find a loop running: here
# it lives for one browser test module and is stopped after it.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    pw = sync_playwright().start()
    yield pw
    pw.stop()


@pytest.fixture(scope="module")
def browser_type(playwright: Playwright, browser_name: str) -> BrowserType:
    return getattr(playwright, browser_name)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def browser(
    browser_type: BrowserType, browser_type_launch_args: dict[str, Any]
) -> Iterator[Browser]:
    launched = browser_type.launch(**browser_type_launch_args)
    yield launched
    launched.close()


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """pytest-playwright's launch options, pointed at the system's Chromium."""
    if not Path(CHROMIUM).exists():
        message = f"chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
        if _in_ci():
            pytest.fail(message + " (CI=true: the browser tests are required)", pytrace=False)
        pytest.skip(message)
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_ARGS}


@pytest.fixture(scope="module")
def browser_context_args() -> dict[str, Any]:
    """Every page signs in as alice (HTTP Basic) in a 1280x800 window (the screenshots' size).
    Not built on pytest-playwright's own (session-wide: it would start Playwright for the
    session, see ``playwright``); no device emulation or base URL is used here."""
    return {
        "viewport": {"width": 1280, "height": 800},
        "http_credentials": {"username": USER, "password": PASSWORD},
    }


@pytest.fixture
def page(page: Page) -> Page:
    page.set_default_timeout(DEADLINE_MS)
    return page


@dataclass
class Console:
    """A running ``fleet console``: its base URL and process."""

    base: str
    process: FleetProcess

    def url(self, path: str = "/") -> str:
        return self.base + path.lstrip("/")

    def run_url(self, run_id: str) -> str:
        return self.url(f"runs/{quote(run_id, safe='/')}")

    def run_page(self, run_id: str) -> re.Pattern[str]:
        """The run's page, with or without a query (a flash message after an action)."""
        return re.compile(re.escape(self.run_url(run_id)) + r"(\?.*)?$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_console(backend: Backend, cluster: Cluster, app: str = APP) -> Console:
    """``fleet console`` as a process (killed with the cluster at teardown), once it says
    it is serving. A port taken between choosing and binding it is tried again."""
    for attempt in range(3):
        port = _free_port()
        proc = FleetProcess(
            f"console-{attempt}",
            ["console", "-A", app, "--host", "127.0.0.1", "--port", str(port)],
            backend.env(FLEET_CONSOLE_AUTH=f"{USER}:{PASSWORD}"),
            backend.workdir,
        )
        cluster.procs.append(proc)
        if proc.wait_for_output(CONSOLE_READY, 30):
            return Console(f"http://127.0.0.1:{port}/", proc)
        if "address already in use" not in proc.output().lower():
            break
    pytest.fail(f"fleet console did not start:\n{proc.output()}", pytrace=False)


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture
def console(
    request: pytest.FixtureRequest, backend: Backend, client: Fleet, cluster: Cluster
) -> Iterator[Console]:
    """One worker and the console on the test's backend (schema created by ``client``).
    A failed test shows the console's log (its server errors) in its report."""
    cluster.worker("w1", concurrency=4)
    served = start_console(backend, cluster)
    yield served
    if request.node.stash.get(FAILED, False):
        print(f"--- {served.process.name} log (last 200 lines) ---")
        print("\n".join(served.process.output().splitlines()[-200:]))


def confirm(page: Page, why: str) -> None:
    """The second click of every action: give a reason on the confirmation page, confirm."""
    expect(page.locator("form#confirm")).to_be_visible()
    page.fill("form#confirm textarea[name=why]", why)
    page.click("#confirm-button")
