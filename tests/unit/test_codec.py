"""The codec: user JSON round-trips exactly whatever keys it holds; only a real
``Secret.env`` is recorded as the marker; a text that cannot be loaded is one
``PayloadError``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import PayloadError, Secret
from fleet.codec import decode, encode

LIMIT = 10**7

# Keys made to collide with the marker and with its escaping.
_KEYS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["$fleet_secret", "$$fleet_secret", "$$$fleet_secret", "$", "$$", "$$x"]),
    st.text(max_size=6).map(lambda s: "$" + s),
    st.text(max_size=6).map(lambda s: "$$" + s),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(['"$x"', "$fleet_secret", '{"$fleet_secret":"A"}', "$5", '\\"$']),
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(_KEYS, inner, max_size=4),
        # Exactly the marker's shape, with any value in it.
        inner.map(lambda v: {"$fleet_secret": v}),
    ),
    max_leaves=25,
)
_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
WITH_SECRETS = st.recursive(
    st.one_of(_SCALARS, _NAMES.map(Secret.env)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_user_json_round_trips_exactly(value: Any) -> None:
    text = encode(value, what="value", limit=LIMIT)
    assert decode(text) == value
    assert not _secrets_in(decode(text)), "user data never becomes a Secret"


def _secrets_in(value: Any) -> list[Secret]:
    """Every ``Secret`` in a decoded value (a key may be the word itself: user data)."""
    if isinstance(value, Secret):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _secrets_in(k) + _secrets_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _secrets_in(v)]
    return []


@settings(max_examples=200, deadline=None)
@given(WITH_SECRETS)
def test_secrets_among_user_json_round_trip_as_secrets(value: Any) -> None:
    assert decode(encode(value, what="value", limit=LIMIT)) == value


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_json_without_dollar_keys_is_recorded_as_plain_json(value: Any) -> None:
    """The fast path: what has no "$" key is written as it always was."""
    text = encode(value, what="value", limit=LIMIT)
    if '"$' not in json.dumps(value, ensure_ascii=False, separators=(",", ":")):
        assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_the_marker_a_user_sends_is_escaped_and_a_real_secret_is_not() -> None:
    value = {"$fleet_secret": "FLEET_DATABASE_URL", "key": Secret.env("MAIL_API_KEY")}
    text = encode(value, what="value", limit=LIMIT)
    assert text == (
        '{"$$fleet_secret":"FLEET_DATABASE_URL","key":{"$fleet_secret":"MAIL_API_KEY"}}'
    )
    assert decode(text) == value


def test_rows_written_before_escaping_still_decode() -> None:
    assert decode('{"$y":[1],"a":{"$fleet_secret":"MAIL_API_KEY"}}') == {
        "$y": [1],
        "a": Secret.env("MAIL_API_KEY"),
    }


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"$fleet_secret":"not a name"}', "secret name 'not a name' is not an environment"),
        ('{"$fleet_secret":5}', "secret name 5 is not an environment"),
        ('{"args":[1,', "recorded value is not valid JSON: "),
        ("[" * 100_000, "recorded value is not valid JSON: "),
    ],
)
def test_a_text_that_cannot_be_loaded_is_one_payload_error(text: str, why: str) -> None:
    with pytest.raises(PayloadError) as raised:
        decode(text)
    assert str(raised.value).startswith(why) and "\n" not in str(raised.value)


def test_a_value_nested_too_deeply_is_refused_in_one_line() -> None:
    value: Any = "leaf"
    for _ in range(100_000):
        value = {"$x": value}
    with pytest.raises(PayloadError, match="^output of s#1 is nested too deeply to record$"):
        encode(value, what="output of s#1", limit=LIMIT)
