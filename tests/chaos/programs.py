"""Chaos programs: a seeded generator of small workflow programs, their JSON format, and
their meaning (``interpret``), which the registered workflow (tests/chaos/program_flows.py)
and the model (tests/chaos/model.py) both run, on a real ``WorkflowContext`` and on the
model's stand-in for one.

A program is JSON, the input of the workflow ``chaos_program``::

    {"v": 1, "seed": S, "index": I, "start": 123456,
     "budget": null | {"tokens": N},        # the root run's budget (enqueue(budget=...))
     "ops": [OP, ...]}

A child run is given ``{"start": <its parent's accumulator>, "ops": [...]}`` (an op's
``"prog"`` holds ``{"ops": [...]}``). The ops fold into an integer accumulator
(``mix``); a run returns ``{"acc": A, "trail": [[op id, acc after it], ...]}``. Op ids
(``"o1"``, ``"o2"``…) are unique over the whole tree of runs and are the steps' keys, so
every task step id is unique in the program: ``o5`` (a step), ``o5#1``… (the items of a
map keyed ``o5``), ``o5.0``… (the branches of a parallel, the children of a spawn).
A child run's id is ``{parent id}/{op id}`` (``{parent id}/o5.1`` for a branch).

The ops (every field but ``op`` and ``id``):

    step      k                  sync step ``chaos_step``
    astep     k                  ``async def`` step ``chaos_astep``
    fail      k mode async catch a step (``chaos_fail``/``chaos_afail``, cap 3) that fails
                                 by ``mode``: raise (ValueError, every attempt), nonretry
                                 (NonRetryable), retryx (Retry, every attempt), retry2
                                 (Retry once, then succeeds), flaky2 (RuntimeError once);
                                 ``catch``: a StepFailed is caught, else the run fails
    effect    k                  ``chaos_effect``: the stand-in provider (tests/provider.py)
                                 applies it under the step's idempotency key; reconciled
    map       items handle       ``wf.map(chaos_item, …)``; items ``[[k, mode], ...]`` (mode
                                 ok or a fail mode); handle catch | raise | return
                                 (``return_exceptions=True``)
    parallel  branches handle    ``wf.parallel`` of ``wf.call``s; a branch is {"b": step |
                                 astep | effect, "k"}, {"b": fail, "k", "mode", "async"}
                                 or {"b": child, "prog"}
    child     prog catch         ``wf.child`` (attached)
    spawn     progs catch        ``wf.start_child`` each (attached), then every result()
    detach    prog await         ``wf.start_child(detached=True)``; result() if ``await``
    signal    v mode             ``wf.wait_for("sig-<id>")``: the driver sends {"v": v}
                                 before the wait is reached, after, or after with its
                                 wait_id (mode before | after | after_id; through the
                                 console, after_id is an approval or a rejection)
    timeout   secs               ``wf.wait_for("late-<id>", timeout=secs)``: nobody answers
    sleep     secs               ``wf.sleep(secs)``
    say       role               appends {"role", "content": "<id> <acc>"} to "main"
    compact   keep               ``wf.compact(main, chaos_summarize, keep_last=keep)``
    read      -                  ``chaos_read`` given ``main.window()``
    conc      ks                 a map of ``chaos_conc`` (limit "chaos-conc", concurrency 1)
    rate      ks                 a map of ``chaos_rate`` (limit "chaos-rate", rated)
    hog       k                  ``chaos_hog``: holds the GIL in one C call (~0.5-1 s)
    usage     tokens             ``chaos_usage``: ctx.record_usage(input_tokens=tokens)
    cancel    k prog             top level, last: ``wf.parallel`` of a step and a child
                                 whose program ends with ``stuck``; the driver cancels the
                                 run once that child waits and the step has settled
    stuck     -                  ``wf.wait_for("stuck-<id>")``, never answered

``generate(seed, index)`` is reproducible alone (its own ``random.Random``): 5-25 ops
over the whole tree, child runs at most ``MAX_DEPTH`` levels below the root.
``python -m tests.chaos.programs --seed S [--count N | --index I] [--stats]`` prints them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fleet import NonRetryable, Retry, StepFailed

VERSION = 1
WORKFLOW = "chaos_program"
MAX_DEPTH = 3  # child runs below the root, at most
MODULUS = 1_000_003
CAUGHT = 555_555  # folded in when a failure is caught
FAILED = 444  # folded in for a dead branch a fan-out returned (or a failed spawn)
DETACHED = 11  # folded in for a detached child nobody waits for
RETRY_DELAY = 0.02  # Retry(delay=...) of the fail modes that ask for one
CONC_LIMIT, RATE_LIMIT = "chaos-conc", "chaos-rate"
# Concurrency 1: a map's other items wait in the limit's line while one is inside, so
# a slot given back twice (a zombie's late release freeing its successor's) lets one
# of them in beside the successor, which the overlap check sees.
CONCURRENCY, RATE_PER_MINUTE = 1, 120
# Attempt caps: the failing steps' small one, everyone else's (a worker killed mid-step
# costs that step an attempt; the model is told which steps died that way).
SMALL_CAP, STEADY_CAP = 3, 6
FAILING_STEPS = frozenset({"chaos_fail", "chaos_afail", "chaos_item"})
# sum(range(HOG_N + k)) holds the GIL in one C call: 0.42 s for 10M, 0.67 s for 12M on
# this 2-core box (Python 3.11), longer when the box is busy.
HOG_N = 12_000_000
FAIL_MODES = ("raise", "nonretry", "retryx", "retry2", "flaky2")
SIGNAL_MODES = ("before", "after", "after_id")
HANDLES = ("catch", "raise", "return")


def cap(step: str) -> int:
    """The attempt cap of step ``step`` (the workers' RetryPolicy and the model's)."""
    return SMALL_CAP if step in FAILING_STEPS else STEADY_CAP


def mix(acc: int, value: int) -> int:
    return (acc * 31 + value * 17 + 7) % MODULUS


def crc(value: Any) -> int:
    """A stable digest of a JSON value (Python's ``hash`` differs between processes)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(text.encode())


def signal_name(op_id: str) -> str:
    return f"sig-{op_id}"


def late_name(op_id: str) -> str:
    return f"late-{op_id}"


def stuck_name(op_id: str) -> str:
    return f"stuck-{op_id}"


# --- what each step computes: the workers' step bodies and the model call these ---------


def fail_texts(step_id: str) -> dict[str, str]:
    """What a step failing by each kind of fail mode says (``fail_by``'s messages)."""
    return {
        "raise": f"boom {step_id}",
        "nonretry": f"refused {step_id}",
        "retry": f"again {step_id}",
        "flaky": f"flaky {step_id}",
    }


def fail_by(mode: str, step_id: str, attempt: int) -> None:
    """Raise as a step failing by ``mode`` does on attempt ``attempt`` (1-based)."""
    if mode == "ok":
        return
    says = fail_texts(step_id)
    if mode == "raise":
        raise ValueError(says["raise"])
    if mode == "nonretry":
        raise NonRetryable(says["nonretry"])
    if mode == "retryx" or (mode == "retry2" and attempt < 2):
        raise Retry(delay=RETRY_DELAY, reason=says["retry"])
    if mode == "flaky2" and attempt < 2:
        raise RuntimeError(says["flaky"])
    if mode not in ("retry2", "flaky2"):
        raise AssertionError(f"unknown fail mode {mode!r}")


def hog_sum(n: int, fast: bool = False) -> int:
    """``sum(range(n))``: in one C call (the GIL held throughout), or its closed form."""
    return n * (n - 1) // 2 if fast else sum(range(n))


def perform(name: str, args: Sequence[Any], step_id: str, attempt: int, fast: bool = False) -> Any:
    """The output of one attempt of step ``name`` (or its exception). The effect's is the
    body the provider is asked to apply; the transcript steps' argument is the list of
    messages they were shown. ``fast``: the hog's sum in closed form (the model)."""
    if name == "chaos_step":
        acc, k = args
        return mix(acc, k)
    if name == "chaos_astep":
        acc, k = args
        return mix(acc, k + 7919)
    if name in ("chaos_fail", "chaos_afail"):
        acc, k, mode = args
        fail_by(mode, step_id, attempt)
        return mix(acc, k + 101)
    if name == "chaos_item":
        ((acc, k, mode),) = args
        fail_by(mode, step_id, attempt)
        return mix(acc, k * k + 1)
    if name == "chaos_effect":
        acc, k = args
        return f"pay {k} at {acc}"
    if name == "chaos_summarize":
        (messages,) = args
        return f"summary of {len(messages)}: {crc(messages) % 100_000}"
    if name == "chaos_read":
        (messages,) = args
        return len(messages) * 1000 + crc(messages) % 1000
    if name in ("chaos_conc", "chaos_rate"):
        ((acc, k),) = args
        return mix(acc, k + 31)
    if name == "chaos_hog":
        acc, k = args
        return mix(acc, hog_sum(HOG_N + k, fast) % MODULUS)
    if name == "chaos_usage":
        acc, tokens = args
        return mix(acc, tokens)
    raise AssertionError(f"unknown chaos step {name!r}")


# --- the meaning of a program: run on a WorkflowContext (or the model's stand-in) -------


class _Run:
    def __init__(self, wf: Any, start: int) -> None:
        self.wf = wf
        self.acc = start
        self.trail: list[list[Any]] = []
        self._chat: Any = None

    def chat(self) -> Any:
        if self._chat is None:
            self._chat = self.wf.transcript("main")
        return self._chat


def child_args(prog: Mapping[str, Any], acc: int) -> dict[str, Any]:
    """What a child run is given: its ops, and its parent's accumulator to start from."""
    return {"start": acc, "ops": prog["ops"]}


def interpret(wf: Any, prog: Mapping[str, Any]) -> dict[str, Any]:
    """Run program ``prog`` on ``wf`` (a ``WorkflowContext``, or the model's)."""
    run = _Run(wf, int(prog["start"]))
    for op in prog["ops"]:
        run.acc = _HANDLERS[op["op"]](run, op)
        run.trail.append([op["id"], run.acc])
    return {"acc": run.acc, "trail": run.trail}


def _fold(acc: int, values: Sequence[Any]) -> int:
    for v in values:
        acc = mix(acc, FAILED if isinstance(v, StepFailed) else int(v))
    return acc


def _step(r: _Run, op: Mapping[str, Any]) -> int:
    return int(r.wf.step("chaos_step", r.acc, op["k"], key=op["id"]))


def _astep(r: _Run, op: Mapping[str, Any]) -> int:
    return int(r.wf.step("chaos_astep", r.acc, op["k"], key=op["id"]))


def _fail(r: _Run, op: Mapping[str, Any]) -> int:
    name = "chaos_afail" if op["async"] else "chaos_fail"
    try:
        return int(r.wf.step(name, r.acc, op["k"], op["mode"], key=op["id"]))
    except StepFailed:
        if not op["catch"]:
            raise
        return mix(r.acc, CAUGHT)


def _effect(r: _Run, op: Mapping[str, Any]) -> int:
    receipt = r.wf.step("chaos_effect", r.acc, op["k"], key=op["id"])
    return mix(r.acc, crc(receipt["body"]))


def _map(r: _Run, op: Mapping[str, Any]) -> int:
    items = [[r.acc, k, mode] for k, mode in op["items"]]
    try:
        returns = op["handle"] == "return"
        got = r.wf.map("chaos_item", items, key=op["id"], return_exceptions=returns)
    except StepFailed:
        if op["handle"] == "raise":
            raise
        return mix(r.acc, CAUGHT)
    return _fold(r.acc, got)


def _call(r: _Run, branch: Mapping[str, Any], key: str) -> Any:
    kind = branch["b"]
    if kind == "child":
        return r.wf.call(WORKFLOW, child_args(branch["prog"], r.acc), key=key)
    if kind == "fail":
        name = "chaos_afail" if branch["async"] else "chaos_fail"
        return r.wf.call(name, r.acc, branch["k"], branch["mode"], key=key)
    return r.wf.call(f"chaos_{kind}", r.acc, branch["k"], key=key)


def _branch_value(branch: Mapping[str, Any], value: Any) -> Any:
    if isinstance(value, StepFailed):
        return value
    if branch["b"] == "child":
        return int(value["acc"])
    if branch["b"] == "effect":
        return crc(value["body"])
    return int(value)


def _parallel(r: _Run, op: Mapping[str, Any]) -> int:
    branches = op["branches"]
    calls = [_call(r, b, f"{op['id']}.{i}") for i, b in enumerate(branches)]
    try:
        got = r.wf.parallel(*calls, return_exceptions=op["handle"] == "return")
    except StepFailed:
        if op["handle"] == "raise":
            raise
        return mix(r.acc, CAUGHT)
    return _fold(r.acc, [_branch_value(b, v) for b, v in zip(branches, got, strict=True)])


def _child(r: _Run, op: Mapping[str, Any]) -> int:
    try:
        out = r.wf.child(WORKFLOW, child_args(op["prog"], r.acc), key=op["id"])
    except StepFailed:
        if not op["catch"]:
            raise
        return mix(r.acc, CAUGHT)
    return mix(r.acc, int(out["acc"]))


def _spawn(r: _Run, op: Mapping[str, Any]) -> int:
    handles = [
        r.wf.start_child(WORKFLOW, child_args(p, r.acc), key=f"{op['id']}.{i}")
        for i, p in enumerate(op["progs"])
    ]
    acc, first = r.acc, None
    for h in handles:  # every one awaited: none is left running if one failed
        try:
            acc = mix(acc, int(h.result()["acc"]))
        except StepFailed as exc:
            first = first or exc
            acc = mix(acc, FAILED)
    if first is not None:
        if not op["catch"]:
            raise first
        acc = mix(acc, CAUGHT)
    return acc


def _detach(r: _Run, op: Mapping[str, Any]) -> int:
    h = r.wf.start_child(WORKFLOW, child_args(op["prog"], r.acc), key=op["id"], detached=True)
    if not op["await"]:
        return mix(r.acc, DETACHED)
    try:
        return mix(r.acc, int(h.result()["acc"]))
    except StepFailed:
        return mix(r.acc, CAUGHT)


def signal_value(got: Mapping[str, Any]) -> int:
    """The ``v`` a signal carries: ``{"v": v}`` as the Python API sends it, or a console
    decision ``{"approved", "by", "comment"}`` the driver makes for ``v`` (approve an
    odd one, reject an even one, ``v`` as the comment). A decision that does not say
    what was decided for it reads as ``-1`` (so its run ends otherwise than the model
    says)."""
    if "v" in got:
        return int(got["v"])
    v = int(got["comment"])
    return v if got.get("approved") is bool(v % 2) and got.get("by") else -1


def _signal(r: _Run, op: Mapping[str, Any]) -> int:
    got = r.wf.wait_for(signal_name(op["id"]))
    return mix(r.acc, signal_value(got))


def _timeout(r: _Run, op: Mapping[str, Any]) -> int:
    got = r.wf.wait_for(late_name(op["id"]), timeout=op["secs"])
    return mix(r.acc, 1 if got is None else 2)


def _sleep(r: _Run, op: Mapping[str, Any]) -> int:
    r.wf.sleep(op["secs"])
    return mix(r.acc, 3)


def _say(r: _Run, op: Mapping[str, Any]) -> int:
    chat = r.chat()
    chat.append({"role": op["role"], "content": f"{op['id']} {r.acc}"})
    return mix(r.acc, len(chat))


def _compact(r: _Run, op: Mapping[str, Any]) -> int:
    summary = r.wf.compact(r.chat(), "chaos_summarize", keep_last=op["keep"], key=op["id"])
    return mix(r.acc, crc(summary))


def _read(r: _Run, op: Mapping[str, Any]) -> int:
    return mix(r.acc, int(r.wf.step("chaos_read", r.chat().window(), key=op["id"])))


def _limited(step: str) -> Callable[[_Run, Mapping[str, Any]], int]:
    def handler(r: _Run, op: Mapping[str, Any]) -> int:
        return _fold(r.acc, r.wf.map(step, [[r.acc, k] for k in op["ks"]], key=op["id"]))

    return handler


def _hog(r: _Run, op: Mapping[str, Any]) -> int:
    return int(r.wf.step("chaos_hog", r.acc, op["k"], key=op["id"]))


def _usage(r: _Run, op: Mapping[str, Any]) -> int:
    return int(r.wf.step("chaos_usage", r.acc, op["tokens"], key=op["id"]))


def _cancel(r: _Run, op: Mapping[str, Any]) -> int:
    got = r.wf.parallel(
        r.wf.call("chaos_step", r.acc, op["k"], key=f"{op['id']}.0"),
        r.wf.call(WORKFLOW, child_args(op["prog"], r.acc), key=f"{op['id']}.1"),
    )
    return mix(int(got[0]), int(got[1]["acc"]))  # not reached: the driver cancels first


def _stuck(r: _Run, op: Mapping[str, Any]) -> int:
    r.wf.wait_for(stuck_name(op["id"]))  # nobody answers
    return mix(r.acc, 13)


_HANDLERS: dict[str, Callable[[_Run, Mapping[str, Any]], int]] = {
    "step": _step,
    "astep": _astep,
    "fail": _fail,
    "effect": _effect,
    "map": _map,
    "parallel": _parallel,
    "child": _child,
    "spawn": _spawn,
    "detach": _detach,
    "signal": _signal,
    "timeout": _timeout,
    "sleep": _sleep,
    "say": _say,
    "compact": _compact,
    "read": _read,
    "conc": _limited("chaos_conc"),
    "rate": _limited("chaos_rate"),
    "hog": _hog,
    "usage": _usage,
    "cancel": _cancel,
    "stuck": _stuck,
}
KINDS = tuple(k for k in _HANDLERS if k != "stuck")

# --- the generator ----------------------------------------------------------------------

# Relative weights of the op kinds (children only where a level is left; cancel only at
# the top). Waits, sleeps and the hog cost wall time, children and fan-outs messages.
WEIGHTS: dict[str, float] = {
    "step": 12,
    "astep": 9,
    "fail": 8,
    "effect": 7,
    "map": 6,
    "parallel": 5,
    "child": 5,
    "spawn": 2.5,
    "detach": 2.5,
    "signal": 5,
    "timeout": 2,
    "sleep": 2,
    "say": 7,
    "compact": 3,
    "read": 3,
    "conc": 2.5,
    "rate": 2,
    "hog": 0.6,
    "usage": 3,
    "cancel": 1.2,
}
NESTING = frozenset({"child", "spawn", "detach"})


class _Gen:
    def __init__(self, rng: random.Random, total: int) -> None:
        self.rng = rng
        self.left = total
        self.n = 0

    def new_id(self) -> str:
        self.n += 1
        self.left -= 1
        return f"o{self.n}"

    def pick(self, choices: Mapping[str, float]) -> str:
        names = list(choices)
        return self.rng.choices(names, weights=[choices[n] for n in names])[0]

    def fail_mode(self) -> str:
        return self.pick({"raise": 3, "nonretry": 2, "retryx": 1, "retry2": 2, "flaky2": 2})

    def block(self, depth: int, size: int | None = None) -> list[dict[str, Any]]:
        """The ops of one run: ``size`` ops at its own level (None: until the program's
        op budget is spent), each nested op's runs drawn from the same budget."""
        ops: list[dict[str, Any]] = []
        said = 0  # messages this run's transcript will hold
        while self.left > 0 and (size is None or len(ops) < size):
            kinds = dict(WEIGHTS)
            if depth >= MAX_DEPTH:
                for k in NESTING:
                    kinds.pop(k)
            if depth > 0 or self.n < 4 or self.left < 2:
                kinds.pop("cancel")
            kind = self.pick(kinds)
            if kind == "compact":
                keep = self.rng.randint(0, 3)
                while said < keep + 2 and self.left > 1:  # mostly enough for a summary
                    ops.append(self.op("say", depth))
                    said += 1
                op = {"op": "compact", "id": self.new_id(), "keep": keep}
            else:
                op = self.op(kind, depth)
            said += kind == "say"
            ops.append(op)
            if kind == "cancel" or (
                kind == "fail" and not op["catch"] and op["mode"] in ("raise", "nonretry", "retryx")
            ):
                break  # nothing after it runs
        return ops

    def sub(self, depth: int) -> dict[str, Any]:
        return {"ops": self.block(depth + 1, self.rng.randint(1, 3))}

    def op(self, kind: str, depth: int) -> dict[str, Any]:
        rng = self.rng
        op: dict[str, Any] = {"op": kind, "id": self.new_id()}
        if kind in ("step", "astep", "effect", "hog"):
            op["k"] = rng.randrange(100) if kind != "hog" else rng.randrange(1_000_000)
        elif kind == "fail":
            op.update(
                k=rng.randrange(100),
                mode=self.fail_mode(),
                **{"async": rng.random() < 0.4},
                catch=rng.random() < 0.75 or self.n < 5,  # a program of 5 ops at least
            )
        elif kind == "map":
            items = [
                [rng.randrange(100), "ok" if rng.random() < 0.7 else self.fail_mode()]
                for _ in range(rng.randint(2, 4))
            ]
            op.update(items=items, handle=self.pick({"catch": 2, "raise": 1, "return": 2}))
        elif kind == "parallel":
            op.update(
                branches=[self.branch(depth) for _ in range(rng.randint(2, 3))],
                handle=self.pick({"catch": 2, "raise": 1, "return": 2}),
            )
        elif kind == "child":
            op.update(prog=self.sub(depth), catch=rng.random() < 0.6)
        elif kind == "spawn":
            op.update(progs=[self.sub(depth) for _ in range(2)], catch=rng.random() < 0.6)
        elif kind == "detach":
            op.update(prog=self.sub(depth), **{"await": rng.random() < 0.5})
        elif kind == "signal":
            op.update(v=rng.randrange(1, 1000), mode=rng.choice(SIGNAL_MODES))
        elif kind == "timeout":
            op["secs"] = rng.choice((0.3, 0.5, 0.8))
        elif kind == "sleep":
            op["secs"] = rng.choice((0.2, 0.4, 0.6))
        elif kind == "say":
            op["role"] = rng.choice(("user", "assistant"))
        elif kind == "compact":
            op["keep"] = rng.randint(0, 3)
        elif kind in ("conc", "rate"):
            op["ks"] = [rng.randrange(100) for _ in range(rng.randint(2, 4))]
        elif kind == "usage":
            op["tokens"] = rng.choice((40, 60, 90))
        elif kind == "cancel":
            pre = self.block(depth + 1, rng.randint(0, 1)) if self.left > 1 else []
            stuck = {"op": "stuck", "id": f"o{self.n + 1}"}
            self.n += 1
            op.update(k=rng.randrange(100), prog={"ops": [*pre, stuck]})
        return op

    def branch(self, depth: int) -> dict[str, Any]:
        kinds = {"step": 3, "astep": 2, "fail": 3, "effect": 2, "child": 2}
        if depth >= MAX_DEPTH or self.left < 2:
            kinds.pop("child")
        kind = self.pick(kinds)
        if kind == "child":
            return {"b": "child", "prog": self.sub(depth)}
        b: dict[str, Any] = {"b": kind, "k": self.rng.randrange(100)}
        if kind == "fail":
            b.update(mode=self.fail_mode(), **{"async": self.rng.random() < 0.4})
        return b


def generate(seed: int, index: int) -> dict[str, Any]:
    """Program ``index`` of seed ``seed``: the same whatever else was generated."""
    rng = random.Random(f"chaos-program:{seed}:{index}")
    gen = _Gen(rng, rng.choice((5, 6, 8, 10, 10, 12, 12, 14, 16, 20, 22)))
    ops = gen.block(0)
    program: dict[str, Any] = {
        "v": VERSION,
        "seed": seed,
        "index": index,
        "start": rng.randrange(1, MODULUS),
        "budget": None,
        "ops": ops,
    }
    if any(op["op"] == "usage" for op in walk(program)) and rng.random() < 0.85:
        program["budget"] = {"tokens": rng.choice((50, 80, 150))}
    return program


def programs(seed: int, count: int, first: int = 0) -> list[dict[str, Any]]:
    return [generate(seed, i) for i in range(first, first + count)]


# --- reading programs -----------------------------------------------------------------------


def sub_programs(op: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The programs of the child runs an op starts (in the order of their keys)."""
    if op["op"] in ("child", "detach", "cancel"):
        return [op["prog"]]
    if op["op"] == "spawn":
        return list(op["progs"])
    if op["op"] == "parallel":
        return [b["prog"] for b in op["branches"] if b["b"] == "child"]
    return []


def walk(prog: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every op of the program's tree, depth first."""
    for op in prog["ops"]:
        yield op
        for sub in sub_programs(op):
            yield from walk(sub)


def depth(prog: Mapping[str, Any]) -> int:
    """How many levels of child runs the program has below its root."""
    deepest = 0
    for op in prog["ops"]:
        for sub in sub_programs(op):
            deepest = max(deepest, 1 + depth(sub))
    return deepest


def op_counts(prog: Mapping[str, Any]) -> Counter[str]:
    """Ops by kind over the program's tree (``stuck`` counted under ``cancel``)."""
    return Counter(op["op"] for op in walk(prog) if op["op"] != "stuck")


def features(prog: Mapping[str, Any]) -> Counter[str]:
    """What the program exercises: op kinds and their variants (``map:return``,
    ``signal:after_id``, ``fail:nonretry``, ``depth:3``…), for coverage and figures."""
    out: Counter[str] = Counter()
    for op in walk(prog):
        kind = op["op"]
        if kind == "stuck":
            continue
        out[kind] += 1
        if kind == "fail":
            out[f"fail:{op['mode']}"] += 1
            out["fail:async" if op["async"] else "fail:sync"] += 1
            out["fail:caught" if op["catch"] else "fail:uncaught"] += 1
        elif kind in ("map", "parallel"):
            out[f"{kind}:{op['handle']}"] += 1
            modes = [m for _, m in op["items"]] if kind == "map" else []
            modes += [b["mode"] for b in op.get("branches", []) if b["b"] == "fail"]
            if any(m in ("raise", "nonretry", "retryx") for m in modes):
                out[f"{kind}:failing"] += 1
            if kind == "parallel" and any(b["b"] == "child" for b in op["branches"]):
                out["parallel:child"] += 1
        elif kind == "signal":
            out[f"signal:{op['mode']}"] += 1
        elif kind == "detach":
            out["detach:await" if op["await"] else "detach:alone"] += 1
    if prog.get("budget"):
        out["budget"] += 1
    out[f"depth:{depth(prog)}"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.programs", description=__doc__)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--index", type=int, default=None, help="print this program only, indented")
    p.add_argument("--stats", action="store_true", help="ops by kind and features instead")
    a = p.parse_args(argv)
    if a.index is not None:
        print(json.dumps(generate(a.seed, a.index), indent=1))
        return 0
    progs = programs(a.seed, a.count)
    if a.stats:
        kinds: Counter[str] = Counter()
        feats: Counter[str] = Counter()
        for prog in progs:
            kinds += op_counts(prog)
            feats += features(prog)
        print(json.dumps({"programs": len(progs), "ops": dict(kinds.most_common())}))
        print(json.dumps({"features": dict(sorted(feats.items()))}))
        return 0
    for prog in progs:
        print(json.dumps(prog, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
