"""The replay alone: CPU time per recorded step of one advance's workflow replay over
250, 1,000 and 5,000 recorded steps (issue #19).

    .venv/bin/python -m bench.replay_cost [--steps 250 1000 5000] [--reps 15]
        [--outputs scalar object text]

No store work is timed. The history is built in memory (``done`` rows, then one
``running`` row, so the replay stops there without recording anything) and handed
to ``WorkflowContext`` as the history cache would hand it (the same row objects on
every replay); what is timed is the workflow function run over it until it
suspends: the registry lookup, step ids, the determinism checks and each recorded
output handed back. A real runtime on a throw-away SQLite file backs the context.
Outputs: ``scalar`` (an int, as ``bench.noop_flows``), ``object`` (a small dict, as
``tests.flows.work``), ``text`` (a 200-character string). The figure is the least of
``--reps`` replays (``time.process_time``; more for a short history); the first
replay of a history (nothing decoded yet in this process) is shown apart.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
from typing import Any

from bench.common import save
from fleet import Fleet, Settings
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.store.rows import RunRow, StepRow
from fleet.worker.context import StepContext
from fleet.worker.workflow import Suspend, WorkflowContext

fleet = Fleet("bench-replay")


@fleet.step
def scalar(ctx: StepContext, i: int) -> int:
    return i


@fleet.step
def obj(ctx: StepContext, i: int) -> dict[str, Any]:
    return {"i": i, "value": i * i, "note": "x"}


@fleet.step
def text(ctx: StepContext, i: int) -> str:
    return f"{i:08d}" * 25


@fleet.workflow
def loop(wf: WorkflowContext, n: int, kind: str) -> int:
    """``n`` sequential steps of ``kind``, reading each output as a workflow would."""
    total = 0
    for i in range(n):
        out = wf.step(kind, i)
        total += out["value"] if kind == "obj" else len(out) if kind == "text" else out
    return total


_STEP = {"scalar": "scalar", "object": "obj", "text": "text"}
_OUTPUT = {
    "scalar": lambda i: str(i),
    "object": lambda i: f'{{"i":{i},"value":{i * i},"note":"x"}}',
    "text": lambda i: '"' + f"{i:08d}" * 25 + '"',
}


def history(run_id: str, n: int, kind: str) -> list[StepRow]:
    """``n`` done rows of step ``kind`` and one running row after them."""
    name = _STEP[kind]
    rows = []
    for i in range(n + 1):
        status = StepStatus.DONE if i < n else StepStatus.RUNNING
        output = _OUTPUT[kind](i) if i < n else None
        rows.append(
            StepRow(
                run_id, f"{name}#{i + 1}", i, name, StepKind.TASK, "{}", status, output,
                None, 1, 3, 1, None, None, None, None, 1, 0.0, 0.0, None,
            )
        )  # fmt: skip
    return rows


def run_row(run_id: str, n: int, kind: str) -> RunRow:
    return RunRow(
        run_id, "loop", "1", "{}", f'{{"args":[{n + 1},"{_STEP[kind]}"],"kwargs":{{}}}}',
        "fleet", RunStatus.RUNNING, None, None, 1, 1, None, 1, 0.0, 0.0, None, None, None,
        None, None, None, False, None,
    )  # fmt: skip


def replay_once(client: Fleet, run: RunRow, rows: list[StepRow], n: int, kind: str) -> float:
    """CPU seconds of one replay of ``loop`` over ``rows``; checks it stopped at the end."""
    rt = client.runtime
    t0 = time.process_time()
    ctx = WorkflowContext(rt, run, rows)
    with contextlib.suppress(Suspend):
        loop.fn(ctx, n + 1, _STEP[kind])
    took = time.process_time() - t0
    assert ctx._pos == n + 1 and not ctx.new_tasks, (ctx._pos, n)
    return took


def measure(client: Fleet, n: int, kind: str, reps: int) -> tuple[float, float]:
    """µs per recorded step: the first replay, and the least of ``reps`` after it (at
    least 100,000 recorded steps' worth: a short history is replayed more times)."""
    run = run_row(f"bench-{kind}-{n}", n, kind)
    rows = history(run.id, n, kind)
    gc.collect()
    gc.freeze()  # what the process holds already is not walked by the timed replays' GC
    first = replay_once(client, run, rows, n, kind)
    reps = max(reps, 100_000 // n)
    best = min(replay_once(client, run, rows, n, kind) for _ in range(reps))
    return first * 1e6 / n, best * 1e6 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[250, 1000, 5000])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--outputs", nargs="+", default=list(_STEP), choices=list(_STEP))
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-replay-") as folder:
        settings = Settings.from_env(
            {
                "FLEET_DATABASE_URL": f"sqlite:///{folder}/fleet.db",
                "FLEET_BROKER_URL": f"filesystem:///{folder}/broker",
            }
        )
        client = fleet.with_settings(settings)
        results: dict[str, dict[str, list[float]]] = {}
        for kind in a.outputs:
            results[kind] = {}
            for n in a.steps:
                first, best = measure(client, n, kind, a.reps)
                results[kind][str(n)] = [first, best]
                print(
                    f"{kind:>6} outputs, {n:>5} recorded steps: {best:6.2f} µs/step "
                    f"(least of N; first replay {first:6.2f})"
                )
    save("replay_cost", {"reps": a.reps, "us_per_step": results})


if __name__ == "__main__":
    main()
