"""How many steps a task runs inline before it hands its run back (``fleet/worker/
inline.py``): on a slot, ``inline_steps``; on a strand (the loop's thread), a number
drawn in the upper half of it, so that runs started together do not all hand back at
the same step. No services."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fleet.worker import inline, strands


def _cap(more: Any) -> int:
    """The first count of steps at which ``more`` says no."""
    return next(n for n in range(1, 1000) if not more(n))


def _rt(cap: int) -> Any:
    return SimpleNamespace(settings=SimpleNamespace(inline_steps=cap))


def test_a_slot_hands_back_after_exactly_inline_steps() -> None:
    assert strands.current() is None
    assert {_cap(inline._task_limits(_rt(10))) for _ in range(50)} == {10}


def test_strand_chains_hand_back_spread_over_the_upper_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fails with one cap for all: 500 runs started together handed back at the same
    step, their messages queued behind each other (attempts of 1 s took 1.8 s)."""
    monkeypatch.setattr(strands, "current", lambda: object())
    caps = [_cap(inline._task_limits(_rt(10))) for _ in range(200)]
    assert set(caps) == {5, 6, 7, 8, 9, 10}
    assert {_cap(inline._task_limits(_rt(1))) for _ in range(20)} == {1}
