"""``Secret``: a value a step may use that fleet never writes to the store, its logs or
broker messages.

A run is replayed and its steps retried on any worker, so a step's input must be
recorded; a secret cannot be. What is recorded is the secret's *name*
(``Secret.env("MAIL_API_KEY")``), and each worker reads the value from its own
environment when the step runs. A ``Secret`` holding a literal value can be passed
around inside a step, but recording it (as an input, output or signal) is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, NoReturn

from fleet.errors import NonRetryable, PayloadError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
MARKER = "$fleet_secret"


class Secret:
    __slots__ = ("_name", "_value")

    def __init__(self, value: str) -> None:
        self._name: str | None = None
        self._value: str | None = value

    @classmethod
    def env(cls, name: str) -> Secret:
        """A secret read from the environment variable ``name`` of the worker that uses it."""
        if not _NAME.match(name):
            raise PayloadError(f"secret name {name!r} is not an environment variable name")
        secret = cls.__new__(cls)
        secret._name, secret._value = name, None
        return secret

    @property
    def name(self) -> str | None:
        return self._name

    def reveal(self) -> str:
        """The value, for the step that needs it. Never log or return it."""
        if self._value is not None:
            return self._value
        assert self._name is not None
        value = os.environ.get(self._name)
        if value is None:
            raise NonRetryable(f"secret {self._name} is not set in this worker's environment")
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
    if len(obj) == 1 and MARKER in obj:
        return Secret.env(obj[MARKER])
    return obj
