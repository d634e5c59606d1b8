"""The console's server tests: a ``web`` client signed in as "ada" (HTTP basic) to the
console of the test's ``client`` Fleet, on SQLite and on Postgres (``backend``)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from fleet import Fleet
from fleet.console import app
from tests.console.dom import Node, parse

AUTH = "ada:s3cret,bob:hunter2"
USER = ("ada", "s3cret")


@dataclass
class Web:
    """A signed-in browser, without the browser: pages as trees, forms as posts."""

    http: TestClient
    fleet: Fleet
    app: Any

    @property
    def csrf(self) -> str:
        return str(self.app.state.console.auth.csrf(USER[0]))

    def page(self, url: str, status: int = 200) -> Node:
        response = self.http.get(url)
        assert response.status_code == status, (response.status_code, response.text[:2000])
        return parse(response.text)

    def post(self, verb: str, *, confirm: bool = True, **fields: str) -> httpx.Response:
        data = {"csrf": self.csrf, **fields}
        if confirm:
            data["confirm"] = "yes"
        return self.http.post(f"/actions/{verb}", data=data, follow_redirects=False)

    def act(self, verb: str, **fields: str) -> Node:
        """Post the action confirmed; it must redirect (303); the page it leads to."""
        response = self.post(verb, **fields)
        assert response.status_code == 303, (response.status_code, response.text[:2000])
        return self.page(response.headers["location"])


def parked_on_budget(client: Fleet, drain: Any, run_id: str) -> Any:
    """A run of ``chain`` parked on its token budget (needs a decision); ``drain``
    runs its steps (``InlineBroker.drain``)."""
    run = client.enqueue("chain", 6, run_id=run_id, budget={"tokens": 33})
    drain()
    assert run.status() == "needs_decision"
    return run


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def error_line(response: httpx.Response) -> str:
    return parse(response.text).by_id("error").text


@pytest.fixture
def web(client: Fleet) -> Iterator[Web]:
    application = app(client, auth=AUTH, secret="test-secret", live_interval=0.05)
    with TestClient(application, headers={"Authorization": basic(*USER)}) as http:
        yield Web(http, client, application)
