"""Every status a view can show has a style of its own: a status added to the enums
without one would be shown unstyled (``in_doubt`` once was). A replay's view says where
it stopped."""

from __future__ import annotations

import pytest
from rich.console import Console

from fleet.ops.render import (
    REPLAY_STYLE,
    RUN_STYLE,
    STATUS_STYLE,
    STEP_STYLE,
    replay_view,
    status_text,
)
from fleet.records import Replay
from fleet.states import RunStatus, StepStatus


@pytest.mark.parametrize("status", list(RunStatus))
def test_every_run_status_has_a_style(status: RunStatus) -> None:
    assert RUN_STYLE.get(status), f"run status {status.value!r} has no style in render.py"


@pytest.mark.parametrize("status", list(StepStatus))
def test_every_step_status_has_a_style(status: StepStatus) -> None:
    assert STEP_STYLE.get(status), f"step status {status.value!r} has no style in render.py"


def test_a_status_read_from_the_store_is_shown_in_its_style() -> None:
    # Rows may carry the plain value: a view looks its style up by value.
    assert status_text("in_doubt").style == STEP_STYLE[StepStatus.IN_DOUBT] == "magenta"
    assert status_text(RunStatus.NEEDS_DECISION).style == "magenta"
    # Both enums say "running": one style, whichever the view was given.
    assert RUN_STYLE[RunStatus.RUNNING] == STEP_STYLE[StepStatus.RUNNING]
    assert set(STATUS_STYLE) == {s.value for s in [*RunStatus, *StepStatus]}


@pytest.mark.parametrize(
    ("replay", "shown"),
    [
        (
            Replay("r", "finished", result={"n": 1}, replayed=3),
            ["finished", '{"n": 1}', "3 recorded"],
        ),
        (
            Replay("r", "suspended", next=("wait:ok#1",), wait="ok", replayed=2),
            ["suspended", "stands before  wait:ok#1", "waits for      signal ok"],
        ),
        (
            Replay("r", "suspended", next=("a#1", "b#1"), new=("b#1",)),
            ["stands before     a#1, b#1", "not recorded yet  b#1"],
        ),
        (
            Replay("r", "failed", error="RuntimeError: no\n\nTraceback (most recent call last):"),
            ["failed", "error      RuntimeError: no", "Traceback (most recent call last):"],
        ),
    ],
)
def test_a_replay_view_says_where_it_stopped(replay: Replay, shown: list[str]) -> None:
    assert REPLAY_STYLE[replay.status]
    console = Console(width=100, record=True, file=None)
    with console.capture() as captured:
        console.print(replay_view(replay))
    text = captured.get()
    for part in shown:
        assert part in text, text
