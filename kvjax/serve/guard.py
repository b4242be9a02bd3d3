"""The checks every HTTP request passes before FastAPI parses it (ASGI middleware).

    client ─► HostGuard ──────► CORS ──────────────► RequestGuard ────────────────────────► app
              Host header a      only when            API key (Bearer, constant time),
              name this server   `allowed_origins`    JSON bodies only, body at most
              answers to (DNS    names origins        `max_request_bytes`, counted as it
              rebinding)         (no CORS headers     streams in (also chunked bodies
                                 otherwise)           without Content-Length)

Why: a web page can send a CORS-simple request (a `text/plain` POST, no preflight) to a server on
127.0.0.1, and a DNS-rebinding page can read the answers of one that accepts any `Host`; an
unlimited body lets one client stall the event loop. Rejections are OpenAI-style error bodies
(`protocol.ApiError`): 400 `invalid_host`, 401 `invalid_api_key`, 413 `request_too_large`,
415 `unsupported_media_type`.

The body is read by `RequestGuard` (it yields to the event loop between network reads) and
handed to the app in one piece; a body over the limit is read on and dropped, up to
`DRAIN_FACTOR` times the limit, so the client receives the 413 rather than a reset connection
(unless it sent `Expect: 100-continue` and so waits for the answer before sending the body).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvjax.serve.protocol import ApiError

#: Default `max_request_bytes` (4 MiB).
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
#: An oversized body is read and dropped up to this many times the limit before the 413.
DRAIN_FACTOR = 16
#: Paths that stay open without the API key (unless `auth_health_and_metrics`).
OPEN_PATHS = frozenset({"/health", "/metrics"})
_LOOPBACK_NAMES = ("localhost",)
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(header: str) -> str:
  """The name of a `Host` header: lower case, port and trailing dot dropped, IPv6 unbracketed.

  `"LocalHost:8000"` -> "localhost", `"[::1]:8000"` -> "::1", `"example.com."` -> "example.com".
  """
  h = header.strip().lower()
  if h.startswith("["):
    end = h.find("]")
    return h[1:end] if end > 0 else h
  if h.count(":") == 1:
    h = h.split(":", 1)[0]
  return h.rstrip(".")


def is_loopback(name: str) -> bool:
  """Whether `name` is `localhost` or a loopback address (127.0.0.0/8, ::1)."""
  if name in _LOOPBACK_NAMES:
    return True
  try:
    return ipaddress.ip_address(name).is_loopback
  except ValueError:
    return False


@dataclasses.dataclass(frozen=True)
class HttpPolicy:
  """Who may drive the server, and how large a request may be.

  Attributes:
    bind_host: the interface the server listens on; a loopback one (the default) admits only
      loopback `Host` names unless `allowed_hosts` adds others.
    max_request_bytes: largest request body, bytes; larger ones get 413 before any parsing.
    allowed_hosts: extra `Host` names (exact, `*.example.com` for subdomains, or `*` for any).
      None: loopback names when bound to loopback, any name otherwise; given while bound
      elsewhere, only these.
    allowed_origins: origins (`https://app.example`) granted CORS; empty: no CORS headers at all.
    api_key: when set, `Authorization: Bearer <api_key>` is required on every path but
      `OPEN_PATHS` (401 otherwise).
    auth_health_and_metrics: require the key on `/health` and `/metrics` too.

  Raises:
    ValueError: a limit below 1, an empty API key, or an empty or malformed host or origin.
  """

  bind_host: str = "127.0.0.1"
  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
  allowed_hosts: tuple[str, ...] | None = None
  allowed_origins: tuple[str, ...] = ()
  api_key: str | None = dataclasses.field(default=None, repr=False)  # never in logs
  auth_health_and_metrics: bool = False

  def __post_init__(self):
    if (isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int)
        or self.max_request_bytes < 1):
      raise ValueError(f"max_request_bytes={self.max_request_bytes!r} must be a positive int")
    if self.api_key is not None and not self.api_key:
      raise ValueError("api_key is empty: give a key, or None for no authentication")
    for h in self.allowed_hosts or ():
      if not h or h != h.strip() or "/" in h:
        raise ValueError(f"allowed_hosts entry {h!r} is not a host name (e.g. example.com, "
                         "*.example.com, or *)")
    for o in self.allowed_origins:
      if o != "*" and "://" not in o:
        raise ValueError(f"allowed_origins entry {o!r} is not an origin (e.g. "
                         "https://app.example.com)")

  @property
  def loopback_only(self) -> bool:
    return is_loopback(host_name(self.bind_host))

  def host_allowed(self, header: str | None) -> bool:
    """Whether a request with this `Host` header is served (no header: yes, HTTP/1.0)."""
    if header is None:
      return True
    name = host_name(header)
    extra = tuple(h.lower().rstrip(".") for h in self.allowed_hosts or ())
    if "*" in extra or any(name == h or (h.startswith("*.") and name.endswith(h[1:]))
                           for h in extra):
      return True
    if self.loopback_only:
      return is_loopback(name)
    return self.allowed_hosts is None

  def needs_key(self, path: str) -> bool:
    return self.api_key is not None and (self.auth_health_and_metrics
                                         or path not in OPEN_PATHS)

  def key_matches(self, authorization: str | None) -> bool:
    """`Authorization: Bearer <key>` against `api_key`, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    ok = hmac.compare_digest(token.strip().encode("latin-1", "replace"),
                             (self.api_key or "").encode("utf-8"))
    return ok and scheme.lower() == "bearer"


