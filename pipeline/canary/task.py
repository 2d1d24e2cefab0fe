"""Task metrics: what an adapter is for, scored on its held-out conversations (next to token parity).

Token parity says the engine produces the reference's tokens; a task metric says whether the adapter still
does its job where it is served (the field report left "adapter quality on the NVFP4 base" unmeasured).
A metric compares the assistant turn a model produced with the one the held-out conversation expects:

- `tool_call`: the answer must hold a tool call in the chat template's exact format (Qwen3.6's
  `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, the
  project's template `pipeline/dev/assets/chat_template.jinja`); `parse_rate` is the share of answers that hold
  one, `exact_match` the share whose function name and arguments equal the expected call's.
- `exact_match`: the answer, stripped, equals the expected assistant content.

`score(kind, expected, got)` scores one answer; `summarise` aggregates a list of them.
"""

from __future__ import annotations

import json
import re

KINDS = ("tool_call", "exact_match")

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)</function>\s*</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, str]]] | None:
    """The tool calls in `text` as [(function name, {argument: value string})], None when there is none.

    Values are the text between the parameter tags (the template writes JSON for non-strings, so `5` and
    `"5"` differ only in quoting, which the template does not add: compared as written)."""
    calls = [
        (name.strip(), {k.strip(): v.strip() for k, v in _PARAM.findall(body)})
        for name, body in _CALL.findall(text or "")
    ]
    return calls or None


def expected_text(message: dict) -> str:
    """The text an assistant message stands for in a metric: its content, or its tool calls written as the
    project's chat template writes them."""
    calls = message.get("tool_calls") or []
    if not calls:
        return str(message.get("content") or "")
    out = []
    for tc in calls:
        fn = tc.get("function", tc)
        args = fn.get("arguments") or {}
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in sorted(args.items())
            if v is not None
        )
        out.append(f"<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


def score(kind: str, expected: str, got: str) -> dict:
    """One answer: {"exact": bool} plus, for `tool_call`, {"parsed": bool}. Raises ValueError for an unknown kind."""
    if kind == "tool_call":
        want, have = parse_tool_calls(expected), parse_tool_calls(got)
        return {"parsed": have is not None, "exact": have is not None and have == want}
    if kind == "exact_match":
        return {"exact": (got or "").strip() == (expected or "").strip()}
    raise ValueError(f"unknown task metric {kind!r}: one of {', '.join(KINDS)}")


def summarise(kind: str, scores: list[dict]) -> dict:
    """{"kind", "n", "exact_match"[, "parse_rate"]}: shares in [0, 1], rounded to 4 places; None when n == 0."""
    n = len(scores)

    def share(key):
        return round(sum(bool(s.get(key)) for s in scores) / n, 4) if n else None

    out = {"kind": kind, "n": n, "exact_match": share("exact")}
    if kind == "tool_call":
        out["parse_rate"] = share("parsed")
    return out
