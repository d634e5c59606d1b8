"""``Secret``: a value a step may use that fleet never writes to the store, its logs or
broker messages.

A run is replayed and its steps retried on any worker, so a step's input must be
recorded; a secret cannot be. What is recorded is the secret's *name*
(``Secret.env("MAIL_API_KEY")``), and each worker reads the value from its own
environment when the step runs. A ``Secret`` holding a literal value can be passed
around inside a step, but recording it (as an input, output or signal) is refused.

A step may still quote a value it revealed in an exception. So an attempt (and a
replay) runs inside ``redacting()``: the values revealed meanwhile, and those of the
``Secret.env`` names in its input, are masked in every error text fleet records or
logs for it (``Redactor``; the log handler masks through ``current_redactor``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

from fleet.errors import NonRetryable, PayloadError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
MARKER = "$fleet_secret"
MASK = "********"
# Shorter values are left as they are: masking every "ab" or "1" in a traceback would
# wreck it, and the pattern of masks would point at the value besides.
MIN_MASKED = 4


class Secret:
    __slots__ = ("_name", "_value")

    def __init__(self, value: str) -> None:
        self._name: str | None = None
        self._value: str | None = value

    @classmethod
    def env(cls, name: str) -> Secret:
        """A secret read from the environment variable ``name`` of the worker that uses it."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise PayloadError(f"secret name {name!r} is not an environment variable name")
        secret: Secret = cls.__new__(cls)
        secret._name, secret._value = name, None
        return secret

    @property
    def name(self) -> str | None:
        return self._name

    def peek(self) -> str | None:
        """The value, to mask it, not to use it (no redactor is told; None if unset)."""
        return self._value if self._name is None else os.environ.get(self._name)

    def reveal(self) -> str:
        """The value, for the step that needs it. Never log or return it."""
        if self._value is not None:
            value = self._value
        else:
            assert self._name is not None
            found = os.environ.get(self._name)
            if found is None:
                raise NonRetryable(f"secret {self._name} is not set in this worker's environment")
            value = found
        redactor = _current.get()
        if redactor is not None:
            redactor.add(value)
        return value

    def __repr__(self) -> str:
        return f"Secret.env({self._name!r})" if self._name else "Secret('********')"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Secret cannot be pickled")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and (self._name, self._value) == (
            other._name,
            other._value,
        )

    def __hash__(self) -> int:
        return hash((self._name, self._value))


def to_json(value: Any, what: str) -> dict[str, str]:
    """How a Secret is recorded: by name only."""
    if isinstance(value, Secret):
        if value.name is None:
            raise PayloadError(
                f"{what} holds a Secret with a literal value, which fleet never records: "
                "pass Secret.env('NAME') so each worker reads it from its environment"
            )
        return {MARKER: value.name}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def from_json(obj: dict[str, Any]) -> Any:
    """A recorded marker back as its ``Secret.env``; any other object as it is. A marker
    with a bad name raises ``PayloadError`` (a corrupt row: never run on a guess)."""
    if len(obj) == 1 and MARKER in obj:
        return Secret.env(obj[MARKER])
    return obj


# --- redaction ------------------------------------------------------------------------

# The redactor of the attempt or replay running in this context, if any.
_current: ContextVar[Redactor | None] = ContextVar("fleet_redactor", default=None)


class Redactor:
    """The secret values one attempt or replay has used, and the masking of them.

    Callable: ``redactor(text)`` is ``text`` with each such value (at least
    ``MIN_MASKED`` characters) replaced by ``MASK``, also as ``repr`` and JSON spell it
    inside quotes. A nested redactor (a replay run from inside a failed attempt) masks
    its parent's values too."""

    def __init__(self, parent: Redactor | None = None) -> None:
        self._parent = parent
        self._revealed: set[str] = set()
        self._watched: list[Any] = []
        self._own: list[str] | None = None  # the spellings to mask, longest first; cached

    def add(self, value: str) -> None:
        """A value revealed in this attempt."""
        if value not in self._revealed:
            self._revealed.add(value)
            self._own = None

    def revealed(self) -> frozenset[str]:
        """The values revealed in this attempt or replay (a live workflow carries them
        to its later advances, which do not run the code that revealed them again)."""
        return frozenset(self._revealed)

    def watch(self, value: Any) -> None:
        """Also mask the values of the secrets held in ``value`` (an input): read from
        this process's environment only when a text is masked, which most attempts
        never need."""
        self._watched.append(value)
        self._own = None

    def spellings(self) -> list[str]:
        """Every text to mask, longest first (so a value inside another goes with it)."""
        if self._own is None:
            values = set(self._revealed)
            for watched in self._watched:
                values.update(_held_values(watched))
            self._own = _spelled(values)
        if self._parent is None:
            return self._own
        return sorted({*self._own, *self._parent.spellings()}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for spelling in self.spellings():
            if spelling in text:
                text = text.replace(spelling, MASK)
        return text


@contextmanager
def redacting() -> Iterator[Redactor]:
    """Collect the secret values used inside (revealed, or held by a watched input) so
    the error texts and log lines written meanwhile can be masked."""
    redactor = Redactor(_current.get())
    token = _current.set(redactor)
    try:
        yield redactor
    finally:
        _current.reset(token)


def current_redactor() -> Redactor | None:
    """The redactor of the attempt or replay running in this context (the log handler's)."""
    return _current.get()


def _spelled(values: set[str]) -> list[str]:
    spellings: set[str] = set()
    for value in values:
        if len(value) >= MIN_MASKED:
            # As written, as repr() quotes it (KeyError('…')) and as JSON does.
            spellings.update(
                (
                    value,
                    repr(value)[1:-1],
                    json.dumps(value)[1:-1],
                    json.dumps(value, ensure_ascii=False)[1:-1],
                )
            )
    return sorted(spellings, key=len, reverse=True)


def _held_values(value: Any) -> Iterator[str]:
    """The values of the Secrets inside ``value`` (walked without recursion: a decoded
    input may be nested as deep as JSON allows)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Secret):
            found = item.peek()
            if found is not None:
                yield found
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
