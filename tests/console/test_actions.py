"""The console's actions (POST ``/actions/<verb>``), on SQLite and Postgres: each asks
for confirmation, then acts through ``Fleet`` with ``by=`` the user and ``why=``, and
lands in the audit; bad input is one line in ``#error`` with a 4xx and changes nothing."""

from __future__ import annotations

import json

import pytest

from fleet import Fleet, Secret
from tests.console.conftest import Web, error_line, parked_on_budget
from tests.console.dom import parse
from tests.harness import Cluster, InlineBroker, everything_in_the_store, poll

GATE = "wait:approval#1"  # the approval flow's one wait


def _audit(client: Fleet, run_id: str) -> list[tuple[str, str, str | None]]:
    from fleet.store.browse import Browse

    return [(a.actor, a.action, a.why) for a in Browse(client.runtime.db).audit(run_id=run_id)]


def _confirm_form(web: Web, response_text: str) -> dict[str, str]:
    """The confirmation page's form, as a browser would submit it."""
    form = parse(response_text).by_id("confirm")
    fields = {i.get("name") or "": i.get("value") or "" for i in form.all("input")}
    fields["why"] = form.one("textarea", name="why").text
    assert form.has("button", id="confirm-button") and fields["confirm"] == "yes"
    return fields


def test_cancel_asks_first_then_cancels_and_records_who_and_why(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="c1")
    inline.drain()
    first = web.post("cancel", confirm=False, run_id="c1")
    assert first.status_code == 200
    assert "Cancel run c1?" in parse(first.text).one("p", class_="question").text
    assert client.run("c1").status() == "waiting", "nothing changed before confirmation"
    fields = _confirm_form(web, first.text)
    assert fields["run_id"] == "c1" and fields["csrf"] == web.csrf
    fields["why"] = "customer asked <b>"
    done = web.http.post("/actions/cancel", data=fields, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].startswith("/runs/c1?msg=")
    page = web.page(done.headers["location"])
    assert page.by_id("flash").text == "cancelled run c1"
    assert page.by_id("run-status").text == "cancelled"
    assert "customer asked <b>" in page.by_id("audit").text
    assert _audit(client, "c1") == [("ada", "cancel", "customer asked <b>")]


