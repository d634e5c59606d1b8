"""The bounds of what fleet keeps, refused at the edge with one line."""

from __future__ import annotations

import pytest

from fleet import codec
from fleet.bounds import INT32, INT64, MAX_DEPTH, check_depth, whole
from fleet.errors import BadInput, PayloadError
from fleet.registry import check_budget


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 30_000])
def test_json_nested_past_the_bound_is_one_line(depth: int) -> None:
    with pytest.raises(PayloadError, match=f"--data nests more than {MAX_DEPTH} levels deep"):
        codec.parse_json_arg(nested(depth), what="--data")


def test_json_at_the_bound_is_kept_and_recorded() -> None:
    value = codec.parse_json_arg(nested(MAX_DEPTH), what="--data")
    assert codec.decode(codec.encode(value, what="x", limit=10_000)) == value


def test_a_value_nested_past_the_bound_is_not_recorded() -> None:
    value: list[object] = []
    for _ in range(MAX_DEPTH):
        value = [value]
    with pytest.raises(PayloadError, match="output of a#1 nests more than"):
        codec.encode(value, what="output of a#1", limit=10**6)


def test_many_brackets_side_by_side_are_not_depth() -> None:
    wide = [[1]] * 5_000
    check_depth(wide, "x")
    assert codec.decode(codec.encode(wide, what="x", limit=10**6)) == [[1]] * 5_000


def test_an_integer_of_thousands_of_digits_is_one_line() -> None:
    with pytest.raises(PayloadError, match="--data is not JSON fleet can keep: Exceeds"):
        codec.parse_json_arg("1" * 5_000, what="--data")


@pytest.mark.parametrize(
    ("text", "high", "expected"),
    [("7", INT32, 7), (" 12 ", INT32, 12), (str(INT64), INT64, INT64)],
)
def test_whole_numbers_within_bounds(text: str, high: int, expected: int) -> None:
    assert whole(text, "--limit", high=high) == expected


@pytest.mark.parametrize(
    "text", ["99999999999999999999", str(INT32 + 1), "-1", "1e3", "٣", "1_000", "", "x", True]
)
def test_whole_numbers_past_bounds_or_not_numbers_are_refused(text: object) -> None:
    with pytest.raises(BadInput, match="--id must be"):
        whole(text, "--id", high=INT32)


def test_a_budget_past_what_the_store_keeps_is_refused() -> None:
    with pytest.raises(BadInput, match="budget tokens must be at most"):
        check_budget({"tokens": 10**23})
    with pytest.raises(BadInput, match="budget cost must be at most"):
        check_budget({"cost": 1e300})
