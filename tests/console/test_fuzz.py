"""No input gives the console a 500 (issue 48): every page's query parameters, every
path segment, every action's form fields, as text (NUL bytes, control characters,
huge numbers, deep JSON, dates and durations out of range) and as raw bytes (not
UTF-8), on SQLite and on Postgres. Each answer is a page or a 4xx with its reason.

The console's state is made once per store (a waiting run, a run parked on its
budget, a dead letter, a transcript); the examples act on it through real requests,
so a cancel or a replay one example confirms is what the next one finds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, quote_from_bytes, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from fleet import Fleet
from fleet.console import app
from tests.console.conftest import AUTH, USER, basic, parked_on_budget
from tests.harness import InlineBroker

# Kept small: the whole file runs in well under a minute on both stores (more, to hunt:
# CONSOLE_FUZZ_EXAMPLES=2000).
EXAMPLES = int(os.environ.get("CONSOLE_FUZZ_EXAMPLES", "60"))

PAGES = {
    "/runs": ("status", "workflow", "tenant", "since", "until", "q", "after", "msg", "sig"),
    "/inbox": (),
    "/dead-letters": ("workflow", "run"),
    "/fleet": (),
    "/audit": (),
    "/transcripts": ("run", "name", "before"),
    "/events/runs": ("status", "workflow", "tenant", "since", "until", "q"),
    "/events/run": ("id",),
}
PATHS = ("/runs/", "/dead-letters/")
FIELDS = {
    "cancel": ("run_id",),
    "decide": ("run_id", "name", "decision", "comment", "wait_id"),
    "signal": ("run_id", "name", "data"),
    "resolve": ("run_id", "step_id", "outcome", "output"),
    "raise-budget": ("run_id", "tokens", "cost"),
    "replay": ("letter_id", "input"),
    "replay-all": ("workflow", "rate"),
}
IDS = ("fuzz-wait", "fuzz-budget", "fuzz-dead", "fuzz-chat", "1", "2")

# What a hostile user types: NUL and other control characters, numbers past every
# column's range, floats JSON and Postgres refuse, deep JSON, odd dates and durations.
SPECIAL = st.sampled_from(
    [
        "\x00",
        "a\x00b",
        "\x7f\x1b[31m",
        "99999999999999999999999",
        "9223372036854775808",
        "-1",
        "0",
        "nan",
        "inf",
        "-inf",
        "1e309",
        "1e-320",
        "[" * 5000 + "]" * 5000,
        '{"a":' * 300 + "1" + "}" * 300,
        "9" * 5000,
        '"\\u0000"',
        '{"$fleet_secret": "X"}',
        '{"$fleet_transcript": {"run": "x", "name": "main", "end": 3}}',
        "9999999999999w",
        "0001-01-01",
        "9999-12-31T23:59:59+14:00",
        "-0001-01-01",
        "1h",
        "approve",
        "happened",
        "retry",
        "waiting",
        *IDS,
    ]
)
TEXT = st.one_of(SPECIAL, st.text(max_size=40), st.text(alphabet="0123456789-.:eTZ+", max_size=30))
# Raw bytes, percent-encoded: not always UTF-8.
RAW = st.binary(max_size=24)


def _value(name: str) -> st.SearchStrategy[str]:
    return st.one_of(TEXT, st.sampled_from(IDS)) if "id" in name or name == "run" else TEXT


def _query(names: tuple[str, ...]) -> st.SearchStrategy[str]:
    known = (
        st.lists(
            st.sampled_from(names).flatmap(lambda n: _value(n).map(lambda v: (n, v))), max_size=4
        )
        if names
        else st.just([])
    )
    junk = st.lists(st.tuples(st.text(max_size=8), TEXT), max_size=2)
    text = st.builds(lambda a, b: urlencode(a + b), known, junk)
    raw = st.lists(st.tuples(RAW, RAW), max_size=3).map(
        lambda pairs: "&".join(f"{quote_from_bytes(k)}={quote_from_bytes(v)}" for k, v in pairs)
    )
    return st.one_of(text, raw)


REQUESTS = st.one_of(
    st.sampled_from(sorted(PAGES)).flatmap(lambda p: _query(PAGES[p]).map(lambda q: f"{p}?{q}")),
    st.tuples(st.sampled_from(PATHS), st.one_of(TEXT, st.sampled_from(IDS))).map(
        lambda t: t[0] + quote(t[1], safe="/")
    ),
    st.tuples(st.sampled_from(PATHS), RAW).map(lambda t: t[0] + quote_from_bytes(t[1])),
)


def _form(verb: str) -> st.SearchStrategy[dict[str, str]]:
    names = FIELDS[verb] + ("why", "comment", "decision")
    return st.dictionaries(st.sampled_from(names), st.one_of(_value("id"), TEXT), max_size=5)


ACTIONS = st.one_of(
    st.sampled_from(sorted(FIELDS)).flatmap(
        lambda verb: st.tuples(st.just(verb), _form(verb), st.booleans())
    ),
    st.tuples(st.text(max_size=10), st.just({}), st.booleans()),
)


@pytest.fixture
def http(client: Fleet, inline: InlineBroker) -> Iterator[TestClient]:
    client.enqueue("approval", run_id="fuzz-wait")
    parked_on_budget(client, inline.drain, "fuzz-budget")
    client.enqueue("refusing", run_id="fuzz-dead")
    client.enqueue("talks", run_id="fuzz-chat")
    inline.drain()
    # Event streams end at once: a fuzz example is one request, not a live page.
    console = app(client, auth=AUTH, secret="fuzz", live_interval=0.01, stream_seconds=0.05)
    headers = {"Authorization": basic(*USER)}
    with TestClient(console, headers=headers, raise_server_exceptions=False) as test_client:
        test_client.app_state = console.state  # type: ignore[attr-defined]
        yield test_client


def _no_500(response: Any, what: object) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[-800:])


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(url=REQUESTS)
def test_no_page_query_or_path_gives_a_500(http: TestClient, url: str) -> None:
    _no_500(http.get(url, follow_redirects=False), url)


@FUZZ
@given(action=ACTIONS)
def test_no_form_gives_a_500(http: TestClient, action: tuple[str, dict[str, str], bool]) -> None:
    verb, fields, confirm = action
    token = http.app_state.console.auth.csrf(USER[0])  # type: ignore[attr-defined]
    data = {**fields, "csrf": token}
    if confirm:
        data["confirm"] = "yes"
    path = "/actions/" + quote(verb, safe="")
    _no_500(http.post(path, data=data, follow_redirects=False), (verb, data))


@FUZZ
@given(pairs=st.lists(st.tuples(RAW, RAW), max_size=4), verb=st.sampled_from(sorted(FIELDS)))
def test_no_form_of_raw_bytes_gives_a_500(
    http: TestClient, pairs: list[tuple[bytes, bytes]], verb: str
) -> None:
    token = http.app_state.console.auth.csrf(USER[0])  # type: ignore[attr-defined]
    body = "&".join(f"{quote_from_bytes(k)}={quote_from_bytes(v)}" for k, v in pairs)
    body += ("&" if body else "") + urlencode({"csrf": token})
    response = http.post(
        f"/actions/{verb}",
        content=body,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    _no_500(response, (verb, body))
