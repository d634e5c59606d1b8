"""A stand-in model provider for the limits benchmark (issue #18): an OpenAI-ish
``POST /v1/chat/completions`` on 127.0.0.1 that enforces a requests limit and a tokens
limit over a sliding window (300 requests and 60,000 tokens per 60 s by default; a dev
run scales the window down), the way a provider limits one API key.

A request says how many tokens it will use (``max_tokens``); an accepted one is
charged that many at its arrival, answers after a random 0.2-0.5 s with ``usage`` of
that count. One over either limit is answered at once with 429 and ``Retry-After``
(whole seconds, rounded up) and ``retry-after-ms`` (exact): the time until the window
has room for it. Every request is recorded (arrival, end, accepted or not, tokens, and
the ``metadata`` it sent: run, step, attempt, tenant), and how many were in flight at
once; ``GET /records`` returns them, ``POST /reset`` forgets them and empties the window.

    .venv/bin/python -m bench.provider --port 8765 [--rpm 300 --tpm 60000 --window 60]

It prints ``provider listening on PORT`` when it serves (the benchmark waits for that).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

READY = "provider listening on"
LATENCY = (0.2, 0.5)


class Window:
    """The requests accepted in the last ``seconds``: (arrival, tokens), oldest first;
    and every request's record."""

    def __init__(self, rpm: int, tpm: int, seconds: float) -> None:
        self.rpm, self.tpm, self.seconds = rpm, tpm, seconds
        self._lock = threading.Lock()
        self._events: deque[tuple[float, int]] = deque()
        self._tokens = 0
        self.records: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def reset(self) -> None:
        with self._lock:
            self._events.clear()
            self._tokens = 0
            self.records = []
            self.max_in_flight = self.in_flight

    def admit(self, tokens: int, meta: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """Decide at arrival: (the request's record, seconds until room; 0 = accepted)."""
        with self._lock:
            now = time.time()
            while self._events and self._events[0][0] <= now - self.seconds:
                self._tokens -= self._events.popleft()[1]
            wait = self._wait(now, tokens)
            record = {
                "at": now,
                "end": None,
                "ok": wait == 0,
                "tokens": tokens,
                "in_flight": self.in_flight + 1,
                **meta,
            }
            if wait == 0:
                self._events.append((now, tokens))
                self._tokens += tokens
            else:
                record["retry_after"] = wait
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.records.append(record)
            return record, wait

    def _wait(self, now: float, tokens: int) -> float:
        """0 if ``tokens`` fit now; else the seconds until enough of the oldest accepted
        requests have left the window for both the count and the tokens to fit."""
        count, used = len(self._events), self._tokens
        if count + 1 <= self.rpm and used + tokens <= self.tpm:
            return 0.0
        if tokens > self.tpm:  # never fits: say a whole window
            return self.seconds
        for at, spent in self._events:
            count -= 1
            used -= spent
            if count + 1 <= self.rpm and used + tokens <= self.tpm:
                return max(0.001, at + self.seconds - now)
        return self.seconds  # unreachable: an empty window has room

    def done(self, record: dict[str, Any]) -> None:
        with self._lock:
            record["end"] = time.time()
            self.in_flight -= 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rpm": self.rpm,
                "tpm": self.tpm,
                "window": self.seconds,
                "max_in_flight": self.max_in_flight,
                "records": list(self.records),
            }


def handler(window: Window) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            pass  # one line per request would drown the log

        def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/records":
                self._send(200, window.snapshot())
            else:
                self._send(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            if self.path == "/reset":
                window.reset()
                self._send(200, {"reset": True})
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": f"no such path {self.path}"})
                return
            try:
                body = json.loads(raw)
                tokens = int(body["max_tokens"])
                meta = dict(body.get("metadata") or {})
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": f"bad request body: {exc}"})
                return
            record, wait = window.admit(tokens, meta)
            try:
                if wait:
                    self._send(
                        429,
                        {"error": {"type": "rate_limit_exceeded", "retry_after": wait}},
                        {
                            "Retry-After": str(math.ceil(wait)),
                            "retry-after-ms": str(math.ceil(wait * 1000)),
                        },
                    )
                    return
                time.sleep(random.uniform(*LATENCY))
                self._send(
                    200,
                    {
                        "id": f"cmpl-{len(window.records)}",
                        "object": "chat.completion",
                        "model": body.get("model", "stand-in"),
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "ok"}}
                        ],
                        "usage": {
                            "prompt_tokens": 0,
                            "completion_tokens": tokens,
                            "total_tokens": tokens,
                        },
                    },
                )
            finally:
                window.done(record)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rpm", type=int, default=300, help="requests per window")
    p.add_argument("--tpm", type=int, default=60_000, help="tokens per window")
    p.add_argument("--window", type=float, default=60.0, help="the window, in seconds")
    args = p.parse_args()
    window = Window(args.rpm, args.tpm, args.window)
    ThreadingHTTPServer.request_queue_size = 128  # 16 workers' threads connect at once
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(window))
    server.daemon_threads = True
    print(f"{READY} {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
