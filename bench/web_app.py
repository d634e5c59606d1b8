"""The FastAPI example (``tasks/web.py``) with a probe of its own event loop, for
``bench/web.py``: a ticker coroutine sleeps ``TICK`` seconds at a time and keeps how late
each wake-up was; ``GET /lag`` returns them (and clears them). ``POST /runs-blocking``
enqueues with the sync client on the loop, the mistake the async client is for;
``POST /runs-noop`` does no fleet call at all (what the web stack alone costs the loop);
``POST /runs-per-call`` runs each sync call alone on a pool of four threads (the async
client before issue #20's batching and shared reads), to compare.

    uvicorn bench.web_app:app
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header

from fleet.aio_client import OFF_LOOP_THREADS, OffLoop
from tasks.app import fleet
from tasks.web import StartRun, _run_id, create_app

# BENCH_OFF_LOOP_THREADS: the size of the Fleet's pool for async calls, to compare sizes.
fleet.off_loop = OffLoop(int(os.environ.get("BENCH_OFF_LOOP_THREADS") or OFF_LOOP_THREADS))
# The async client as it was before #20's batching, each call alone on a pool of four
# threads (its default then; BENCH_PER_CALL_THREADS): a second Fleet, its own engine.
before = fleet.with_settings(fleet.settings)
before.off_loop = OffLoop(int(os.environ.get("BENCH_PER_CALL_THREADS") or 4))

TICK = 0.005
LATE: list[float] = []  # seconds each tick woke after it was due


async def _ticker() -> None:
    while True:
        due = time.perf_counter() + TICK
        await asyncio.sleep(TICK)
        LATE.append(max(0.0, time.perf_counter() - due))


@asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    task = asyncio.create_task(_ticker())
    yield
    task.cancel()


app = create_app(fleet)
app.router.lifespan_context = _lifespan


@app.get("/lag")
async def lag() -> dict[str, Any]:
    """How late the ticker woke, in seconds, since the last call (then cleared)."""
    late, LATE[:] = list(LATE), []
    return {"late": late}


@app.post("/runs-blocking", status_code=202)
async def start_blocking(idempotency_key: Annotated[str, Header()]) -> dict[str, str]:
    """``POST /runs`` done wrong: the sync ``enqueue`` called on the loop."""
    run = fleet.enqueue("agent", run_id="web-" + idempotency_key)
    return {"run_id": run.id}


@app.post("/runs-per-call", status_code=202)
async def start_per_call(
    idempotency_key: Annotated[str, Header()], body: StartRun | None = None
) -> dict[str, str]:
    """``POST /runs`` (the same handler's work: its body, its key) as the async client
    did before #20's batching: each sync call (``enqueue``, then ``status``) alone on a
    pool of threads (``before``'s)."""
    task, rid = (body or StartRun()).task, _run_id(idempotency_key)
    run = await before.off_loop.call(before.enqueue, "agent", task, run_id=rid)
    return {"run_id": run.id, "status": await before.off_loop.call(run.status)}


@app.post("/runs-noop", status_code=202)
async def start_nothing(idempotency_key: Annotated[str, Header()]) -> dict[str, str]:
    """The same request, no fleet call: the web stack's own share of the loop."""
    return {"run_id": "web-" + idempotency_key}
