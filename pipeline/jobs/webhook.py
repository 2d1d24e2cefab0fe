"""The webhook receiver of `pipeline follow-alias --webhook-port`: MLflow's signed deliveries wake the poll loop.

A webhook never carries state (polling the registry is the source of truth, pipeline.jobs.follow);
it only makes the next poll happen now. So the receiver's one job is to let nobody else in, and to
stay up under whatever arrives:

- a maintained HTTP server: uvicorn (the ASGI server MLflow's own server runs on), in a thread of
  the follower, with a connection limit (`MAX_CONNECTIONS`: more get 503 at once), a listen
  backlog for bursts, a header size limit (`MAX_HEAD_BYTES`), and idle connections closed
  (`head_timeout_s` for a request head to arrive complete, also after a response, however
  slowly it trickles in; `body_timeout_s` for the body);
- everything that can be checked before the body is read is checked first, cheapest first: the
  method, `Content-Length` (present, a plain number, at most `MAX_BODY_BYTES`: 411/400/413), the
  signature header's form, the timestamp (within `MAX_SKEW_S` of now), the delivery id (its form,
  and not seen before): 401 or 409 without reading a byte of the body;
- then the body is read (at most `Content-Length` bytes, within `body_timeout_s`) and its HMAC
  checked; only a verified delivery is remembered (`Deliveries`: ids of the last `MAX_SKEW_S`
  seconds, so a replay inside the timestamp window is refused, 409) and parsed (bounded JSON).

Signatures follow MLflow 3.17 (`mlflow/webhooks/delivery.py`, `_generate_hmac_signature`):
`X-MLflow-Signature: v1,<base64 HMAC-SHA256(secret, "<delivery id>.<timestamp>.<body>")>`, with
`X-MLflow-Delivery-Id` (a uuid4) and `X-MLflow-Timestamp` (unix seconds). MLflow retries a
delivery with the same id on 429/5xx; a 503 here is retried, and accepted once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import re
import socket
import threading
import time
from collections import OrderedDict

from pipeline.artifacts.bounded import loads_json
from pipeline.errors import UsageError
from pipeline.redact import add_secret

log = logging.getLogger("pipeline.jobs.webhook")

SIGNATURE_HEADER = "X-MLflow-Signature"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
MAX_SKEW_S = 300  # deliveries older or newer than this are refused (and ids are remembered this long)
MAX_BODY_BYTES = 256 * 1024  # an alias event is < 1 KB
MAX_HEAD_BYTES = 16 * 1024  # request line + headers
MAX_CONNECTIONS = 64  # open connections + requests in progress; more get 503 at once
BACKLOG = 2048  # connections the kernel queues for a burst
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5
MAX_REMEMBERED = 100_000  # delivery ids kept (a bound on memory; a window of 300 s is far below it)
_DELIVERY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")
_SIGNATURE = re.compile(r"v1,(?P<sig>[A-Za-z0-9+/]{43}=)\Z")  # base64 of a 32-byte digest


def verify_signature(
    secret: str, delivery_id: str, timestamp: str, body: bytes, signature: str, now: float | None = None
) -> bool:
    """True when `signature` is MLflow's HMAC of this delivery and the timestamp is within `MAX_SKEW_S`."""
    if timestamp_problem(timestamp, now) or not (m := _SIGNATURE.match(signature or "")):
        return False
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    try:
        given = base64.b64decode(m["sig"], validate=True)
    except binascii.Error:
        return False
    return hmac.compare_digest(mac, given)


def timestamp_problem(timestamp: str, now: float | None = None) -> str | None:
    if not re.fullmatch(r"\d{1,12}", timestamp or ""):
        return "no unix timestamp"
    if abs((now if now is not None else time.time()) - int(timestamp)) > MAX_SKEW_S:
        return f"timestamp more than {MAX_SKEW_S} s from now (a replay, or a clock off)"
    return None


class Deliveries:
    """Delivery ids accepted in the last `MAX_SKEW_S` seconds (thread-safe, bounded)."""

    def __init__(self, window_s: float = MAX_SKEW_S, limit: int = MAX_REMEMBERED):
        self.window_s, self.limit = window_s, limit
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._seen and (
            next(iter(self._seen.values())) < now - 2 * self.window_s or len(self._seen) > self.limit
        ):
            self._seen.popitem(last=False)

    def seen(self, delivery_id: str) -> bool:
        with self._lock:
            return delivery_id in self._seen

    def accept(self, delivery_id: str, now: float | None = None) -> bool:
        """Remember `delivery_id`; False when it was accepted before (a replay)."""
        now = time.time() if now is None else now
        with self._lock:
            self._expire(now)
            if delivery_id in self._seen:
                return False
            self._seen[delivery_id] = now
            return True


def _header(headers: list[tuple[bytes, bytes]], name: str) -> list[str]:
    key = name.lower().encode()
    return [v.decode("latin-1") for k, v in headers if k == key]


