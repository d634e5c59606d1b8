"""fleet: durable execution for long, multi-step agent runs on a Celery worker fleet."""

from fleet.app import Fleet, RunHandle
from fleet.attempt import LeaseLost, StepContext
from fleet.config import Settings
from fleet.errors import (
    BadInput,
    FleetError,
    NonDeterminism,
    NonRetryable,
    Retry,
    RunFailed,
    StepFailed,
    StoreUnavailable,
    UnknownRun,
    UnknownWorkflow,
    WaitTimeout,
)
from fleet.policy import RetryPolicy
from fleet.records import DeadLetterInfo, StepInfo
from fleet.replay import WorkflowContext

__all__ = [
    "BadInput",
    "DeadLetterInfo",
    "Fleet",
    "FleetError",
    "LeaseLost",
    "NonDeterminism",
    "NonRetryable",
    "Retry",
    "RetryPolicy",
    "RunFailed",
    "RunHandle",
    "Settings",
    "StepContext",
    "StepFailed",
    "StepInfo",
    "StoreUnavailable",
    "UnknownRun",
    "UnknownWorkflow",
    "WaitTimeout",
    "WorkflowContext",
]
