"""fleet.llm records usage from an OpenAI-compatible client's responses: the official
client against a stub server on loopback, run by a real worker."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fleet import Fleet
from tests.harness import Backend, Cluster


class _Stub(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        reply = {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": prompt.upper()},
                }
            ],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def stub_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_usage_is_recorded_from_the_responses(
    backend: Backend, client: Fleet, cluster: Cluster, stub_url: str
) -> None:
    backend.extra_env.update(FLEET_TEST_LLM_URL=stub_url, NO_PROXY="127.0.0.1,localhost")
    cluster.worker("w1")
    run = client.enqueue("asker", ["hello", "again"])
    assert run.wait(timeout=60) == ["HELLO", "AGAIN"]
    usage = run.usage()
    assert (usage["calls"], usage["input_tokens"], usage["output_tokens"]) == (2, 14, 6)
    assert usage["cost"] == pytest.approx(2 * (7 * 0.000001 + 3 * 0.000002))
    models = {a.model for a in client.runtime.queries.attempts(run.id)}
    assert models == {"stub-model"}
