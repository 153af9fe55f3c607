"""Who may talk to the server, checked before any route runs.

A server on localhost is reachable from every web page its user opens: a page can POST to
127.0.0.1 (a "simple" cross-site request needs no preflight when its body is text/plain), open a
WebSocket to it (WebSockets are not bound by CORS), or reach it under its own domain name through
DNS rebinding. So, besides the API key:

- the Host header must name this server (server.allowed_hosts; by default the loopback names and
  any IP address: a rebinding page's Host is its own domain name, never an address), which
  defeats DNS rebinding;
- a request carrying an Origin header (browsers send one with every cross-site request and every
  WebSocket) must come from an allowed origin (server.allowed_origins; none by default), which
  also decides CORS;
- bodies must be sent as application/json, which no page can send cross-site without a preflight
  that CORS answers.

Browsers cannot set an Authorization header on a WebSocket: they pass the key as a subprotocol,
`new WebSocket(url, ["llmserve", "openai-insecure-api-key." + KEY])` (the convention of OpenAI's
Realtime API); the server answers with the plain "llmserve".
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping

from llmserve.config import ServerConfig
from llmserve.server.protocol import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WS_PROTOCOL = "llmserve"
WS_KEY_PREFIX = "openai-insecure-api-key."
OPEN_PATHS = ("/health", "/metrics")


def host_name(host: str) -> str:
    """A Host header's name, without its port and brackets, in lower case ("[::1]:8000" -> "::1")."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin(value: str) -> str:
    return value.strip().lower().rstrip("/")


class Gate:
    def __init__(self, cfg: ServerConfig, api_keys: list[str]) -> None:
        self.api_keys = [key.encode() for key in api_keys]
        self.protect_health_metrics = cfg.protect_health_metrics
        self.any_host = "*" in cfg.allowed_hosts
        self.hosts = frozenset(host_name(h) for h in cfg.allowed_hosts or LOOPBACK_NAMES)
        self.any_address = not cfg.allowed_hosts  # the default also serves any IP address
        self.any_origin = "*" in cfg.allowed_origins
        self.origins = frozenset(_origin(o) for o in cfg.allowed_origins if o != "*")

    # ---- checks: each raises the APIError the request is answered with ------------------------

    def check(self, path: str, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> None:
        """Host, Origin and API key of a request or WebSocket handshake."""
        self.check_source(headers)
        if self._guarded(path) and not self._authorized(headers, subprotocols):
            raise APIError("Invalid or missing API key (Authorization: Bearer ..., or on a WebSocket the "
                           f"subprotocol {WS_KEY_PREFIX}KEY)", status=401, type="authentication_error",
                           code="invalid_api_key")

    def check_source(self, headers: Mapping[str, str]) -> None:
        """Host and Origin alone (a CORS preflight carries no credentials)."""
        host = headers.get("Host", "")
        if host and not self.host_allowed(host_name(host)):
            raise APIError(f"Host {host!r} is not served here: add its name to server.allowed_hosts", status=403,
                           type="permission_error", code="host_not_allowed")
        origin = headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin):
            raise APIError(f"Origin {origin!r} is not allowed (server.allowed_origins)", status=403,
                           type="permission_error", code="origin_not_allowed")

    @staticmethod
    def check_json(mimetype: str, encoding: str | None = None) -> None:
        """A body the server reads: JSON, not compressed (it is not decoded: a gzip body would be
        refused as bad UTF-8, a plain one sent as gzip read as if it were not)."""
        if mimetype != "application/json":
            raise APIError(f"Content-Type must be application/json, got {mimetype or 'none'!r}", status=415,
                           code="unsupported_media_type")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            raise APIError(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed", status=415,
                           param="Content-Encoding", code="unsupported_media_type")

    def host_allowed(self, name: str) -> bool:
        return self.any_host or name in self.hosts or (self.any_address and _is_address(name))

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or _origin(origin) in self.origins

    def _guarded(self, path: str) -> bool:
        return bool(self.api_keys) and (self.protect_health_metrics or path not in OPEN_PATHS)

    def _authorized(self, headers: Mapping[str, str], subprotocols: Iterable[str]) -> bool:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        tokens = [token] if scheme.lower() == "bearer" else []
        tokens += [p.removeprefix(WS_KEY_PREFIX) for p in subprotocols if p.startswith(WS_KEY_PREFIX)]
        # every candidate against every key, each in constant time: no early exit reveals which failed
        return any([hmac.compare_digest(t.encode(), key) for t in tokens for key in self.api_keys])

    # ---- answers ------------------------------------------------------------------------------

    def cors_headers(self, origin: str | None, preflight: bool = False) -> dict[str, str]:
        """CORS headers for a request from an allowed origin (none for others and for non-browsers)."""
        if origin is None or not self.origin_allowed(origin):
            return {}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if preflight:
            headers.update({"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                            "Access-Control-Allow-Headers": "Authorization, Content-Type",
                            "Access-Control-Max-Age": "600"})
        return headers

    @staticmethod
    def ws_subprotocol(requested: Iterable[str]) -> str | None:
        """The subprotocol to accept a WebSocket with: never the one carrying the key."""
        return next((p for p in requested if not p.startswith(WS_KEY_PREFIX)), None)
