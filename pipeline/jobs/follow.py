"""Ship a version by moving an alias: poll the registry (and optionally take MLflow webhooks).

`follow_alias(cfg, "production", 30)` checks every registered model each `interval_s` seconds;
when the alias points at a version that is not on the volume yet, that version is published.
Moving `production` in the MLflow UI therefore ships it. Polling is the source of truth:
MLflow's webhooks are fire-and-forget (3 retries, no queue; docs/mlflow.md), so a
webhook only wakes the poll loop early and never carries state itself.

Webhook signatures follow mlflow/webhooks/delivery.py (mlflow 3.17): header
`X-MLflow-Signature: v1,<base64 HMAC-SHA256(secret, "<delivery id>.<timestamp>.<body>")>`
with `X-MLflow-Delivery-Id` and `X-MLflow-Timestamp` (unix seconds).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipeline import registry
from pipeline.artifacts.volume import version_dir
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, PipelineError, UsageError
from pipeline.release.publish import publish

SIGNATURE_HEADER = "X-MLflow-Signature"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
MAX_SKEW_S = 300  # reject webhook deliveries older (or newer) than this: replay protection


SHIP_EVENTS = ("publish", "rollback")


def _ship_history(cfg: ProjectConfig, name: str) -> list[int]:
    """Versions of `name` in the order they were shipped (publish/rollback events), oldest first."""

    stamped = []
    for mv in registry.versions(cfg, name):
        for k in mv.tags or {}:
            if k.startswith(registry.EVENT_TAG_PREFIX) and k.rsplit(".", 1)[-1] in SHIP_EVENTS:
                stamped.append((k[len(registry.EVENT_TAG_PREFIX) :], int(mv.version)))
    return [v for _, v in sorted(stamped)]


def _already_shipped(cfg: ProjectConfig, name: str, version: int) -> bool:
    """On the volume and the last version shipped (so a move made while nobody followed counts)."""

    if not version_dir(cfg.volume.path, name, version).is_dir():
        return False
    history = _ship_history(cfg, name)
    return bool(history) and history[-1] == version


def _last_published(cfg: ProjectConfig, name: str, other_than: int) -> int | None:
    """The last version shipped other than `other_than`, if any."""
    return next((v for v in reversed(_ship_history(cfg, name)) if v != other_than), None)


def ship(cfg: ProjectConfig, name: str, version: int, alias: str, previous: int | None):
    """Publish `name` v`version` because `alias` points at it; returns `publish.Published`.

    Goes through `pipeline.release.publish.publish` (volume, fleet rollout when instances are
    configured, `production` alias, publish event). Following `production`: `previous` is set
    to the version shipped before (`publish` cannot see it: the alias had already moved), and if
    the alias moved again while this publish ran, it is put back where the user moved it, so the
    next poll ships that one instead of this publish silently undoing the move.
    """

    pub = publish(cfg, name, version=version)
    if alias == registry.ALIAS_PRODUCTION:
        moved_to = pub.previous_production
        if moved_to is not None and moved_to != version:
            registry.set_alias(cfg, name, registry.ALIAS_PRODUCTION, moved_to)
        if previous is not None and previous != version:
            registry.set_alias(cfg, name, registry.ALIAS_PREVIOUS, previous)
    return pub


def follow_alias(
    cfg: ProjectConfig,
    alias: str,
    interval_s: float,
    once: bool = False,
    *,
    names: list[str] | None = None,
    on_publish: Callable | None = None,
    on_poll: Callable[[], None] | None = None,
    echo: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
) -> list:
    """Publish each model's `alias` version when it moves; poll every `interval_s` seconds.

    Args:
        alias: the alias to follow (normally `production`).
        interval_s: seconds between polls (a publish happens at most one interval after the move).
        once: poll once and return (for cron or a fleet sync step).
        names: registered models to follow (default: all, re-listed at every poll).
        on_publish: called with each `publish.Published`.
        on_poll: called after each poll (a heartbeat).
        stop: set it to end the loop (checked at least every 0.2 s).
        wake: set it to poll now (the webhook receiver does).

    On start a version already on the volume counts as shipped (no re-publish). A version that
    fails its checks (validation not passed, unknown) is reported once and skipped until the
    alias moves again; other errors (registry unreachable) are reported and retried next poll.
    Returns the list of `Published` (useful with `once=True`).
    """

    if interval_s <= 0:
        raise UsageError(f"--interval must be > 0 seconds (got {interval_s})")
    stop = stop or threading.Event()
    wake = wake or threading.Event()
    seen: dict[str, int] = {}
    shipped: list = []
    while not stop.is_set():
        wake.clear()
        try:
            todo = names or registry.model_names(cfg)
        except Exception as e:  # registry unreachable: try again next poll
            echo(f"follow {alias}: cannot list models: {e}")
            todo = []
        for name in todo:
            try:
                v = registry.alias_version(cfg, name, alias)
            except Exception as e:
                echo(f"follow {alias}: {name}: cannot read alias: {e}")
                continue
            if v is None or seen.get(name) == v:
                continue
            if name not in seen and _already_shipped(cfg, name, v):
                seen[name] = v
                continue
            prev = seen.get(name)
            if prev is None and alias == registry.ALIAS_PRODUCTION:
                prev = _last_published(cfg, name, v)
            try:
                pub = ship(cfg, name, v, alias, prev)
            except (CheckFailed, UsageError) as e:
                echo(f"follow {alias}: {name} v{v} not published: {e}")
                seen[name] = v  # permanent for this version: wait for the alias to move again
                continue
            except (PipelineError, Exception) as e:  # noqa: B014 - transient: retry next poll
                echo(f"follow {alias}: {name} v{v}: publish failed, retrying next poll: {e}")
                continue
            seen[name] = v
            shipped.append(pub)
            echo(f"follow {alias}: published {name} v{v} -> {pub.path}")
            if on_publish is not None:
                on_publish(pub)
        if on_poll is not None:
            on_poll()
        if once:
            break
        deadline = time.monotonic() + interval_s
        while not stop.is_set() and not wake.is_set() and time.monotonic() < deadline:
            wake.wait(min(0.2, max(0.0, deadline - time.monotonic())))
    return shipped


# -- webhooks ---------------------------------------------------------------------------------------
def verify_signature(
    secret: str, delivery_id: str, timestamp: str, body: bytes, signature: str, now: float | None = None
) -> bool:
    """True when `signature` is MLflow's HMAC for this delivery and the timestamp is fresh."""
    try:
        if abs((now or time.time()) - int(timestamp)) > MAX_SKEW_S:
            return False
    except ValueError:
        return False
    version, _, sig = signature.partition(",")
    if version != "v1" or not sig:
        return False
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return hmac.compare_digest(base64.b64encode(mac).decode(), sig)


