"""Durations as an operator writes them: a whole number and one unit, ``45s``, ``90m``,
``12h``, ``30d`` or ``2w``. Anything else is refused with one line naming the value,
never guessed at (``30`` alone could mean seconds or days). And how long ago a moment
was, as the CLI and the console show it (``ago``)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping

from fleet.errors import BadInput

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d{1,12})([smhdw])", re.ASCII)  # "٣d" is not 3 days


def parse_duration(text: str, what: str) -> float:
    """Seconds in ``text`` (``30d`` → 2592000.0); ``BadInput`` naming ``what`` otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise BadInput(
            f"{what} {text!r} is not a duration: a positive whole number and a unit "
            "(s, m, h, d or w), e.g. 30d"
        )
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds <= 0 or not math.isfinite(seconds):
        raise BadInput(f"{what} {text!r} must be longer than zero")
    return seconds


def env_duration(env: Mapping[str, str], name: str) -> float | None:
    """The duration in environment variable ``name``; None when it is unset or empty."""
    raw = env.get(name)
    return None if raw is None or not raw.strip() else parse_duration(raw, name)


def ago(ts: float | None, now: float | None = None) -> str:
    """How long before ``now`` (epoch seconds) ``ts`` was: ``42s ago``, ``12m ago``,
    ``3.5h ago``, ``9d ago``; ``-`` for no time."""
    if ts is None:
        return "-"
    seconds = max(0.0, (now or time.time()) - ts)
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.0f}d ago"
