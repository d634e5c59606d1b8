"""Durations as an operator writes them: a whole number and one unit, ``45s``, ``90m``,
``12h``, ``30d`` or ``2w``. Anything else is refused with one line naming the value,
never guessed at (``30`` alone could mean seconds or days)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from fleet.errors import BadInput

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d{1,12})([smhdw])")


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
