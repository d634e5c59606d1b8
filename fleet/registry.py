"""Workflow and step definitions, and the registry a Fleet keeps of them."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet import codec
from fleet.bounds import INT64
from fleet.errors import BadInput, UnknownWorkflow
from fleet.limits import Limit
from fleet.policy import RetryPolicy

MAX_NAME = 200
# A workflow's name and version make its queue's name (``WorkflowDef.queue``), which
# every supported broker must carry: Celery's filesystem transport names a file for it
# and takes only these characters (a space stops the worker: "Invalid exchange name"),
# RabbitMQ at most 255 bytes, Redis anything. With FLEET_QUEUE's at most 64
# (fleet.config), a queue's name is at most 64 + 1 + 128 + 2 + 32 + 9 = 236.
QUEUE_CHARS = re.compile(r"[A-Za-z0-9._-]+")
MAX_WORKFLOW_NAME = 128
MAX_VERSION = 32


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is declared to make a coroutine (``async def``, also behind
    ``functools.partial``, or an object whose ``__call__`` is). A sync function that
    returns one anyway (a decorator's wrapper) is found out at its first attempt, where
    its step fails naming it."""
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


@dataclass(eq=False)
class StepDef:
    """A registered step. Call it through ``wf.step(...)`` inside a workflow."""

    name: str
    fn: Callable[..., Any]
    retry: RetryPolicy
    non_retryable: tuple[type[BaseException], ...] = ()
    effect: bool = False
    idempotent: bool = False
    reconcile_fn: Callable[..., Any] | None = None
    # The fleet-wide limits it starts under (names of ``fleet.limit``s), and the tokens
    # it reserves in them, from its arguments (None: none until it reports usage).
    limits: tuple[str, ...] = ()
    tokens: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if inspect.isasyncgenfunction(self.fn):
            raise BadInput(
                f"step {self.name!r} is an async generator: a step returns one value; "
                "declare it `async def` and return it"
            )

    def reconcile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the function that asks the world whether an in-doubt effect happened
        (``async def`` or not, as the step may be)."""
        self.reconcile_fn = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"step {self.name!r} is durable: call it as wf.step({self.name}, ...) inside a workflow"
        )


@dataclass(eq=False)
class WorkflowDef:
    name: str
    fn: Callable[..., Any]
    version: str
    pins: Mapping[str, Any] = field(default_factory=dict)
    budget: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        # A replay calls the workflow from the top and must see every step it asks for
        # at once, in order, on the worker's thread: a coroutine would do neither.
        if is_async(self.fn) or inspect.isasyncgenfunction(self.fn):
            raise BadInput(
                f"workflow {self.name!r} is `async def`: a workflow is a plain function "
                "replayed deterministically; make its steps `async def` instead"
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"workflow {self.name!r} runs durably: start it with fleet.enqueue(...)")

    def encoded_pins(self) -> str:
        """Its pins as a run records them (JSON, at most 4 KiB): a run enqueued and a
        child run started by a parent record them the same way."""
        return codec.encode(dict(self.pins), what=f"pins of workflow {self.name}", limit=4096)

    def queue(self, base: str) -> str:
        """The queue its runs are routed to: one per version and pins, so a worker that
        has another version never sees them and an old worker can drain its own."""
        name = f"{base}.{self.name}.v{self.version}"
        if self.pins:
            blob = json.dumps(dict(self.pins), sort_keys=True, separators=(",", ":"))
            name += "-" + hashlib.sha256(blob.encode()).hexdigest()[:8]
        return name

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """``BadInput`` naming the workflow if its function cannot take these arguments
        (after its context): said at enqueue, before anything is recorded, not by a
        run that fails later."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable without one: nothing to check
            return
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise BadInput(
                f"workflow {self.name!r} cannot be called with these arguments: {exc}"
            ) from None

    def pinned_to(self, version: str, pins: Mapping[str, Any]) -> bool:
        return self.version == version and dict(self.pins) == dict(pins)


def check_budget(budget: Mapping[str, Any] | None) -> tuple[int | None, float | None]:
    """``{"tokens": N}`` and/or ``{"cost": X}`` → (tokens, cost); a clear error otherwise."""
    if budget is None:
        return None, None
    unknown = set(budget) - {"tokens", "cost"}
    if unknown or not budget:
        raise BadInput(f"budget {dict(budget)!r} must have 'tokens' and/or 'cost'")
    tokens, cost = budget.get("tokens"), budget.get("cost")
    for key, value in (("tokens", tokens), ("cost", cost)):
        # NaN compares false with everything: without isfinite it would pass as a limit
        # no spend ever reaches.
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise BadInput(f"budget {key} must be a positive finite number, got {value!r}")
    if tokens is not None and tokens != int(tokens):
        raise BadInput(f"budget tokens must be a whole number, got {tokens!r}")
    if tokens is not None and tokens > INT64:
        raise BadInput(f"budget tokens must be at most {INT64}, got {tokens!r}")
    if cost is not None and cost > 1e15:  # past this a float no longer counts cents
        raise BadInput(f"budget cost must be at most 1e15, got {cost!r}")
    return (None if tokens is None else int(tokens)), (None if cost is None else float(cost))


