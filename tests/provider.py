"""Records kept outside the store, for tests to check the store against: the step
execution log, and a stand-in provider for effect steps that records every call by
idempotency key in the file named by FLEET_TEST_PROVIDER and applies the first one per
key, as a real mail or payment API with idempotency keys does.

And a stand-in model provider speaking OpenAI's HTTP API (chat completions and
responses, whole or streamed as server-sent events), for the official client to call
over loopback (``serving_model``) or through httpx's ``MockTransport``
(``model_answer``): every call spends ``PROMPT_TOKENS`` in and ``COMPLETION_TOKENS``
out, its output the words of ``WORDS``, one a chunk; a model named ``broken`` answers 500.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def append_event(variable: str, ctx: Any, event: str, **extra: Any) -> None:
    """Append one line about a step execution (run, step, epoch, attempt, pid, time,
    event) to the file named by the environment ``variable``, if it is set."""
    path = os.environ.get(variable)
    if not path:
        return
    line = json.dumps(
        {
            "run": ctx.run_id,
            "step": ctx.step_id,
            "epoch": ctx.epoch,
            "attempt": ctx.attempt,
            "pid": os.getpid(),
            "t": time.time(),
            "event": event,
            **extra,
        }
    )
    # O_APPEND writes of one short line are atomic across processes.
    with open(path, "a") as f:
        f.write(line + "\n")


def _provider_path() -> str:
    return os.environ.get("FLEET_TEST_PROVIDER", "provider.jsonl")


def provider_calls(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def provider_apply(key: str, body: str) -> dict[str, Any]:
    import fcntl

    with open(_provider_path(), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        earlier = [json.loads(line) for line in f if line.strip()]
        applied = next((c for c in earlier if c["key"] == key and c["applied"]), None)
        f.write(json.dumps({"key": key, "body": body, "applied": applied is None}) + "\n")
    return {"receipt": key, "body": applied["body"] if applied else body}


def provider_lookup(key: str) -> dict[str, Any] | None:
    applied = next(
        (c for c in provider_calls(_provider_path()) if c["key"] == key and c["applied"]), None
    )
    return None if applied is None else {"receipt": key, "body": applied["body"]}


# --- the stand-in model provider ----------------------------------------------------------

PROMPT_TOKENS, COMPLETION_TOKENS = 60, 25  # 85 tokens a call
WORDS = ["one ", "two ", "three ", "four ", "five"]
TEXT = "".join(WORDS)


def _chat_usage() -> dict[str, int]:
    total = PROMPT_TOKENS + COMPLETION_TOKENS
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "total_tokens": total,
    }


def _response(model: str, done: bool) -> dict[str, Any]:
    usage = {
        "input_tokens": PROMPT_TOKENS,
        "output_tokens": COMPLETION_TOKENS,
        "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    text = {"type": "output_text", "text": TEXT, "annotations": []}
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": "completed" if done else "in_progress",
        "output": [{**message, "content": [text]}] if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if done else None,
    }


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": None,
    }


def _chat_events(body: dict[str, Any]) -> list[str]:
    model = body["model"]
    chunks = [_chunk(model, {"role": "assistant", "content": ""})]
    chunks += [_chunk(model, {"content": word}) for word in WORDS]
    chunks.append(_chunk(model, {}, "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**_chunk(model, {}), "choices": [], "usage": _chat_usage()})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _response_events(body: dict[str, Any]) -> list[str]:
    model = body["model"]
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": _response(model, False)}
    ]
    for word in WORDS:
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": word,
                "logprobs": [],
            }
        )
    events.append({"type": "response.completed", "response": _response(model, True)})
    return [
        f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n"
        for i, e in enumerate(events)
    ]


def model_answer(path: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    """The stand-in's answer to a POST of ``body`` at ``path``: status, content type, body."""
    model = str(body.get("model"))
    if model == "broken":
        error = {"error": {"message": "the stand-in is broken", "type": "server_error"}}
        return 500, "application/json", json.dumps(error).encode()
    stream = body.get("stream") is True
    if path.endswith("/chat/completions") and stream:
        return 200, "text/event-stream", "".join(_chat_events(body)).encode()
    if path.endswith("/responses") and stream:
        return 200, "text/event-stream", "".join(_response_events(body)).encode()
    if path.endswith("/responses"):
        return 200, "application/json", json.dumps(_response(model, True)).encode()
    message = {"role": "assistant", "content": TEXT}
    reply = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        "usage": _chat_usage(),
    }
    return 200, "application/json", json.dumps(reply).encode()


class _ModelHandler(BaseHTTPRequestHandler):
    requests: list[dict[str, Any]]

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, **body})
        status, kind, data = model_answer(self.path, body)
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@contextmanager
def serving_model() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The stand-in on loopback: its base URL (``.../v1``) and the requests it was sent."""
    requests: list[dict[str, Any]] = []
    handler = type("Handler", (_ModelHandler,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        server.server_close()
