"""Secrets never printed: the one redaction every output of the pipeline goes through.

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
one place, whatever printed them. Values the pipeline stores (a manifest's registry URI, an event)
are redacted where they are written, with `redact_uri`.
"""

from __future__ import annotations

import io
import os
import re

MASK = "***"
MIN_SECRET_LEN = 4  # shorter values (`1`, `true`) are no secret worth mangling output for
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


def secret_values() -> list[str]:
    """The secret values known now, longest first (so a value containing another is masked whole)."""
    env = {
        v
        for k, v in os.environ.items()
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
