"""Retry policy as data, and the classification of a step's failure."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from fleet.errors import NonRetryable, PayloadError, Retry


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter and a durable attempt cap.

    The n-th retry (n = 1, 2, …) waits ``min(max_delay, initial_delay * backoff**(n-1))``
    seconds, or with ``jitter`` a uniform draw in ``[0, that]`` (full jitter: retries of
    many runs spread out instead of arriving together at a throttled provider).
    ``max_attempts`` counts every attempt, crashed ones included.
    """

    max_attempts: int = 3
    initial_delay: float = 1.0
    backoff: float = 2.0
    max_delay: float = 60.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_delay < 0 or self.max_delay < 0 or self.backoff < 1:
            raise ValueError("delays must be non-negative and backoff at least 1")

    def cap(self, retry_number: int) -> float:
        """The delay's upper bound before the ``retry_number``-th retry (1-based)."""
        exponent = max(retry_number - 1, 0)
        # Cap the exponent so a long-lived step cannot overflow the float.
        return min(self.max_delay, self.initial_delay * self.backoff ** min(exponent, 64))

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        cap = self.cap(retry_number)
        if not self.jitter:
            return cap
        return (rng or random).uniform(0.0, cap)


class Verdict(StrEnum):
    RETRY = "retry"
    NON_RETRYABLE = "non-retryable"  # dead-lettered at once
    EXHAUSTED = "attempt cap reached"  # dead-lettered after max_attempts


def classify(
    exc: BaseException,
    *,
    attempt: int,
    policy: RetryPolicy,
    non_retryable: tuple[type[BaseException], ...],
    max_attempts: int,
) -> tuple[Verdict, float]:
    """What to do after a failed attempt: retry after a delay, or dead-letter now."""
    if isinstance(exc, (NonRetryable, PayloadError, *non_retryable)):
        return Verdict.NON_RETRYABLE, 0.0
    if attempt >= max_attempts:
        return Verdict.EXHAUSTED, 0.0
    if isinstance(exc, Retry) and exc.delay is not None:
        return Verdict.RETRY, max(0.0, exc.delay)
    return Verdict.RETRY, policy.delay(attempt)
