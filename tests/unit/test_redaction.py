"""Redaction: the values of the secrets an attempt used are masked in what it records
and in every log line written meanwhile (the worker path is in
tests/integration/test_secrets_hostile.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from fleet import Secret
from fleet.logs import setup_logging
from fleet.secrets import MASK, current_redactor, redacting

VALUE = "sk-live-'quoted'\\and-ü"


def test_revealed_and_watched_values_are_masked_in_every_spelling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MAIL_API_KEY", VALUE)
    monkeypatch.setenv("OTHER_KEY", "other-value")
    Secret.env("OTHER_KEY").reveal()  # outside any attempt: nothing collects it
    with redacting() as redact:
        assert redact(VALUE) == VALUE, "nothing used yet"
        redact.watch(([{"deep": [Secret.env("MAIL_API_KEY")]}], {}))
        text = f"raw {VALUE} repr {VALUE!r} other-value"
        assert redact(text) == f'raw {MASK} repr "{MASK}" other-value'
        Secret.env("OTHER_KEY").reveal()
        assert redact("other-value") == MASK
    assert current_redactor() is None


def test_values_too_short_to_mask_are_left_alone() -> None:
    with redacting() as redact:
        Secret("abc").reveal()
        assert redact("abc def") == "abc def"


def test_a_nested_replay_masks_what_its_attempt_used() -> None:
    with redacting() as outer:
        Secret("outer-secret").reveal()
        with redacting() as inner:
            Secret("inner-secret").reveal()
            assert inner("outer-secret inner-secret") == f"{MASK} {MASK}"
        assert outer("inner-secret") == "inner-secret"


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_lines_and_tracebacks_are_masked_whoever_logs_them(
    root_logging: None, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    setup_logging("INFO", fmt)
    user_log = logging.getLogger("myapp.steps")
    with redacting():
        value = Secret(VALUE).reveal()
        user_log.warning("calling with %s", value)
        try:
            raise ValueError(f"refused {value!r}")
        except ValueError:
            user_log.exception("step failed")
    user_log.warning("after the attempt: %s", "nothing to mask")
    err = capsys.readouterr().err
    assert "calling with" in err and "refused" in err and "after the attempt" in err
    assert VALUE not in err and repr(VALUE)[1:-1] not in err
    assert err.count(MASK) >= 2
