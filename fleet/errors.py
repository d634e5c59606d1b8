"""The exception tree: one root, retryable versus fatal visible in the type.

User-facing errors (``StepFailed``, ``RunFailed``) and the two a step may raise on
purpose (``NonRetryable``, ``Retry``) are re-exported from ``fleet``.
"""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error fleet raises."""


class BadInput(FleetError):
    """The caller gave something fleet cannot accept (CLI exit code 2)."""


class UnknownWorkflow(BadInput):
    pass


class UnknownRun(BadInput):
    pass


class PayloadError(BadInput):
    """A value is not JSON, or is larger than the configured limit."""


class StoreUnavailable(FleetError):
    """The database cannot be reached or has no schema; the driver error is ``__cause__``."""


class NonDeterminism(FleetError):
    """A replay asked for a different step sequence than the one recorded."""


class NonRetryable(FleetError):
    """Raised by a step: do not retry, dead-letter at once (bad input, permission denied)."""


class Retry(FleetError):
    """Raised by a step to ask for another attempt; counts against the same durable cap.
    With ``limit`` (a ``fleet.limit``'s name: the provider answered 429), that limit is
    paused for everyone for ``delay`` seconds."""

    def __init__(
        self, delay: float | None = None, reason: str = "", limit: str | None = None
    ) -> None:
        super().__init__(reason or "step asked for a retry")
        self.delay = delay
        self.limit = limit


class StepFailed(FleetError):
    """Raised inside a workflow where a dead step is awaited. It may be caught."""

    def __init__(self, step_id: str, error: str, attempts: int = 0) -> None:
        super().__init__(f"step {step_id} failed after {attempts} attempt(s): {error}")
        self.step_id = step_id
        self.error = error
        self.attempts = attempts


class ChildFailed(StepFailed):
    """Raised inside a workflow where a child run (``wf.child``, ``ChildHandle.result``)
    that failed or was cancelled is awaited: ``error`` names the child run and why."""

    def __init__(self, step_id: str, error: str, attempts: int = 0) -> None:
        super().__init__(step_id, error, attempts)
        self.args = (f"child {step_id} failed: {error}",)


class RunFailed(FleetError):
    """Raised by ``RunHandle.wait`` when the run ended without a result."""

    def __init__(self, run_id: str, status: str, error: str | None) -> None:
        super().__init__(f"run {run_id} {status}: {error or 'no error recorded'}")
        self.run_id = run_id
        self.status = status
        self.error = error


class WaitNotOpen(BadInput):
    """``Fleet.signal(..., wait_id=...)`` named a wait that is not open (already
    answered, timed out, another signal's, or its run ended): nothing was recorded."""


class WaitTimeout(FleetError, TimeoutError):
    """``RunHandle.wait`` ran out of time; the run goes on."""


class BranchesFailed(StepFailed):
    """Raised by ``wf.map`` / ``wf.parallel`` when more than one branch is dead, once every
    branch has settled: it names them all; ``failures`` holds each branch's own
    ``StepFailed`` (or ``ChildFailed``), the first is also its ``__cause__``."""

    def __init__(self, failures: list[StepFailed]) -> None:
        first = failures[0]
        super().__init__(first.step_id, first.error, first.attempts)
        self.failures = failures
        names = ", ".join(f.step_id for f in failures)
        self.args = (f"{len(failures)} branches failed ({names}); the first: {first}",)


class LimitExceeded(BadInput):
    """A run asked for more than a fleet-wide limit allows (``FLEET_MAX_FANOUT`` branches
    in one fan-out, ``FLEET_MAX_STEPS`` steps in one run): the run fails with one line."""
