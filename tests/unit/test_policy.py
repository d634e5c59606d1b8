from __future__ import annotations

import random

import pytest

from fleet import NonRetryable, Retry, RetryPolicy
from fleet.errors import PayloadError
from fleet.policy import Verdict, classify


def test_backoff_is_exponential_and_capped() -> None:
    p = RetryPolicy(max_attempts=10, initial_delay=1.0, backoff=2.0, max_delay=5.0, jitter=False)
    assert [p.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_full_jitter_draws_across_zero_to_the_cap() -> None:
    p = RetryPolicy(initial_delay=1.0, backoff=2.0, max_delay=60.0, jitter=True)
    rng = random.Random(7)
    draws = [p.delay(3, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 4.0 for d in draws)
    assert min(draws) < 0.2 and max(draws) > 3.8, "the whole [0, cap] range is used"


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert RetryPolicy(max_delay=30.0, jitter=False).delay(10_000) == 30.0


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"backoff": 0.5}, {"initial_delay": -1}])
def test_nonsense_policies_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def _classify(exc: BaseException, attempt: int = 1, non_retryable: tuple = ()) -> tuple:
    p = RetryPolicy(max_attempts=3, initial_delay=1.0, jitter=False)
    return classify(exc, attempt=attempt, policy=p, non_retryable=non_retryable, max_attempts=3)


def test_classification() -> None:
    assert _classify(TimeoutError()) == (Verdict.RETRY, 1.0)
    assert _classify(TimeoutError(), attempt=2) == (Verdict.RETRY, 2.0)
    assert _classify(TimeoutError(), attempt=3)[0] is Verdict.EXHAUSTED
    assert _classify(NonRetryable("bad request"))[0] is Verdict.NON_RETRYABLE
    assert _classify(PayloadError("too big"))[0] is Verdict.NON_RETRYABLE
    assert (
        _classify(PermissionError(), non_retryable=(PermissionError,))[0] is Verdict.NON_RETRYABLE
    )
    assert _classify(Retry(delay=7.5)) == (Verdict.RETRY, 7.5)
    assert _classify(Retry(delay=7.5), attempt=3)[0] is Verdict.EXHAUSTED, "Retry counts too"