class WebhookReceiver:
    """A small HTTP endpoint for MLflow's `model_version_alias.created` webhooks.

    POST any path with MLflow's headers; 401 for a missing/bad/stale signature, 400 for a body
    that is not JSON, 204 otherwise. A verified alias event for `alias` sets `wake` (the poll
    loop then reads the registry: the webhook's content is never trusted as state).
    """

    def __init__(self, host: str, port: int, secret: str, wake: threading.Event, alias: str | None = None):
        if not secret:
            raise UsageError("webhook receiver needs a secret (the one given to MLflow's create_webhook)")
        self.secret, self.wake, self.alias = secret, wake, alias
        self.received: list[dict] = []
        recv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ok = verify_signature(
                    recv.secret,
                    self.headers.get(DELIVERY_HEADER, ""),
                    self.headers.get(TIMESTAMP_HEADER, ""),
                    body,
                    self.headers.get(SIGNATURE_HEADER, ""),
                )
                if not ok:
                    self.send_response(401)
                    self.end_headers()
                    return
                try:
                    msg = json.loads(body)
                except json.JSONDecodeError:
                    self.send_response(400)
                    self.end_headers()
                    return
                recv.received.append(msg)
                data = msg.get("data") or {}
                if msg.get("entity") == "model_version_alias" and (
                    recv.alias is None or data.get("alias") == recv.alias
                ):
                    recv.wake.set()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):  # quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
