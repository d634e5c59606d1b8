"""Who is asking, and whether a form came from this console.

Three ways to know the user: HTTP basic against ``FLEET_CONSOLE_AUTH``
(``user:password[,user2:password2]``, compared in constant time), the header a
trusted reverse proxy sets (``FLEET_CONSOLE_PROXY_HEADER``), or nobody at all
(``no_auth``: the user is "anonymous"; the CLI allows it on a loopback host only).
``AuthMiddleware`` answers 401 before any page or action runs.

The proxy's header counts only on a request whose peer is one of the trusted proxies
(``FLEET_CONSOLE_TRUSTED_PROXIES``: IPs or CIDR networks); from any other address it
is ignored, as if absent (basic auth, else 401). Without that list only loopback peers
are trusted, and a console bound off loopback refuses to start: anyone who can reach
it could name themselves in the header.

Every form carries ``csrf`` = HMAC(secret, user): a POST whose token does not match
the signed-in user's was not made from this console's page (or is from before a
restart with a random secret) and is refused with nothing changed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.config import Settings
from fleet.errors import BadInput

NEEDS_AUTH = (
    "the console needs FLEET_CONSOLE_AUTH=user:password, a proxy header "
    "(FLEET_CONSOLE_PROXY_HEADER) or --no-auth on loopback"
)
NEEDS_PROXIES = (
    "FLEET_CONSOLE_PROXY_HEADER is set but FLEET_CONSOLE_TRUSTED_PROXIES is not: bound to "
    "{host!r}, anyone could sign in as anyone with that header; list the proxy's addresses"
)
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
ANONYMOUS = "anonymous"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
REALM = 'Basic realm="fleet"'


def parse_users(text: str) -> dict[str, str]:
    """``user:password[,user2:password2]`` as ``{user: password}``; BadInput otherwise."""
    users: dict[str, str] = {}
    for entry in text.split(","):
        user, sep, password = entry.strip().partition(":")
        if not sep or not user or not password:
            raise BadInput(
                "FLEET_CONSOLE_AUTH must be user:password[,user2:password2] "
                "(each with a user name and a password)"
            )
        users[user] = password
    return users


def parse_networks(text: str) -> tuple[Network, ...]:
    """``10.0.0.5, 10.1.0.0/16, ::1`` as networks; BadInput naming the entry otherwise."""
    found = []
    for entry in text.split(","):
        try:
            found.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise BadInput(
                "FLEET_CONSOLE_TRUSTED_PROXIES must be IP addresses or networks (CIDR), "
                f"comma-separated: {entry.strip()!r} is neither"
            ) from None
    return tuple(found)


def within(host: str | None, networks: tuple[Network, ...]) -> bool:
    """Whether the peer address ``host`` is in one of ``networks`` (a name, or no
    address at all, never is)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's IPv4 peer
    return any(address in network for network in networks)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Auth:
    """How users are known, and the secret forms are signed with."""

    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    proxy_header: str | None = None
    trusted: tuple[Network, ...] = LOOPBACK
    no_auth: bool = False
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def configure(
        cls,
        settings: Settings,
        *,
        auth: str | None,
        proxy_header: str | None,
        no_auth: bool,
        secret: str | None,
        trusted_proxies: str | None = None,
        host: str | None = None,
    ) -> Auth:
        auth = auth if auth is not None else settings.console_auth
        header = proxy_header if proxy_header is not None else settings.console_proxy_header
        if not auth and not header and not no_auth:
            raise BadInput(NEEDS_AUTH)
        proxies = trusted_proxies or settings.console_trusted_proxies
        if header and not proxies and host is not None and not is_loopback(host):
            raise BadInput(NEEDS_PROXIES.format(host=host))
        key = secret if secret is not None else settings.console_secret
        return cls(
            users=parse_users(auth) if auth else {},
            proxy_header=header.strip().lower() if header else None,
            trusted=parse_networks(proxies) if proxies else LOOPBACK,
            no_auth=no_auth and not auth and not header,
            secret=key.encode() if key else secrets.token_bytes(32),
        )

    def user(self, headers: Mapping[str, str], peer: str | None = None) -> str | None:
        """The user this request (from address ``peer``) is from, or None (answer
        401). The proxy's header counts only from a trusted proxy."""
        if self.proxy_header is not None and within(peer, self.trusted):
            value = headers.get(self.proxy_header, "").strip()
            if value:
                return value
        if self.users:
            return self._basic(headers.get("authorization", ""))
        return ANONYMOUS if self.no_auth else None

    def _basic(self, header: str) -> str | None:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, _, password = decoded.partition(":")
        found = None
        # Every user is compared, so the time taken does not say which names exist.
        for name, expected in self.users.items():
            same_name = hmac.compare_digest(name.encode(), user.encode())
            same_password = hmac.compare_digest(expected.encode(), password.encode())
            if same_name and same_password:
                found = name
        return found

    def csrf(self, user: str) -> str:
        """The token every form of ``user`` carries."""
        return hmac.new(self.secret, b"csrf:" + user.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, user: str, token: str) -> bool:
        return hmac.compare_digest(self.csrf(user).encode(), token.encode())

    def sign(self, text: str) -> str:
        """A short signature of a flash message, so a link cannot put words in the page."""
        digest = hmac.new(self.secret, b"msg:" + text.encode(), hashlib.sha256).hexdigest()
        return digest[:24]

    def signed(self, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(text).encode(), signature.encode())


class AuthMiddleware:
    """Answers 401 to a request from nobody; sets ``scope["state"]["user"]`` otherwise.
    The vendored static files are public (they hold nothing of the fleet's)."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        path = path.removeprefix(str(scope.get("root_path", "")))  # mounted under a prefix
        if scope["type"] != "http" or path.startswith("/static/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client")
        user = self.auth.user(headers, client[0] if client else None)
        if user is None:
            extra: dict[str, Any] = {}
            if self.auth.users:
                extra["WWW-Authenticate"] = REALM
            response = PlainTextResponse("sign in to the fleet console\n", 401, headers=extra)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["user"] = user
        await self.app(scope, receive, send)