def _pre_body_problem(scope, deliveries: Deliveries) -> tuple[int, str] | None:
    """(status, reason) when the request is refused on its headers alone, else None."""
    if scope["method"] != "POST":
        return 405, "only POST"
    h = scope["headers"]
    if _header(h, "transfer-encoding"):
        return 411, "a Content-Length is required (no chunked bodies)"
    lengths = _header(h, "content-length")
    if not lengths:
        return 411, "a Content-Length is required"
    if len(lengths) > 1 or not re.fullmatch(r"\d{1,12}", lengths[0].strip()):
        return 400, "malformed Content-Length"
    if int(lengths[0]) > MAX_BODY_BYTES:
        return 413, f"body over {MAX_BODY_BYTES} bytes"
    sig, ts, did = (_header(h, x) for x in (SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER))
    if len(sig) != 1 or not _SIGNATURE.match(sig[0]):
        return 401, f"no {SIGNATURE_HEADER} of MLflow's form v1,<base64 HMAC-SHA256>"
    if len(ts) != 1 or (why := timestamp_problem(ts[0])):
        return 401, why if len(ts) == 1 else f"no {TIMESTAMP_HEADER}"
    if len(did) != 1 or not _DELIVERY_ID.match(did[0]):
        return 401, f"no {DELIVERY_HEADER}"
    if deliveries.seen(did[0]):
        return 409, "delivery already accepted (a replay)"
    return None


class WebhookApp:
    """The ASGI application: MLflow's `model_version_alias.*` webhooks; a verified one for `alias` sets `wake`.

    Answers: 204 accepted (also for another alias or entity: nothing to do), 400 malformed, 401
    unsigned / bad signature / stale, 405, 408 body too slow, 409 replay, 411, 413 too large.
    """

    def __init__(self, secret: str, wake: threading.Event, alias: str | None, body_timeout_s: float):
        self.secret, self.wake, self.alias, self.body_timeout_s = secret, wake, alias, body_timeout_s
        self.deliveries = Deliveries()
        self.received: list[dict] = []  # verified payloads (the last few hundred, for tests and logs)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        try:
            status, reason = await self._handle(scope, receive)
        except Exception as e:  # a bug must not print a traceback per request: one log line, 500
            log.error("webhook: %s: %s", type(e).__name__, e)
            status, reason = 500, "internal error"
        if status >= 400:
            log.debug("webhook: %s %s", status, reason)
        body = b"" if status == 204 else (reason + "\n").encode()
        headers = [(b"content-length", str(len(body)).encode())]
        if status >= 400:  # the body may be unread: do not keep the connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _handle(self, scope, receive) -> tuple[int, str]:
        refused = _pre_body_problem(scope, self.deliveries)
        if refused:
            return refused
        h = scope["headers"]
        length = int(_header(h, "content-length")[0])
        body = bytearray()
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                return 408, f"body not received within {self.body_timeout_s:.0f} s"
            if msg["type"] == "http.disconnect":
                return 400, "client went away"
            body += msg.get("body", b"")
            if len(body) > length:
                return 413, "body longer than its Content-Length"
            if not msg.get("more_body"):
                break
        delivery = _header(h, DELIVERY_HEADER)[0]
        timestamp = _header(h, TIMESTAMP_HEADER)[0]
        if not verify_signature(
            self.secret, delivery, timestamp, bytes(body), _header(h, SIGNATURE_HEADER)[0]
        ):
            return 401, "bad signature"
        if not self.deliveries.accept(delivery):
            return 409, "delivery already accepted (a replay)"
        try:
            msg = loads_json(bytes(body), "webhook body", MAX_BODY_BYTES)
        except ValueError:
            return 400, "body is not JSON"
        if not isinstance(msg, dict):
            return 400, "body is not a JSON object"
        self.received = [*self.received[-200:], msg]
        data = msg.get("data") if isinstance(msg.get("data"), dict) else {}
        if msg.get("entity") == "model_version_alias" and (
            self.alias is None or data.get("alias") == self.alias
        ):
            self.wake.set()
        return 204, "accepted"


def _protocol_class(head_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    `head_timeout_s` (after connecting, and after each response): uvicorn itself times out only an
    idle keep-alive connection, and any byte resets that (a trickle keeps a connection forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


class WebhookReceiver:
    """`WebhookApp` served by uvicorn on `host:port` in a background thread; a context manager.

    Raises UsageError: no secret, or the address cannot be listened on (in use, a privileged port).
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        wake: threading.Event,
        alias: str | None = None,
        *,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        import uvicorn

        if not secret:
            raise UsageError("webhook receiver needs a secret (the one given to MLflow's create_webhook)")
        add_secret(secret)  # never printed, whatever the variable holding it is called
        self.app = WebhookApp(secret, wake, alias, body_timeout_s)
        uv = logging.getLogger("uvicorn")
        if (
            uv.level == logging.NOTSET
        ):  # its per-request warnings (limit reached, bad request) are ours to count
            uv.setLevel(logging.ERROR)
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(BACKLOG)
        except OSError as e:
            raise UsageError(f"webhook receiver cannot listen on {host}:{port}: {e.strerror or e}") from e
        bound = self.sock.getsockname()[1]
        self.url = f"http://{host}:{bound}/"
        config = uvicorn.Config(
            self.app,
            http=_protocol_class(head_timeout_s),
            lifespan="off",
            log_config=None,
            access_log=False,
            limit_concurrency=MAX_CONNECTIONS,
            timeout_keep_alive=KEEP_ALIVE_S,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="webhook", daemon=True
        )

    @property
    def received(self) -> list[dict]:
        return self.app.received

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.close()
            raise UsageError(f"webhook receiver on {self.url} did not start")
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)
        self.sock.close()

    def __exit__(self, *exc):
        self.close()