OnError = Callable[[ApiError], None]


async def _reject(scope: Scope, receive: Receive, send: Send, error: ApiError,
                  on_error: OnError | None) -> None:
  if on_error is not None:
    on_error(error)
  await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(
      scope, receive, send)


class HostGuard:
  """ASGI middleware: 400 `invalid_host` unless `policy.host_allowed(Host)`."""

  def __init__(self, app: ASGIApp, policy: HttpPolicy, on_error: OnError | None = None):
    self.app, self.policy, self.on_error = app, policy, on_error

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
      host = Headers(scope=scope).get("host")
      if not self.policy.host_allowed(host):
        return await _reject(scope, receive, send, ApiError(
            400, f"Host {host!r} is not served here; start the server with "
            "--allowed_hosts to admit it.", code="invalid_host"), self.on_error)
    await self.app(scope, receive, send)


class RequestGuard:
  """ASGI middleware: API key, JSON-only bodies, and the body size limit (see the module doc)."""

  def __init__(self, app: ASGIApp, policy: HttpPolicy, on_error: OnError | None = None):
    self.app, self.policy, self.on_error = app, policy, on_error

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = Headers(scope=scope)
    policy = self.policy
    if policy.needs_key(scope["path"]) and not policy.key_matches(headers.get("authorization")):
      return await _reject(scope, receive, send, ApiError(
          401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), self.on_error)
    if scope["method"] in _BODYLESS_METHODS:
      return await self.app(scope, receive, send)
    length = headers.get("content-length")
    has_body = (length is not None and length.strip() != "0") or (
        "transfer-encoding" in headers)
    ctype = headers.get("content-type")
    if (ctype is not None or has_body) and (
        (ctype or "").split(";", 1)[0].strip().lower() != "application/json"):
      return await _reject(scope, receive, send, ApiError(
          415, f"Content-Type {ctype!r} is not accepted: send the body as application/json.",
          code="unsupported_media_type"), self.on_error)
    if not has_body:
      return await self.app(scope, receive, send)
    too_large = ApiError(
        413, f"The request body is larger than this server's limit of "
        f"{policy.max_request_bytes} bytes (--max_request_bytes).", code="request_too_large")
    if length is not None and length.strip().isdigit() and (
        int(length) > policy.max_request_bytes):
      if headers.get("expect", "").lower() != "100-continue":  # else the body was never sent
        await self._drain(receive, 0)
      return await _reject(scope, receive, send, too_large, self.on_error)
    chunks: list[bytes] = []
    size = 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return  # the client left before its body was complete
      body = message.get("body", b"")
      size += len(body)
      if size > policy.max_request_bytes:
        if message.get("more_body", False):
          await self._drain(receive, size)
        return await _reject(scope, receive, send, too_large, self.on_error)
      chunks.append(body)
      if not message.get("more_body", False):
        break
    await self.app(scope, _replay(b"".join(chunks), receive), send)

  async def _drain(self, receive: Receive, size: int) -> None:
    """Reads and drops the rest of a body, up to `DRAIN_FACTOR` x the limit."""
    while size <= DRAIN_FACTOR * self.policy.max_request_bytes:
      message = await receive()
      if message["type"] != "http.request":
        return
      size += len(message.get("body", b""))
      if not message.get("more_body", False):
        return


def _replay(body: bytes, receive: Receive) -> Receive:
  """A `receive` that yields `body` in one message, then the connection's own messages."""
  sent = False

  async def replay() -> Message:
    nonlocal sent
    if not sent:
      sent = True
      return {"type": "http.request", "body": body, "more_body": False}
    return await receive()

  return replay
