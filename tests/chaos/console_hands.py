"""The console's actions in the chaos run: a ``fleet console`` process started with the
workers' environment (through the proxies the injector cuts, with the engine they run),
and ``ConsoleHands``, which fills its forms over HTTP as an operator's browser does —
cancel, send a signal, approve or reject a wait by its id, raise a budget, replay a
dead letter — each with the CSRF token the console signs, confirmed at once.

An answer the console gives is mapped back to what the Python API would have raised,
so the driver treats both the same: 404 is ``UnknownRun``, 409 (the run moved on, the
wait was answered, the letter replayed) is ``Conflict``, and a 5xx or a broken
connection (the store or the console restarting under a fault) is ``Unreachable``:
the driver tries again later. A 400 or 403 is a bug of the harness's own forms and
fails the run loudly.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from fleet.console.auth import ANONYMOUS, Auth
from fleet.errors import UnknownRun
from fleet.testing import FleetProcess

USER = ANONYMOUS  # the console runs --no-auth on loopback
READY_WITHIN = 30.0


class Conflict(Exception):
    """The console refused with 409: the run, wait or letter is no longer in that state."""


class Unreachable(Exception):
    """No answer, or a 5xx: the console or its store is down for now."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ConsoleProcess:
    """``fleet console -A APP --no-auth`` on a free loopback port, forms signed with a
    secret the harness knows."""

    def __init__(self, app: str, env: dict[str, str], workdir: Path) -> None:
        self.secret = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["console", "-A", app, "--port", str(self.port), "--no-auth"]
        self._proc = FleetProcess(
            "console", argv, {**env, "FLEET_CONSOLE_SECRET": self.secret}, workdir
        )
        deadline = time.monotonic() + READY_WITHIN
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/fleet", timeout=5).status_code < 500:
                    return
            if not self._proc.alive:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the console did not start:\n{self._proc.output()[-3000:]}")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        self._proc.stop()


class ConsoleHands:
    """POSTs to ``/actions/<verb>`` of the console at ``url``, confirmed, with the
    token the console signs its forms with (``fleet.console.auth.Auth.csrf``)."""

    def __init__(self, url: str, secret: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=15.0, follow_redirects=False)
        self.csrf = Auth(no_auth=True, secret=secret.encode()).csrf(USER)

    def act(self, verb: str, why: str = "chaos", **fields: str) -> None:
        """Do ``verb`` with ``fields`` (and ``why``, what the operator writes: a cancel's
        reason); returns once the console has done it (303)."""
        form = {"csrf": self.csrf, "confirm": "yes", "why": why, **fields}
        try:
            answer = self.http.post(f"/actions/{verb}", data=form)
        except httpx.HTTPError as exc:
            raise Unreachable(f"console: {type(exc).__name__}: {exc}") from None
        line = _error_line(answer.text)
        if answer.status_code == 303:
            return
        if answer.status_code == 404:
            raise UnknownRun(line)
        if answer.status_code == 409:
            raise Conflict(line)
        if answer.status_code >= 500:
            raise Unreachable(f"console {answer.status_code}: {line}")
        raise AssertionError(
            f"the console refused the harness's {verb} form: {answer.status_code} {line}"
        )

    def cancel(self, run_id: str, reason: str) -> None:
        self.act("cancel", why=reason, run_id=run_id)

    def signal(self, run_id: str, name: str, payload: Any) -> None:
        self.act("signal", run_id=run_id, name=name, data=json.dumps(payload))

    def decide(self, run_id: str, name: str, wait_id: str, approve: bool, comment: str) -> None:
        decision = "approve" if approve else "reject"
        self.act(
            "decide", run_id=run_id, name=name, wait_id=wait_id, decision=decision, comment=comment
        )

    def raise_budget(self, run_id: str, tokens: int) -> None:
        self.act("raise-budget", run_id=run_id, tokens=str(tokens))

    def replay(self, letter_id: int) -> None:
        self.act("replay", letter_id=str(letter_id))


def _error_line(html: str) -> str:
    """The one line a refused page shows in ``#error`` (or the start of the body)."""
    start = html.find('id="error"')
    if start < 0:
        return " ".join(html.split())[:200]
    text = html[html.find(">", start) + 1 :]
    return " ".join(text[: text.find("<")].split())[:300]
