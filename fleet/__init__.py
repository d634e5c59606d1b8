"""fleet: durable execution for long, multi-step agent runs on a Celery worker fleet."""

from fleet import _pool_patch  # noqa: F401 - first: `fleet worker --pool gevent` patches early
from fleet.app import Fleet, RunHandle
from fleet.config import Settings
from fleet.errors import (
    BadInput,
    ChildFailed,
    FleetError,
    NonDeterminism,
    NonRetryable,
    PayloadError,
    Retry,
    RunFailed,
    StepFailed,
    StoreUnavailable,
    UnknownRun,
    UnknownWorkflow,
    WaitNotOpen,
    WaitTimeout,
)
from fleet.policy import RetryPolicy
from fleet.records import DeadLetterInfo, StepInfo, WaitInfo
from fleet.secrets import Secret
from fleet.worker.context import LeaseLost, StepContext
from fleet.worker.workflow import WorkflowContext

__all__ = [
    "BadInput",
    "ChildFailed",
    "DeadLetterInfo",
    "Fleet",
    "FleetError",
    "LeaseLost",
    "NonDeterminism",
    "NonRetryable",
    "PayloadError",
    "Retry",
    "RetryPolicy",
    "RunFailed",
    "RunHandle",
    "Secret",
    "Settings",
    "StepContext",
    "StepFailed",
    "StepInfo",
    "StoreUnavailable",
    "UnknownRun",
    "UnknownWorkflow",
    "WaitInfo",
    "WaitNotOpen",
    "WaitTimeout",
    "WorkflowContext",
]
