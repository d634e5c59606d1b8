"""JSON in and out of the store: strict, bounded, never pickle."""

from __future__ import annotations

import json
from typing import Any

from fleet import secrets
from fleet.errors import PayloadError


def encode(value: Any, *, what: str, limit: int) -> str:
    """Serialise ``value`` as strict JSON no larger than ``limit`` bytes.

    ``what`` names the value in the error ("argument 2 of research", "output of answer#3").
    A ``Secret`` is recorded by its name only, never its value.
    """
    try:
        text = json.dumps(
            value,
            allow_nan=False,
            separators=(",", ":"),
            ensure_ascii=False,
            default=lambda v: secrets.to_json(v, what),
        )
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"{what} is not JSON-serialisable: {exc}") from exc
    size = len(text.encode())
    if size > limit:
        raise PayloadError(f"{what} is {size} bytes, over the {limit}-byte payload limit")
    return text


def decode(text: str | None) -> Any:
    """The value of a recorded JSON text; secrets come back as ``Secret.env(name)``."""
    return None if text is None else json.loads(text, object_hook=secrets.from_json)


def parse_json_arg(raw: str, *, what: str) -> Any:
    """Parse a JSON value given on the command line, naming it in the error."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PayloadError(
            f"{what} is not JSON ({exc.msg} at column {exc.colno}): {raw!r}"
        ) from None