def check_limit_names(limits: Sequence[str], tokens: Callable[..., Any] | None) -> tuple[str, ...]:
    """A step's ``limits=``: a list of limit names (each checked as declared when the
    step is registered), and ``tokens=``: a callable or None."""
    if isinstance(limits, str) or not all(isinstance(n, str) for n in limits):
        raise BadInput(f"limits= takes a list of limit names, got {limits!r:.120}")
    if tokens is not None and not callable(tokens):
        raise BadInput(f"tokens= takes a function of the step's arguments, got {tokens!r:.80}")
    if tokens is not None and not limits:
        raise BadInput("tokens= reserves tokens in limits: name them with limits=[...]")
    return tuple(dict.fromkeys(limits))


def check_name(name: str, what: str) -> str:
    """A workflow, step or signal name: printed by the CLI and logged, so printable only."""
    if not name or len(name) > MAX_NAME or "#" in name or not name.isprintable():
        raise BadInput(
            f"{what} name {name!r} must be 1-{MAX_NAME} printable characters without '#'"
        )
    return name


def check_queue_part(text: str, what: str, limit: int) -> str:
    """A workflow's name or version: part of a queue's name, so what every broker carries
    (``QUEUE_CHARS``), 1-``limit`` characters; ``BadInput`` naming it otherwise."""
    if not (0 < len(text) <= limit and QUEUE_CHARS.fullmatch(text)):
        raise BadInput(
            f"{what} {text!r:.80} must be 1-{limit} characters of A-Z a-z 0-9 . _ - "
            "(a queue's name is made of it, and brokers refuse other characters)"
        )
    return text


class Registry:
    def __init__(self) -> None:
        self.steps: dict[str, StepDef] = {}
        self.workflows: dict[str, WorkflowDef] = {}
        self.limits: dict[str, Limit] = {}

    def add_limit(self, limit: Limit) -> Limit:
        """Declare a fleet-wide limit; the same name twice must mean the same limit."""
        known = self.limits.get(limit.name)
        if known is not None and known != limit:
            raise BadInput(f"limit {limit.name!r} is already declared as {known}")
        self.limits[limit.name] = limit
        return limit

    def add_step(self, step: StepDef) -> StepDef:
        check_name(step.name, "step")
        unknown = [name for name in step.limits if name not in self.limits]
        if unknown:
            raise BadInput(
                f"step {step.name!r} names undeclared limit {unknown[0]!r}: "
                f"declare it first with fleet.limit({unknown[0]!r}, ...)"
            )
        if step.name in self.steps and self.steps[step.name].fn is not step.fn:
            raise BadInput(f"two steps are named {step.name!r}; give one an explicit name=")
        self.steps[step.name] = step
        return step

    def add_workflow(self, wf: WorkflowDef) -> WorkflowDef:
        check_queue_part(wf.name, "workflow name", MAX_WORKFLOW_NAME)
        check_queue_part(wf.version, f"workflow {wf.name}'s version", MAX_VERSION)
        if wf.name in self.workflows and self.workflows[wf.name].fn is not wf.fn:
            raise BadInput(f"two workflows are named {wf.name!r}; give one an explicit name=")
        self.workflows[wf.name] = wf
        return wf

    def queues(self, base: str) -> list[str]:
        """What a worker consumes: the default queue and one per registered workflow
        version (see WorkflowDef.queue)."""
        return [base, *sorted({wf.queue(base) for wf in self.workflows.values()})]

    def workflow(self, ref: str | WorkflowDef) -> WorkflowDef:
        name = ref.name if isinstance(ref, WorkflowDef) else ref
        try:
            return self.workflows[name]
        except KeyError:
            known = ", ".join(sorted(self.workflows)) or "none"
            raise UnknownWorkflow(f"unknown workflow {name!r} (registered: {known})") from None

    def step(self, ref: str | StepDef) -> StepDef:
        name = ref.name if isinstance(ref, StepDef) else ref
        try:
            return self.steps[name]
        except KeyError:
            raise BadInput(f"unknown step {name!r}: decorate it with @fleet.step") from None
