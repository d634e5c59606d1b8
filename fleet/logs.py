"""Logging: human-readable by default, one JSON object per line with
``FLEET_LOG_FORMAT=json``. Engine lines carry the run id, step id, epoch and attempt
they concern (set with ``log_context`` where a run or a lease is taken up). Every line,
whoever logs it, has the values of the secrets the current attempt used masked."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from fleet.secrets import current_redactor

FIELDS = ("run_id", "step_id", "epoch", "attempt")
# Read-only mapping default: log_context always sets a new dict, never mutates one.
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "fleet_log", default=MappingProxyType({})
)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Attach ``fields`` (run_id, step_id, epoch, attempt) to every line logged inside."""
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            setattr(record, key, value)
        return True


class _RedactFilter(logging.Filter):
    """Masks the values of the secrets the running attempt or replay has used (see
    ``fleet.secrets.redacting``) in the line and its traceback: fleet's own lines, and
    those a step or Celery logs meanwhile."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        redact = current_redactor()
        if redact is None or not redact.spellings():
            return True
        try:
            message = record.getMessage()
        except Exception:  # bad arguments: the handler reports those itself
            return True
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "process": record.process,
            "message": record.getMessage(),
        }
        for key in FIELDS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            # exc_text if set: the traceback as _RedactFilter left it.
            entry["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"
        )

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = [f"{k}={getattr(record, k)}" for k in FIELDS if hasattr(record, k)]
        return f"{line} [{' '.join(tags)}]" if tags else line


def setup_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """Configure the root logger once, at the edge (a worker, the sweeper, the exporter),
    in ``fmt`` (``Settings.log_format``; unset: ``FLEET_LOG_FORMAT``, else text)."""
    fmt = (fmt or os.environ.get("FLEET_LOG_FORMAT") or "text").lower()
    if fmt not in ("text", "json"):  # Settings refuses it first, at the edge
        from fleet.errors import BadInput

        raise BadInput(f"FLEET_LOG_FORMAT={fmt!r} must be one of: text, json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    handler.addFilter(_RedactFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
