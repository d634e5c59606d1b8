"""``fleet console``: the operator's web page (``fleet.console``), served by uvicorn.

It refuses to start without authentication (``FLEET_CONSOLE_AUTH``, a proxy header)
unless bound to loopback with ``--no-auth``; once listening it prints one line,
``fleet console: http://HOST:PORT/``. The console's packages are the ``console``
extra; without them the command says so in one line.
"""

from __future__ import annotations

import socket
from typing import Annotated, Any

import typer

from fleet.errors import BadInput
from fleet.ops.cli_common import AppOpt, guard, open_fleet

READY = "fleet console: http"


def console(
    app_: AppOpt = None,
    host: Annotated[str, typer.Option(help="the address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="the port (0: any free one)")] = 8787,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="no sign-in: only on a loopback host")
    ] = False,
) -> None:
    """The operator's web page: runs, steps, approvals, dead letters, the fleet."""
    server = guard(lambda: _server(app_, host, port, no_auth))
    listening = guard(lambda: listen(host, port))
    server.run(sockets=[listening])


def listen(host: str, port: int) -> socket.socket:
    """The console's socket, bound here rather than by uvicorn, which would log the
    error and exit 3: a port in use, or an address not of this machine, is the
    operator's choice to change, one line and exit 2 (as ``fleet metrics`` says it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:  # in use, not an address here, a name that does not resolve
        sock.close()
        shown = f"[{host}]" if ":" in host else host
        raise BadInput(f"cannot listen on {shown}:{port}: {exc.strerror or exc}") from None
    return sock


def _server(target: str | None, host: str, port: int, no_auth: bool) -> Any:
    try:
        import uvicorn

        from fleet.console import app
        from fleet.console.auth import is_loopback
    except ImportError as exc:
        raise BadInput(
            f"the console needs the console extra (pip install 'fleet[console]'): {exc}"
        ) from None
    if no_auth and not is_loopback(host):
        raise BadInput(
            f"--no-auth is only allowed on a loopback host (127.0.0.1, ::1, localhost), "
            f"not {host!r}: set FLEET_CONSOLE_AUTH=user:password instead"
        )
    if not 0 <= port < 65536:
        raise BadInput(f"--port must be 0-65535, got {port}")
    # ``host``: off loopback, a proxy header needs FLEET_CONSOLE_TRUSTED_PROXIES.
    web = app(open_fleet(target), no_auth=no_auth, host=host)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname() if self.servers else (host, port)
                shown = f"[{host}]" if ":" in host else host
                print(f"fleet console: http://{shown}:{bound[1]}/", flush=True)

    # Live pages hold their event streams open: at shutdown they get 3 seconds, not minutes.
    # proxy_headers off: the address the proxy header is trusted from is the connection's
    # peer, never one a client (or a local user) writes into X-Forwarded-For.
    config = uvicorn.Config(
        web,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=3,
        proxy_headers=False,
    )
    return Server(config)
