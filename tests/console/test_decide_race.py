"""Invariant 14 through real HTTP: one approval answers one wait. ``fleet console`` runs
as a process beside a real worker; the same confirmed decision is posted by several
clients at once, round after round. Exactly one lands; the others are 409 with nothing
written, and the run's next approval gate is never passed by a copy."""

from __future__ import annotations

import functools

import httpx

from fleet import Fleet
from tests.browser.conftest import PASSWORD, USER, start_console
from tests.console.dom import parse
from tests.harness import Backend, Cluster, together
from tests.integration.test_one_decision import _at_gate, _kept_signals

COPIES = 4


def _post(url: str, fields: dict[str, str]) -> httpx.Response:
    with httpx.Client(auth=(USER, PASSWORD), timeout=30) as http:
        return http.post(url, data=fields, follow_redirects=False)


def test_a_double_submitted_approval_passes_one_gate_only(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    console = start_console(backend, cluster)
    for round_ in range(3):
        run = client.enqueue("two_gates", run_id=f"gate-{round_}")
        _at_gate(client, run.id, "wait:approval#1")
        inbox = httpx.get(console.url("inbox"), auth=(USER, PASSWORD), timeout=30)
        form = parse(inbox.text).by_id("inbox").one("tr", data_run_id=run.id).one("form")
        fields = {i.get("name") or "": i.get("value") or "" for i in form.all("input")}
        assert fields["wait_id"] == "wait:approval#1"
        fields.update(decision="approve", comment="ok", confirm="yes", why="ok")

        posted = together(COPIES, functools.partial(_post, console.url("actions/decide"), fields))
        responses = [r for r in posted if isinstance(r, httpx.Response)]
        assert len(responses) == COPIES, posted
        codes = sorted(r.status_code for r in responses)
        assert codes == [303] + [409] * (COPIES - 1), [
            (r.status_code, r.text[:300]) for r in responses
        ]
        for refused in (r for r in responses if r.status_code == 409):
            line = parse(refused.text).by_id("error").text
            # Refused before the write (the wait was closed when read) or by it.
            assert "wait 'wait:approval#1'" in line, line

        _at_gate(client, run.id, "wait:approval#2")
        assert _kept_signals(client, run.id) == [("approval", "wait:approval#1")]
