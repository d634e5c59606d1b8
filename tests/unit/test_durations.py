"""``fleet.durations``: operator durations parsed or refused in one line, and ``ago`` as
the CLI and the console both show a moment."""

from __future__ import annotations

import pytest

from fleet.durations import ago, parse_duration
from fleet.errors import BadInput


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("45s", 45.0), ("90m", 5400.0), ("12h", 43200.0), (" 30d ", 2592000.0), ("2w", 1209600.0)],
)
def test_a_whole_number_and_one_unit(text: str, seconds: float) -> None:
    assert parse_duration(text, "--older-than") == seconds


@pytest.mark.parametrize("text", ["30", "1.5h", "-3d", "3 d", "3y", "", "5m30s", "٣d"])
def test_anything_else_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(BadInput) as err:
        parse_duration(text, "--older-than")
    assert "--older-than" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("before", "shown"),
    [
        (0, "0s ago"),
        (89, "89s ago"),
        (90, "2m ago"),
        (5399, "90m ago"),
        (5400, "1.5h ago"),
        (172799, "48.0h ago"),
        (172800, "2d ago"),
        (86400 * 400, "400d ago"),
        (-5, "0s ago"),
    ],
)
def test_ago(before: float, shown: str) -> None:
    assert ago(1_000_000_000 - before, now=1_000_000_000) == shown
    assert ago(None) == "-"
