"""A TCP proxy on loopback that the chaos harness controls: the workers and the sweeper
reach Postgres (or Redis) through it, and ``cut()`` resets every connection through it
at once, in whatever state it is (mid-query, mid-transaction, mid-commit), while the
server itself stays up: the connection cut the issue asks for, unlike a restart, which
also ends the server's own sessions and empties Redis.

One thread accepts; each connection has two pump threads (client → server and back).
A cut shuts both sockets down with SO_LINGER 0 set, so each peer sees its connection
end mid-stream and then reset, and the pumps wake and close them. New connections are
accepted again at once.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


def _abort(sock: socket.socket) -> None:
    """Make the socket's close send a reset (RST), and end it now: a pump thread blocked
    reading it wakes (a socket closed under a blocked ``recv`` would not wake it, and
    its descriptor, reused by a new connection, would then cross two streams)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _end(sock: socket.socket) -> None:
    """Wake whatever reads ``sock``, then close it (the pump threads' own close)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class Proxy:
    """``Proxy(target_port).start()`` listens on a free loopback port (``port``) and
    forwards each connection to 127.0.0.1:``target_port``."""

    def __init__(self, target_port: int, name: str = "proxy") -> None:
        self.target_port = target_port
        self.name = name
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = threading.Event()
        self.accepted = 0
        self.cuts = 0

    def start(self) -> Proxy:
        threading.Thread(target=self._accept, name=f"{self.name}-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _abort(client)  # the server is down: the client sees its connection fail
                client.close()
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pairs.append((client, server))
                self.accepted += 1
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # One side ended (or was cut): end the other too (its pump wakes), forget
            # the pair. Only the pumps close sockets, once neither reads them.
            with self._lock:
                self._pairs = [p for p in self._pairs if src not in p]
            _end(dst)
            _end(src)

    def live(self) -> int:
        """Connections open through the proxy now."""
        with self._lock:
            return len(self._pairs)

    def cut(self) -> int:
        """Reset every connection through the proxy; how many were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += 1
        for client, server in pairs:
            _abort(client)
            _abort(server)
        return len(pairs)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()
