"""The FastAPI example (``tasks/web.py``) served by a real uvicorn process, driven with
httpx, over a real worker, on both backends: one request id is one run, the event
stream follows the run live and ends with it, and the approval endpoint resumes a run
that waits for a person."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet import Fleet
from fleet.testing import FleetProcess
from tasks import agent
from tasks import app as tasks_app
from tasks.model import read_calls
from tests.harness import Backend, Cluster, poll

APP = "tasks"
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@pytest.fixture
def agents(backend: Backend) -> Iterator[Fleet]:
    backend.extra_env.update(
        FLEET_MODEL_CALLS=str(backend.workdir / "model-calls.jsonl"),
        FLEET_NOTES_LOG=str(backend.workdir / "notes.jsonl"),
        # Slow tools: a stream polling every 0.25 s sees each tool step running.
        FLEET_TOOL_LATENCY="0.6",
    )
    client = tasks_app.fleet.with_settings(backend.settings())
    client.upgrade_schema()
    yield client
    client.runtime.db.dispose()


@pytest.fixture
def web(backend: Backend, agents: Fleet, cluster: Cluster) -> str:
    """``uvicorn tasks.web:app`` on a free port, on the test's store and broker; its
    base URL. Stopped with the cluster."""
    server = FleetProcess(
        "web",
        ["tasks.web:app", "--host", "127.0.0.1", "--port", "0"],
        backend.env(),
        backend.workdir,
        module="uvicorn",
    )
    cluster.procs.append(server)
    if not server.wait_for_output("Application startup complete", 30):
        pytest.fail(f"uvicorn did not start:\n{server.output()}")
    found = poll(lambda: LISTENING.search(server.output()), 10, "uvicorn's port")
    return f"http://127.0.0.1:{found.group(1)}"


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """``(event, data)`` for each server-sent event, as it arrives."""
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))


def _chats_per_turn(backend: Backend, run_id: str) -> Counter[int]:
    calls = read_calls(backend.extra_env["FLEET_MODEL_CALLS"])
    return Counter(c["turn"] for c in calls if c["run"] == run_id and c["kind"] == "chat")


def test_one_request_id_is_one_run(
    backend: Backend, agents: Fleet, cluster: Cluster, web: str
) -> None:
    async def go() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=web, timeout=30) as http:
            first = await http.post("/runs", headers={"Idempotency-Key": "req-1"})
            retried = await asyncio.gather(  # a client retrying, several times at once
                *[http.post("/runs", headers={"Idempotency-Key": "req-1"}) for _ in range(10)]
            )
            other = await http.post(
                "/runs", headers={"Idempotency-Key": "req-2"}, json={"task": "List my notes."}
            )
            refused = [
                await http.post("/runs", headers={"Idempotency-Key": "no spaces"}),
                await http.post("/runs"),
            ]
            return [first, *retried, other], refused

    accepted, refused = asyncio.run(go())
    assert [r.status_code for r in accepted] == [202] * 12
    assert [r.json()["run_id"] for r in accepted] == ["web-req-1"] * 11 + ["web-req-2"]
    assert [r.status_code for r in refused] == [400, 422]
    assert "Idempotency-Key" in refused[0].json()["detail"]
    assert sorted(r.id for r in agents.runtime.queries.runs(limit=100)) == [
        "web-req-1",
        "web-req-2",
    ]

    cluster.worker("w1", app=APP)
    for run_id in ("web-req-1", "web-req-2"):
        poll(lambda r=run_id: agents.run(r).status() == "waiting", 120, f"{run_id} to wait")
        # Started once: each turn so far asked the model once.
        turns = _chats_per_turn(backend, run_id)
        assert turns and set(turns.values()) == {1}, turns
    tasks = [m["content"] for m in agents.transcript("web-req-2").raw() if m["role"] == "user"]
    assert tasks == ["List my notes."]


def test_the_event_stream_follows_the_run_and_approval_resumes_it(
    backend: Backend, agents: Fleet, cluster: Cluster, web: str
) -> None:
    cluster.worker("w1", app=APP)

    async def go() -> list[tuple[str, dict[str, Any]]]:
        seen: list[tuple[str, dict[str, Any]]] = []
        async with httpx.AsyncClient(base_url=web, timeout=60) as http:
            started = await http.post("/runs", headers={"Idempotency-Key": "tidy-1"})
            run_id = started.json()["run_id"]
            async with http.stream("GET", f"/runs/{run_id}/events") as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                async for event, data in _events(stream):
                    seen.append((event, data))
                    if (event, data.get("status")) == ("status", "waiting"):
                        # A malformed approval is refused and changes nothing: it waits.
                        for bad in ({"by": "ops"}, {"approved": "yes please", "by": ""}):
                            wrong = await http.post(f"/runs/{run_id}/approval", json=bad)
                            assert wrong.status_code == 422, wrong.text
                        assert agents.run(run_id).status() == "waiting"
                        # Live: the stream said it waits before anyone approved.
                        approval = {"approved": True, "by": "ops", "comment": "fine"}
                        sent = await http.post(f"/runs/{run_id}/approval", json=approval)
                        assert sent.status_code == 202, sent.text
            # The stream closed by itself once the run had ended.
            late = await http.post(f"/runs/{run_id}/approval", json={"approved": True, "by": "ops"})
            assert late.status_code == 409 and "succeeded" in late.json()["detail"]
            missing = await http.post(
                "/runs/web-ghost/approval", json={"approved": True, "by": "x"}
            )
            assert missing.status_code == 404
            assert (await http.get("/runs/web-ghost/events")).status_code == 404
        return seen

    started = time.monotonic()
    seen = asyncio.run(asyncio.wait_for(go(), 180))
    statuses = [d["status"] for e, d in seen if e == "status"]
    assert statuses[-1] == "succeeded" and "waiting" in statuses
    assert "running" in statuses[statuses.index("waiting") :], statuses  # resumed
    last, end = seen[-1]
    assert last == "end" and end["status"] == "succeeded", seen[-3:]
    assert "I deleted 'scratch'" in end["result"]["answer"]
    assert [e for e, _ in seen].count("end") == 1

    # The steps as they changed: every one seen done, the delete only after the wait.
    steps = [d for e, d in seen if e == "step"]
    final = {d["id"]: d["status"] for d in steps}
    assert final and set(final.values()) == {"done"}, final
    assert any(d["status"] in ("pending", "running") for d in steps), "only end states seen"
    wait_at = next(i for i, (e, d) in enumerate(seen) if d.get("status") == "waiting")
    deletes = [i for i, (e, d) in enumerate(seen) if e == "step" and d["name"] == "delete_note"]
    assert deletes and min(deletes) > wait_at
    changes = agent.read_notes_log(Path(backend.extra_env["FLEET_NOTES_LOG"]))
    assert [c["op"] for c in changes] == ["write", "delete"]
    assert time.monotonic() - started < 180
