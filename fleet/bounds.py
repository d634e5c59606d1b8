"""The bounds of what fleet keeps, checked at the edge: how large a whole number may be
(the column that keeps it: 32 or 64 bits) and how deep a JSON value may nest.

A value past a bound is refused where it enters (the API, the CLI, the console) with one
line naming it, before anything is written; nothing past a bound ever reaches the
store, where it would be a driver's error, or a worker, where a replay would meet a
``RecursionError`` that the client never saw.
"""

from __future__ import annotations

from typing import Any

from fleet.errors import BadInput, PayloadError

INT32 = 2**31 - 1  # an id the store numbers (dead letters, messages)
INT64 = 2**63 - 1  # a count the store keeps (tokens, budgets)
# JSON nesting: far above any real payload, far below the interpreter's recursion limit
# wherever a value is decoded again (a worker's replay runs some frames deep already).
MAX_DEPTH = 200


def whole(value: Any, what: str, *, low: int = 0, high: int = INT64) -> int:
    """``value`` (an int, or its decimal text) as an int in ``[low, high]``; ``BadInput``
    naming ``what`` otherwise. Text must be plain ASCII digits (an optional minus):
    no ``1e3``, no ``٣``, no underscores."""
    if isinstance(value, bool):
        raise BadInput(f"{what} must be a whole number, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text.startswith("-") else text
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 30:
            raise BadInput(f"{what} must be a whole number, got {value!r}")
        value = int(text)
    if not isinstance(value, int):
        raise BadInput(f"{what} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise BadInput(f"{what} must be between {low} and {high}, got {value}")
    return value


def check_depth(value: Any, what: str, limit: int = MAX_DEPTH) -> None:
    """``PayloadError`` naming ``what`` if ``value`` nests lists and dicts more than
    ``limit`` deep. Iterative: a value of any depth is measured without recursing."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            raise PayloadError(f"{what} nests more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children)
