"""Hostile input to the console, on SQLite and Postgres: a NUL byte in any query
parameter, path segment or form field, a whole number past what the store keeps, JSON
nested thousands deep. Each is a 400 with one line naming what was wrong, and nothing
is changed (issue 48, item 7)."""

from __future__ import annotations

from fleet import Fleet
from fleet.store.run_list import encode_cursor
from tests.console.conftest import Web, error_line, parked_on_budget
from tests.harness import InlineBroker

NUL = "a\x00b"


def test_a_nul_byte_anywhere_is_a_400_naming_where(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    client.enqueue("approval", run_id="live")
    inline.drain()
    gets = [
        ("/runs?q=a%00b", "q"),
        ("/runs?tenant=a%00b", "tenant"),
        ("/runs?workflow=a%00b", "workflow"),
        ("/runs?since=1h%00", "since"),
        ("/runs?after=a%00b", "after"),
        ("/runs/a%00b", "run_id"),
        ("/events/run?id=a%00b", "id"),
        ("/events/runs?tenant=a%00b", "tenant"),
        ("/dead-letters?workflow=a%00b", "workflow"),
        ("/dead-letters?run=a%00b", "run"),
        ("/dead-letters/1%00", "letter_id"),
    ]
    for url, where in gets:
        response = web.http.get(url)
        assert response.status_code == 400, (url, response.status_code, response.text[:300])
        line = error_line(response)
        assert line.endswith("holds a NUL byte") and repr(where) in line, (url, line)
    # A cursor holding one (made elsewhere: this console's never do).
    response = web.http.get("/runs", params={"after": encode_cursor(1.0, NUL)})
    assert response.status_code == 400 and "is not one this console made" in error_line(response)
    posts = [
        ("cancel", {"run_id": NUL}, "run_id"),
        ("signal", {"run_id": "live", "name": "approval", "data": '"a\\u0000b"'}, None),
        ("signal", {"run_id": NUL, "name": "approval"}, "run_id"),
        ("raise-budget", {"run_id": NUL, "tokens": "5"}, "run_id"),
        ("resolve", {"run_id": "live", "step_id": NUL, "outcome": "retry"}, "step_id"),
        ("replay-all", {"workflow": NUL}, "workflow"),
        ("cancel", {"run_id": "live", "why": NUL}, "why"),
    ]
    for verb, fields, where in posts:
        for confirm in (False, True):
            response = web.post(verb, confirm=confirm, **fields)
            if where is None:  # JSON's \u0000 is a value, not a NUL in the form
                assert response.status_code != 500, (verb, fields)
                continue
            assert response.status_code == 400, (verb, fields, response.text[:300])
            line = error_line(response)
            assert line == f"form field {where!r} holds a NUL byte", (verb, line)
    assert client.run("live").status() == "waiting"


def test_numbers_past_what_the_store_keeps_are_a_400(
    web: Web, client: Fleet, inline: InlineBroker
) -> None:
    run = parked_on_budget(client, inline.drain, "b1")
    for tokens in ("99999999999999999999999", "9223372036854775808", "-5", "0", "1e3"):
        for confirm in (False, True):
            response = web.post("raise-budget", confirm=confirm, run_id="b1", tokens=tokens)
            assert response.status_code == 400, (tokens, response.text[:300])
            assert "tokens must be" in error_line(response), error_line(response)
    # A dead letter's id of thousands of digits (int() refuses past 4,300).
    for digits in ("9" * 5000, "2147483648"):
        page = web.http.get(f"/dead-letters/{digits}")
        assert page.status_code == 400 and "is not a number" in error_line(page)
        replay = web.post("replay", letter_id=digits)
        assert replay.status_code == 400 and "is not a number" in error_line(replay)
    cost = web.post("raise-budget", run_id="b1", cost="1e309")
    assert cost.status_code == 400 and "cost must be a positive number" in error_line(cost)
    assert run.status() == "needs_decision"


def test_json_nested_thousands_deep_is_a_400(web: Web, client: Fleet, inline: InlineBroker) -> None:
    client.enqueue("approval", run_id="deep")
    client.enqueue("refusing", run_id="dl")
    inline.drain()
    (letter,) = client.dead_letters()
    deep = "[" * 5000 + "]" * 5000
    signal = web.post("signal", run_id="deep", name="approval", data=deep)
    assert signal.status_code == 400
    assert "data nests more than 200 levels deep" in error_line(signal)
    replay = web.post("replay", letter_id=str(letter.id), input=deep)
    assert replay.status_code == 400
    assert "input nests more than 200 levels deep" in error_line(replay)
    huge = web.post("signal", run_id="deep", name="approval", data="9" * 5000)
    assert huge.status_code == 400 and "data" in error_line(huge)
    assert client.run("deep").status() == "waiting"
    assert client.dead_letters()[0].replayed_at is None
