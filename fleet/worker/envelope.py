"""What a message must look like before Celery sees it, and what becomes of one that
does not.

The rule: a worker survives any bytes on its queues. A message on one of fleet's task
queues is fleet's only if it is a kombu envelope whose base64 body is the JSON
``[args, kwargs, embed]`` of one of fleet's two tasks, its arguments the right number
of printable ids within the store's limits, with no keyword arguments, no callbacks
and only the headers Celery itself writes (a header such as ``chain`` or ``timelimit``
would make Celery act on it). A message on a Celery control queue (remote control,
events) need only be an envelope kombu can read; Celery checks the rest. Anything
else is never delivered: it is acked, set aside once in the store's dead-message list
and logged in one clipped line (``fleet.brokers`` does that), and the worker goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from fleet.store.schema import runs, steps
from fleet.worker.dispatch import ADVANCE, EXECUTE

# The transport option through which a channel reaches the store: a callable
# ``(queue, reason, raw) -> id`` (``Ledger.set_aside_message``), set by ``make_celery``.
SINK_OPTION = "fleet_dead_messages"

MAX_RUN_ID: int = runs.c.id.type.length
MAX_STEP_ID: int = steps.c.step_id.type.length
# The ids each task takes, by the longest each may be.
TASK_IDS: dict[str, tuple[int, ...]] = {ADVANCE: (MAX_RUN_ID,), EXECUTE: (MAX_RUN_ID, MAX_STEP_ID)}

# Longest text a header may hold: a Celery task id is 36 characters, ``argsrepr`` is
# cut by Celery at 1024, a shadow name is a workflow and a step name, or a queue.
_SHORT, _LONG = 255, 2048


class Malformed(ValueError):
    """The message is not one fleet can take; the text says what was wrong."""


def is_control_queue(queue: str) -> bool:
    """Celery's remote-control (``*.pidbox``) and event (``celeryev.*``) queues."""
    return queue.endswith(".pidbox") or queue.startswith("celeryev.")


def check(queue: str, raw: Any) -> None:
    """Raise ``Malformed`` unless ``raw`` (the decoded envelope) may go to Celery."""
    if is_control_queue(queue):
        check_control(raw)
    else:
        check_task(raw)


def check_control(raw: Any) -> None:
    props = _properties(raw)
    if not isinstance(raw.get("body"), str | None):
        raise Malformed(f"body is a JSON {type(raw.get('body')).__name__}, not text")
    if props.get("body_encoding") not in (None, "utf-8", "base64"):
        raise Malformed(f"unknown body_encoding {_show(props.get('body_encoding'))}")
    if props.get("body_encoding") == "base64":
        _unbase64(raw.get("body"))
    if not isinstance(raw.get("headers"), dict | None):
        raise Malformed("headers are not an object")


def check_task(raw: Any) -> None:
    props = _properties(raw)
    if raw.get("content-type") != "application/json":
        raise Malformed(f"content-type {_show(raw.get('content-type'))}, not application/json")
    if raw.get("content-encoding") != "utf-8":
        raise Malformed(f"content-encoding {_show(raw.get('content-encoding'))}, not utf-8")
    if props.get("body_encoding") != "base64":
        raise Malformed(f"body_encoding {_show(props.get('body_encoding'))}, not base64")
    task = _check_headers(raw.get("headers"))
    text = _unbase64(raw.get("body"))
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"body is not JSON ({_show(str(exc))})") from None
    _check_body(task, body)


def _properties(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise Malformed(f"not a message envelope: a JSON {type(raw).__name__}")
    props = raw.get("properties")
    if not isinstance(props, dict):
        raise Malformed("envelope without properties")
    tag = props.get("delivery_tag")
    if not isinstance(tag, str) or not tag or len(tag) > _SHORT:
        raise Malformed(f"bad delivery_tag {_show(tag)}")
    info = props.get("delivery_info", {})
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k, ""), str | None) for k in ("exchange", "routing_key")
    ):
        raise Malformed(f"bad delivery_info {_show(info)}")
    priority = props.get("priority")
    if priority is not None and not (_is_int(priority) and 0 <= priority <= 255):
        raise Malformed(f"bad priority {_show(priority)}")
    return props


