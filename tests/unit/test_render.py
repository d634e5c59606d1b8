"""Every status a view can show has a style of its own: a status added to the enums
without one would be shown unstyled (``in_doubt`` once was)."""

from __future__ import annotations

import pytest

from fleet.ops.render import RUN_STYLE, STATUS_STYLE, STEP_STYLE, status_text
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