def test_refusals_are_one_line_and_change_nothing(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("chain", 1, run_id="ended")
    client.enqueue("approval", run_id="live")
    inline.drain()
    cases = [
        ("cancel", {"run_id": "ended"}, 409, "run ended has already ended (succeeded)"),
        ("cancel", {"run_id": "ghost<i>"}, 404, "unknown run 'ghost<i>'"),
        ("cancel", {"run_id": ""}, 400, "no run id given"),
        (
            "decide",
            {"run_id": "ended", "name": "approval", "decision": "approve", "wait_id": GATE},
            409,
            "run ended has no open wait 'wait:approval#1' on 'approval' (it is succeeded)",
        ),
        (
            "decide",
            {"run_id": "live", "name": "approval", "decision": "approve"},
            400,
            "this form names no wait: reload the page",
        ),
        (
            "decide",
            {"run_id": "live", "name": "approval", "decision": "maybe"},
            400,
            "decision must be approve or reject",
        ),
        (
            "decide",
            {"run_id": "live", "name": "other", "decision": "approve", "wait_id": GATE},
            409,
            "run live has no open wait 'wait:approval#1' on 'other' (it is waiting)",
        ),
        (
            "signal",
            {"run_id": "live", "name": "approval", "data": "{nope"},
            400,
            "data is not JSON (Expecting property name",
        ),
        (
            "signal",
            {"run_id": "ended", "name": "approval"},
            409,
            "a signal can only go to a live run",
        ),
        (
            "resolve",
            {"run_id": "live", "step_id": "work#1", "outcome": "retry"},
            409,
            "step 'work#1' of run live is not an effect in doubt (run is waiting)",
        ),
        (
            "resolve",
            {"run_id": "live", "step_id": "x", "outcome": "perhaps"},
            400,
            "outcome must be happened or retry",
        ),
        (
            "raise-budget",
            {"run_id": "live", "tokens": "lots"},
            400,
            "tokens must be a whole number, got 'lots'",
        ),
        ("raise-budget", {"run_id": "live"}, 400, "give a new token budget"),
        (
            "raise-budget",
            {"run_id": "live", "cost": "2"},
            409,
            "run live is waiting, not waiting on its budget",
        ),
        ("replay", {"letter_id": "77"}, 404, "unknown dead letter 77"),
        ("replay-all", {"rate": "0"}, 400, "rate must be a positive number"),
        ("replay-all", {"rate": "fast"}, 400, "rate 'fast' is not a number"),
        ("replay-all", {"rate": "0.0000001"}, 400, "rate must be 0.01 to 100 per second"),
        ("replay-all", {"rate": "101"}, 400, "rate must be 0.01 to 100 per second, got 101"),
        ("replay-all", {}, 409, "no dead letter waits for a replay"),
        ("launch", {}, 404, "unknown action 'launch'"),
    ]
    for verb, fields, status, words in cases:
        for confirm in (False, True):
            response = web.post(verb, confirm=confirm, **fields)
            assert response.status_code == status, (verb, fields, response.text[:500])
            assert words in error_line(response), (verb, words, error_line(response))
    assert client.run("live").status() == "waiting" and client.run("ended").status() == "succeeded"
    assert _audit(client, "live") == [] and _audit(client, "ended") == []
    assert web.http.get("/actions/cancel").status_code == 405


def test_a_stale_or_foreign_form_is_refused_with_nothing_changed(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="s1")
    inline.drain()
    bob = web.app.state.console.auth.csrf("bob")
    for token in ("", "0" * 64, bob, web.csrf[:-1]):
        response = web.http.post(
            "/actions/cancel",
            data={"csrf": token, "run_id": "s1", "confirm": "yes"},
            follow_redirects=False,
        )
        assert response.status_code == 403
        assert error_line(response) == (
            "this form is stale or not from this console: reload the page"
        )
    assert client.run("s1").status() == "waiting" and _audit(client, "s1") == []


def test_approve_from_the_inbox_in_two_clicks(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="a<1>")
    inline.drain()
    form = web.page("/inbox").by_id("inbox").one("tr", data_run_id="a<1>").one("form")
    fields = {i.get("name") or "": i.get("value") or "" for i in form.all("input")}
    fields.update(comment="looks right", decision="approve")
    click1 = web.http.post(form.get("action") or "", data=fields)
    assert click1.status_code == 200 and client.run("a<1>").status() == "waiting"
    click2 = web.http.post(
        "/actions/decide", data=_confirm_form(web, click1.text), follow_redirects=False
    )
    assert click2.status_code == 303
    assert web.page(click2.headers["location"]).by_id("flash").text == "approved run a<1>"
    inline.drain()
    decision = {"approved": True, "by": "ada", "comment": "looks right"}
    assert client.run("a<1>").wait(timeout=10) == {"decision": decision}
    assert _audit(client, "a<1>") == [("ada", "signal", "looks right")]
    again = web.post("decide", run_id="a<1>", name="approval", decision="approve", wait_id=GATE)
    assert again.status_code == 409
    assert "has no open wait 'wait:approval#1' on 'approval'" in error_line(again)
    assert _audit(client, "a<1>") == [("ada", "signal", "looks right")], "nothing more written"


def test_reject_and_signal_send_the_payload(web: Web, client: Fleet, inline: InlineBroker) -> None:
    client.enqueue("approval", run_id="r1")
    client.enqueue("inbox", 1, run_id="sig1")
    inline.drain()
    web.act("decide", run_id="r1", name="approval", decision="reject", comment="no", wait_id=GATE)
    web.act("signal", run_id="sig1", name="msg", data='{"x": [1, "<b>"]}', why="testing")
    inline.drain()
    assert client.run("r1").wait(timeout=10) == {
        "decision": {"approved": False, "by": "ada", "comment": "no"}
    }
    assert client.run("sig1").wait(timeout=10) == [{"x": [1, "<b>"]}]
    assert _audit(client, "sig1") == [("ada", "signal", "testing")]


def test_raise_budget_lets_a_parked_run_go_on(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    run = parked_on_budget(client, inline.drain, "b1")
    doc = web.page("/runs/b1")
    assert doc.by_id("raise-budget").get("action") == "/actions/raise-budget"
    page = web.act("raise-budget", run_id="b1", tokens="1000", why="worth it")
    assert page.by_id("flash").text == "raised the budget of run b1"
    inline.drain()
    assert run.wait(timeout=10) == sum(i * i for i in range(6))
    assert _audit(client, "b1") == [("ada", "raise_budget", "worth it")]


def test_replay_with_an_edited_input(web: Web, client: Fleet, inline: InlineBroker) -> None:
    client.enqueue("refusing", run_id="d1")
    inline.drain()
    (letter,) = client.dead_letters()
    textarea = web.page(f"/dead-letters/{letter.id}").by_id("replay").one("textarea", name="input")
    assert json.loads(textarea.text) == letter.input
    bad = web.post("replay", letter_id=str(letter.id), input="[1,")
    assert bad.status_code == 400 and "input is not JSON (Expecting value" in error_line(bad)
    wrong = web.post("replay", letter_id=str(letter.id), input='"just text"')
    assert wrong.status_code == 400 and "input must be a JSON list" in error_line(wrong)
    assert client.dead_letters()[0].replayed_at is None, "nothing replayed"

    confirm = web.post("replay", confirm=False, letter_id=str(letter.id), input='["edited <why>"]')
    assert "with the edited input" in parse(confirm.text).one("p", class_="question").text
    page = web.act("replay", letter_id=str(letter.id), input='["edited <why>"]', why="fixed")
    assert page.by_id("flash").text == f"replayed dead letter {letter.id} (step refuse#1)"
    inline.drain()
    letters = client.dead_letters(include_replayed=True)
    assert letters[0].replayed_at is not None
    assert letters[-1].error_message == "edited <why>", "the step ran with the edited input"
    assert ("ada", "replay", "fixed") in _audit(client, "d1")
    again = web.post("replay", letter_id=str(letter.id))
    assert again.status_code == 409 and "was already replayed" in error_line(again)


def test_replay_all_matching_at_a_rate(web: Web, client: Fleet, inline: InlineBroker) -> None:
    for i in range(3):
        client.enqueue("refusing", run_id=f"many-{i}")
    inline.drain()
    assert len(client.dead_letters(workflow="refusing")) == 3
    page = web.act("replay-all", workflow="refusing", rate="50", why="outage over")
    assert page.by_id("flash").text == (
        "replaying 3 dead letter(s) of workflow 'refusing' at 50 per second"
    )
    poll(lambda: not client.dead_letters(workflow="refusing"), 10, "every letter replayed")
    assert all(("ada", "replay", "outage over") in _audit(client, f"many-{i}") for i in range(3))


def test_resolve_an_effect_in_doubt_from_its_page(
    web: Web, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    run = client.enqueue("notify", "plain", "hello", True, run_id="doubt")
    poll(lambda: run.status() == "needs_decision", 60, "the run to need a decision")
    form = web.page("/runs/doubt").by_id("resolve")
    assert form.one("input", name="step_id").get("value") == "send_plain#1"
    page = web.act(
        "resolve",
        run_id="doubt",
        step_id="send_plain#1",
        outcome="happened",
        output='{"receipt": "checked by hand"}',
        why="provider dashboard shows it sent",
    )
    assert page.by_id("flash").text == "step send_plain#1 of run doubt resolved as happened"
    assert run.wait(timeout=60) == {"receipt": "checked by hand"}
    assert ("ada", "resolve", "provider dashboard shows it sent") in _audit(client, "doubt")


def test_a_secret_in_a_replayed_input_stays_a_secret(
    web: Web, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48, item 3: the form showed ``Secret.env('…')`` as text, and sending it back
    unchanged replayed the step with that string for its secret."""
    monkeypatch.delenv("FLEET_TEST_SECRET", raising=False)
    run = client.enqueue("secretive", run_id="needs-key")
    inline.drain()
    (letter,) = client.dead_letters()
    assert letter.input == {"args": [Secret.env("FLEET_TEST_SECRET"), False], "kwargs": {}}
    shown = web.page(f"/dead-letters/{letter.id}").by_id("replay").one("textarea", name="input")
    marker = {"$fleet_secret": "FLEET_TEST_SECRET"}
    assert json.loads(shown.text) == {"args": [marker, False], "kwargs": {}}
    monkeypatch.setenv("FLEET_TEST_SECRET", "hunter2-value")
    confirm = web.post("replay", confirm=False, letter_id=str(letter.id), input=shown.text)
    assert "with the edited input" not in parse(confirm.text).one("p", class_="question").text
    web.act("replay", letter_id=str(letter.id), input=shown.text, why="key set")
    inline.drain()
    assert run.wait(timeout=10) == {
        "length": len("hunter2-value"),
        "repr": "Secret.env('FLEET_TEST_SECRET')",
    }, "the step was handed the secret, not a string"
    assert "hunter2-value" not in everything_in_the_store(client)


def test_an_edited_input_keeps_its_secrets_and_one_is_not_true(
    web: Web, client: Fleet, inline: InlineBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_TEST_SECRET", raising=False)
    monkeypatch.delenv("OTHER_KEY", raising=False)
    client.enqueue("secretive", run_id="edited-key")
    inline.drain()
    (letter,) = client.dead_letters()
    # The same input, written otherwise: not an edit.
    same = '{"args":[{"$fleet_secret":"FLEET_TEST_SECRET"},false],\n"kwargs": {}}'
    confirm = web.post("replay", confirm=False, letter_id=str(letter.id), input=same)
    assert "with the edited input" not in parse(confirm.text).one("p", class_="question").text
    # 0 for false is an edit (Python's 0 == False is not the store's).
    for edited in (
        '[{"$fleet_secret": "FLEET_TEST_SECRET"}, 0]',
        '[{"$fleet_secret": "OTHER_KEY"}, false]',
    ):
        confirm = web.post("replay", confirm=False, letter_id=str(letter.id), input=edited)
        assert "with the edited input" in parse(confirm.text).one("p", class_="question").text
    bad = web.post("replay", letter_id=str(letter.id), input='[{"$fleet_secret": "no such"}]')
    assert bad.status_code == 400 and "secret name 'no such'" in error_line(bad)
    monkeypatch.setenv("OTHER_KEY", "abc")
    web.act("replay", letter_id=str(letter.id), input='[{"$fleet_secret": "OTHER_KEY"}, false]')
    inline.drain()
    assert client.run("edited-key").wait(timeout=10) == {
        "length": 3,
        "repr": "Secret.env('OTHER_KEY')",
    }
