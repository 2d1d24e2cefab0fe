"""Chat templates rendered out of process, within memory, time and output bounds.

A chat template is a program, and an adapter directory is untrusted input
(`pipeline.artifacts.adapter_files`). jinja2's sandbox stops attribute tricks and bounds
`range()` (100,000 items), not memory, time or output: in `pipeline validate` (and `register`,
which validates) `{{ 'x' * 3000000000 }}` took 8 GB, three nested `range(100000)` loops ran
for ever, and a list doubled in a `namespace` took 23 GB until the kernel killed the command.
`check_template` (pipeline.artifacts.bounded) bounds the text before parsing; this bounds what the
text does. Templates are rendered by a worker process (`python -m pipeline.artifacts.templates`,
standard library + jinja2, ~0.1 s to start), started on the first render and reused:

- its address space is limited to `MAX_MEMORY_BYTES` (RLIMIT_AS): an allocation past it fails
  there (MemoryError), not in the pipeline;
- each render answers within `RENDER_TIMEOUT_S` or the worker is killed (the next render starts
  a new one); a template that broke a bound once is not run again by this process (validation
  renders each template some twenty times);
- the output is streamed (`Template.generate`) and refused past `MAX_OUTPUT_CHARS`;
- it dies with its parent (PR_SET_PDEATHSIG, pipeline.children) and when its stdin closes.

The environment is transformers' (transformers/utils/chat_template_utils.py
`_compile_jinja_template` / `render_jinja_template`): an `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension, a `tojson` filter that does not
escape HTML, globals `raise_exception` and `strftime_now`, a no-op `{% generation %}` block.
Variables are JSON values (messages, tools, special tokens, flags).

Protocol: one JSON line per request on the worker's stdin (`{"template": str, "variables": {}}`),
one JSON line per answer (`{"text": str}` or `{"error": jinja's exception type, "message": str}`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from functools import lru_cache

from pipeline.children import die_with_parent
from pipeline.errors import UsageError

MAX_MEMORY_BYTES = 1 << 30  # the worker's whole address space (Python + jinja2 use ~40 MB)
RENDER_TIMEOUT_S = 10.0  # one conversation renders in about a millisecond
MAX_OUTPUT_CHARS = 1 << 20  # a rendered conversation is a few KB
MAX_ANSWER_BYTES = 12 * MAX_OUTPUT_CHARS + 4096  # the output as ASCII JSON (a surrogate pair: 12 bytes)


class TemplateRenderError(UsageError, ValueError):
    """A chat template failed to render: jinja's own error (syntax, undefined, `raise_exception`),
    or a bound of the module doc. `kind` is jinja's exception type, or `bounds`."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}" if kind != "bounds" else message)
        self.kind = kind


# -- the worker ---------------------------------------------------------------------------------------
@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' AssistantTracker, without index tracking
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

        def _support(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        import datetime as dt

        return dt.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _render_here(template: str, variables: dict) -> str:
    out, n = [], 0
    for chunk in _compile(template).generate(**variables):
        n += len(chunk)
        if n > MAX_OUTPUT_CHARS:
            raise TemplateRenderError("bounds", f"renders more than {MAX_OUTPUT_CHARS} characters")
        out.append(chunk)
    return "".join(out)


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY_BYTES, MAX_MEMORY_BYTES))


def worker_main() -> None:
    """Answer requests on stdin until it closes (the module doc's protocol)."""
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = {"text": _render_here(req["template"], req["variables"])}
        except TemplateRenderError as e:
            answer = {"error": "bounds", "message": str(e)}
        except MemoryError:
            answer = {"error": "bounds", "message": f"needs more than {MAX_MEMORY_BYTES >> 20} MiB of memory"}
        except RecursionError:
            answer = {"error": "bounds", "message": "recurses too deeply"}
        except Exception as e:  # noqa: BLE001 - every template error goes back to the caller
            answer = {"error": type(e).__name__, "message": str(e)[:2000]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


# -- the client ----------------------------------------------------------------------------------------
class _Worker:
    def __init__(self):
        # as pipeline.children's guard: `-m` in this interpreter and environment; it limits itself
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.artifacts.templates"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def ask(self, request: bytes, timeout_s: float) -> dict | None:
        """The answer, or None when the worker did not answer in time or died (it is then killed)."""
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        fd, buf = self.proc.stdout.fileno(), bytearray()
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(buf) + len(chunk) > MAX_ANSWER_BYTES:
                self.kill()
                return None
            buf += chunk
        return json.loads(buf)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_worker: _Worker | None = None
_lock = threading.Lock()
_over_bounds: dict[str, TemplateRenderError] = {}  # template text -> the bound it broke


def render(template: str, variables: dict, timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """`template` rendered with `variables` (JSON values) in the worker, within the module doc's bounds.

    Raises TemplateRenderError: jinja's error (`kind` its type name), or a bound (`kind` "bounds").
    """
    global _worker
    if template in _over_bounds:
        raise _over_bounds[template]
    request = (json.dumps({"template": template, "variables": variables}) + "\n").encode()
    with _lock:  # one request at a time per worker
        if _worker is None or _worker.proc.poll() is not None:
            _worker = _Worker()
        answer = _worker.ask(request, timeout_s)
        if answer is None:
            _worker = None
            answer = {
                "error": "bounds",
                "message": f"did not render within {timeout_s:.0f} s (a loop without end?)",
            }
    if "error" in answer:
        err = TemplateRenderError(answer["error"], answer["message"])
        if err.kind == "bounds":
            _over_bounds[template] = err
        raise err
    return answer["text"]


if __name__ == "__main__":
    die_with_parent()
    _limit_memory()
    worker_main()
