"""JSON in and out of the store: strict, bounded, never pickle; user JSON round-trips
exactly.

The objects fleet reads specially are its markers: a secret (``{"$fleet_secret":
name}``) and a transcript cursor (``{"$fleet_transcript": {...}}``, fleet/transcripts.py).
So that user data can never be taken for one, every dict key of a recorded value that
begins with ``$`` gets one more ``$`` on the way in (``"$x"`` is recorded as ``"$$x"``)
and loses it on the way out. The only single-``$`` keys fleet writes are its
markers; a single-``$`` key in a row written before this rule is read as it stands.
Both directions take the plain, fast path unless the text holds ``"$`` (``encode``
writes "$" as it is, never as ``\\u0024``, so no key can hide from that).
"""

from __future__ import annotations

import json
from typing import Any

from fleet import secrets, transcripts
from fleet.bounds import MAX_DEPTH, check_depth
from fleet.errors import PayloadError


def encode(value: Any, *, what: str, limit: int) -> str:
    """Serialise ``value`` as strict JSON no larger than ``limit`` bytes.

    ``what`` names the value in the error ("argument 2 of research", "output of answer#3").
    A ``Secret`` is recorded by its name only, never its value. A value nested more
    than ``bounds.MAX_DEPTH`` deep is refused: a worker could not decode it again.
    """
    try:
        text = _dumps(value, what)
        if _may_hold_dollar_key(text):  # or a secret was recorded: escape
            text = _dumps(_escaped(value), what)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"{what} is not JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise PayloadError(f"{what} is nested too deeply to record") from None
    size = len(text.encode())
    if size > limit:
        raise PayloadError(f"{what} is {size} bytes, over the {limit}-byte payload limit")
    if text.count("[") + text.count("{") > MAX_DEPTH:  # else it cannot nest that deep
        check_depth(value, what)
    return text


def decode(text: str | None) -> Any:
    """The value of a recorded JSON text; secrets come back as ``Secret.env(name)``.
    A text that cannot be loaded (not JSON, a marker with a bad name) raises
    ``PayloadError``."""
    if text is None:
        return None
    try:
        if not _may_hold_dollar_key(text):
            return json.loads(text)
        return json.loads(text, object_hook=_unescaped)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise PayloadError(f"recorded value is not valid JSON: {exc}") from None


def parse_json_arg(raw: str, *, what: str) -> Any:
    """Parse a JSON value given on the command line or in a form, naming it in the
    error: not JSON, an integer of thousands of digits, or nested more than
    ``bounds.MAX_DEPTH`` deep is a ``PayloadError`` of one line."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        shown = raw if len(raw) <= 80 else raw[:77] + "..."
        raise PayloadError(
            f"{what} is not JSON ({exc.msg} at column {exc.colno}): {shown!r}"
        ) from None
    except RecursionError:
        raise PayloadError(f"{what} nests more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # int() of thousands of digits
        raise PayloadError(f"{what} is not JSON fleet can keep: {str(exc).split(';')[0]}") from None
    check_depth(value, what)
    return value


def _may_hold_dollar_key(text: str) -> bool:
    # A one-character search is a memchr, many times faster than the two-character
    # one, and most texts hold no "$" at all.
    return "$" in text and '"$' in text


def _dumps(value: Any, what: str) -> str:
    return json.dumps(
        value,
        allow_nan=False,
        separators=(",", ":"),
        ensure_ascii=False,
        default=lambda v: _marker(v, what),
    )


def _marker(value: Any, what: str) -> Any:
    """The one non-JSON values a record may hold: a transcript cursor, a secret."""
    cursor = transcripts.to_json(value)
    return cursor if cursor is not None else secrets.to_json(value, what)


def _escaped(value: Any) -> Any:
    """``value`` with one more "$" on each dict key that begins with "$". Secrets are
    left in place: ``json.dumps`` writes their markers after this walk. (Plain loops,
    one frame a level: as deep as ``json.dumps`` itself goes.)"""
    if isinstance(value, dict):
        copy = {}
        for k, v in value.items():
            copy["$" + k if isinstance(k, str) and k.startswith("$") else k] = _escaped(v)
        return copy
    if isinstance(value, (list, tuple)):
        items = []
        for v in value:
            items.append(_escaped(v))
        return items
    return value


def _unescaped(obj: dict[str, Any]) -> Any:
    """One decoded JSON object: a marker becomes its Secret; "$$x" keys become "$x"."""
    if len(obj) == 1 and secrets.MARKER in obj:
        return secrets.from_json(obj)
    if len(obj) == 1 and transcripts.MARKER in obj:
        return transcripts.from_json(obj)
    if any(k.startswith("$$") for k in obj):
        return {k[1:] if k.startswith("$$") else k: v for k, v in obj.items()}
    return obj