def _unbase64(body: Any) -> str:
    if not isinstance(body, str):
        raise Malformed(f"body is a JSON {type(body).__name__}, not base64 text")
    try:
        return base64.b64decode(body, validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:
        raise Malformed(f"body is not base64 of UTF-8 text ({_show(str(exc))})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(limit: int) -> Any:
    return lambda v: isinstance(v, str) and len(v) <= limit and v.isprintable()


def _optional(test: Any) -> Any:
    return lambda v: v is None or test(v)


def _iso_time(value: Any) -> bool:
    if not (isinstance(value, str) and len(value) <= 64):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


# Every header Celery writes on a task message (protocol 2), and what it may hold.
# No other is accepted: Celery copies headers into the task's request, where one named
# ``chain`` or ``callbacks`` would start other tasks.
_HEADERS: dict[str, Any] = {
    "lang": _text(20),
    "task": lambda v: isinstance(v, str) and v in TASK_IDS,
    "id": lambda v: _text(_SHORT)(v) and bool(v),
    "shadow": _optional(_text(_LONG)),
    "eta": _optional(_iso_time),
    "expires": _optional(_iso_time),
    "group": _optional(_text(_SHORT)),
    "group_index": _optional(_is_int),
    "retries": lambda v: _is_int(v) and 0 <= v < 1_000_000,
    "timelimit": lambda v: v is None or (isinstance(v, list) and v == [None, None]),
    "root_id": _optional(_text(_SHORT)),
    "parent_id": _optional(_text(_SHORT)),
    "argsrepr": _optional(_text(_LONG)),
    "kwargsrepr": _optional(_text(_LONG)),
    "origin": _optional(_text(_LONG)),
    "ignore_result": lambda v: v is None or isinstance(v, bool),
    "replaced_task_nesting": lambda v: _is_int(v) and 0 <= v < 1000,
    "stamped_headers": lambda v: v is None or v == [],
    "stamps": lambda v: v is None or v == {},
    "redelivered": lambda v: isinstance(v, bool),  # kombu's Redis restore adds it
}


def _check_headers(headers: Any) -> str:
    if not isinstance(headers, dict):
        raise Malformed("headers are not an object")
    for key in ("task", "id"):
        if key not in headers:
            raise Malformed(f"no {key} header")
    for key, value in headers.items():
        test = _HEADERS.get(key)
        if test is None:
            raise Malformed(f"unexpected header {_show(key)}")
        if not test(value):
            raise Malformed(f"bad {key} header {_show(value)}")
    return str(headers["task"])


def check_ids(task: str, args: Sequence[Any]) -> None:
    """Raise ``Malformed`` unless ``args`` are the ids ``task`` takes: the right number,
    each a non-empty printable string within the store's limit for it."""
    limits = TASK_IDS[task]
    if len(args) != len(limits):
        raise Malformed(f"{task} takes {len(limits)} id(s), got {_show(args)}")
    for arg, limit in zip(args, limits, strict=True):
        if not isinstance(arg, str) or not arg or not arg.isprintable():
            raise Malformed(f"{task} argument {_show(arg)} is not a printable id")
        if len(arg) > limit:
            raise Malformed(f"{task} id of {len(arg)} characters (at most {limit}): {_show(arg)}")


def _check_body(task: str, body: Any) -> None:
    if not (isinstance(body, list) and len(body) == 3):
        raise Malformed(f"body is not [args, kwargs, embed]: {_show(body)}")
    args, kwargs, embed = body
    if not isinstance(args, list):
        raise Malformed(f"{task} takes a list of ids, got {_show(args)}")
    check_ids(task, args)
    if kwargs != {}:
        raise Malformed(f"{task} takes no keyword arguments, got {_show(kwargs)}")
    # Celery's own embed: callbacks, errbacks, chain and chord, all empty for fleet.
    if not isinstance(embed, dict) or any(
        k not in ("callbacks", "errbacks", "chain", "chord") or v is not None
        for k, v in embed.items()
    ):
        raise Malformed(f"embed must hold no callbacks, got {_show(embed)}")


def _show(value: Any, limit: int = 80) -> str:
    """A value as one short line of text (a message may hold megabytes)."""
    try:
        text = repr(value)
    except Exception:  # a deeply nested value: its type is enough
        text = f"<{type(value).__name__}>"
    return one_line(text, limit)


def one_line(text: str, limit: int = 200) -> str:
    """``text`` clipped to ``limit`` characters, newlines and control characters escaped,
    so a log line stays one line whatever a message held."""
    head = text[:limit]
    safe = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in head)
    return safe + (f"… ({len(text)} characters)" if len(text) > limit else "")


def as_text(raw: Any) -> str:
    """The raw message as text to store: bytes as UTF-8 (bad bytes escaped), a decoded
    envelope as JSON (pure ASCII: lone surrogates and NULs come out escaped)."""
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "backslashreplace")
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw, default=repr)
    except (ValueError, TypeError, RecursionError):
        return _show(raw, 10_000)
