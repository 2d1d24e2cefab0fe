"""What the pipeline prints: never a secret, never another program's traceback.

The one redaction every output of the pipeline goes through, and the rule for third-party loggers.

What counts as a secret:
- the password in a URI's user-info (`postgresql://user:PASS@host/db`, `http://user:PASS@host`) and
  credential query parameters (`?password=`, `?token=`, `?sslpassword=`, ...);
- the value of every environment variable whose name says it holds one (`*PASSWORD`, `*TOKEN`,
  `*SECRET`, `*_KEY` such as `MLFLOW_TRACKING_PASSWORD`, `AWS_SECRET_ACCESS_KEY`,
  `PIPELINE_WEBHOOK_SECRET`), and values registered at run time (`add_secret`: an instance's API
  key read from the variable its config names, a webhook secret from `--webhook-secret-env`).

`redact(text)` applies all of it; `redact_uri(uri)` the URI part. The CLI writes stdout and stderr
through `RedactingStream` (installed by `pipeline.cli._common.PipelineGroup` for every command), so
results, `--json` documents, error messages, log records and rich tables are all redacted in that
one place, whatever printed them. A child's output that the pipeline keeps in a file (the trainer's
`train.log`, where MLflow prints `View run ... at: <tracking URI>`, credentials included, and axolotl
its whole config) goes through `copy_redacted`. Values the pipeline stores (a manifest's registry URI, an event)
are redacted where they are written, with `redact_uri`.

Other programs' tracebacks: a library that logs an exception (MLflow's SQL store logs every
"database is locked" with two chained tracebacks, before the pipeline reports the same failure as
one line) must not print it at the CLI's default log level. `quiet_third_party` (called by the
CLI's logging set-up, and by `pipeline.registry.store` right after MLflow configured its own
loggers on import) keeps those loggers at CRITICAL and strips tracebacks from every third-party
record; `--verbose` shows all of it.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading

MASK = "***"
MIN_SECRET_LEN = 8  # shorter values (`1`, `true`, `root`) would mangle output: no secret is that short
_SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|TOKEN|SECRET|_KEY)$", re.IGNORECASE)
_NOT_SECRET = {"PIPELINE_WEBHOOK_SECRET_ENV"}  # names a variable, holds none
# scheme://user:password@ -> scheme://***@ (as publish has always recorded a registry's URI in a
# manifest's origin, which later publishes compare)
_USERINFO = re.compile(r"://[^/@\s]+@")
_QUERY = re.compile(
    r"(?P<key>[?&;](?:password|passwd|pwd|sslpassword|token|access_token|secret|api_key|apikey|"
    r"sig|signature|x-amz-signature|x-amz-security-token)=)[^&;#\s\"']*",
    re.IGNORECASE,
)
_runtime: set[str] = set()


def add_secret(value: str | None) -> None:
    """Redact `value` wherever it appears from now on (in this process)."""
    if value and len(value) >= MIN_SECRET_LEN:
        _runtime.add(value)


def _environ_items() -> list[tuple[str, str]]:
    """os.environ's items, read while other threads may change it: MLflow's telemetry thread removed
    `_MLFLOW_TELEMETRY_SESSION_ID` in the middle of the walk and `pipeline train` died with KeyError (H200,
    every time). A walk that meets a change is taken again."""
    for _ in range(100):
        try:
            return list(os.environ.items())
        except (KeyError, RuntimeError):
            continue
    return list(os.environ.items())


def secret_values() -> list[str]:
    """The secret values known now, longest first (so a value containing another is masked whole)."""
    env = {
        v
        for k, v in _environ_items()
        if _SECRET_NAME.search(k) and k not in _NOT_SECRET and len(v) >= MIN_SECRET_LEN
    }
    return sorted(env | _runtime, key=len, reverse=True)


def redact_uri(uri: str) -> str:
    """`scheme://user:pass@host/...?password=x` -> `scheme://***@host/...?password=***`."""
    return _QUERY.sub(lambda m: m["key"] + MASK, _USERINFO.sub(f"://{MASK}@", uri))


def redact(text: str) -> str:
    """`text` with every secret of the module doc masked."""
    if not text:
        return text
    out = redact_uri(text)
    for v in secret_values():
        if v in out:
            out = out.replace(v, MASK)
    return out


class RedactingStream(io.TextIOBase):
    """A text stream that writes `redact(text)` to the stream it wraps (stdout, stderr)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s: str) -> int:
        self._stream.write(redact(s))
        return len(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):  # noqa: D401 - io.TextIOBase API
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self._stream, name)


MAX_LINE_CHARS = 1 << 20  # a line longer than this is redacted in parts


def copy_redacted(pipe, out) -> threading.Thread:
    """Copy a child's output (`pipe`, a binary stream) to the text file `out`, each line redacted.

    Lines end at `\n` or `\r` (progress bars), so a secret is masked whole unless it straddles
    `MAX_LINE_CHARS`. Runs in a daemon thread, returned started: join it once the child has ended
    (with a timeout: a grandchild may still hold the pipe).
    """

    def pump() -> None:
        text = io.TextIOWrapper(pipe, encoding="utf-8", errors="replace", newline="")
        try:
            while line := text.readline(MAX_LINE_CHARS):
                out.write(redact(line))
                out.flush()
        except (OSError, ValueError):  # the file or the pipe was closed under us
            pass

    t = threading.Thread(target=pump, name="copy-redacted", daemon=True)
    t.start()
    return t


# -- other programs' tracebacks ---------------------------------------------------------------------
# Loggers that install their own handlers on import (MLflow's `_configure_mlflow_loggers`): our
# levels set before the import are replaced, so `quiet_third_party` runs again after it.
OWN_HANDLER_LOGGERS = ("mlflow", "alembic", "sqlalchemy.engine", "huey")
_quiet = False


class NoTraceback(logging.Filter):
    """Keeps a record's message, drops its traceback (exc_info, stack_info)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = record.stack_info = None
        return True


class _ThirdPartyHandler(logging.StreamHandler):
    """Warnings of loggers without a handler (what `logging.lastResort` printed), without tracebacks,
    to whatever `sys.stderr` is when the record comes (the CLI redacts it)."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.addFilter(NoTraceback())

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def quiet_third_party(enable: bool | None = None) -> None:
    """At the default log level: no third-party traceback, and MLflow's own loggers at CRITICAL.

    `enable` True turns it on for this process (the CLI without `--verbose`), False off; None
    re-applies what is on (after a library configured its loggers). Library use (no CLI) is left
    alone unless it asks.
    """
    global _quiet
    if enable is not None:
        _quiet = enable
    root = logging.getLogger()
    if not _quiet:
        if enable is False:  # `--verbose` after a quiet run in this process: everything shows again
            root.handlers[:] = [h for h in root.handlers if not isinstance(h, _ThirdPartyHandler)]
            for name in OWN_HANDLER_LOGGERS:
                lg = logging.getLogger(name)
                lg.setLevel(logging.NOTSET)
                for h in lg.handlers:
                    h.filters[:] = [f for f in h.filters if not isinstance(f, NoTraceback)]
        return
    if not any(isinstance(h, _ThirdPartyHandler) for h in root.handlers):
        root.addHandler(_ThirdPartyHandler())
    for name in OWN_HANDLER_LOGGERS:
        lg = logging.getLogger(name)
        lg.setLevel(logging.CRITICAL)
        for h in lg.handlers:
            if not any(isinstance(f, NoTraceback) for f in h.filters):
                h.addFilter(NoTraceback())
