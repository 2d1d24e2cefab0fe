"""A `pipeline.yaml` that fails its schema, explained: the key's line, and the key that was meant.

pydantic names a location (`fleet.max_lora_rnak`) and says "Extra inputs are not permitted"; an
operator wants the line to go to and the spelling that works, as git and kubectl print them. The
lines come from PyYAML's node marks (`yaml.compose`: each key and value keeps its start line), the
suggestions from `difflib.get_close_matches` over the fields the schema has at that place.
Only called on an error: a config that loads pays nothing.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from pathlib import Path

import yaml

Loc = tuple[str | int, ...]


def key_lines(text: str) -> dict[Loc, int]:
    """{location: 1-based line} of every mapping key and sequence item of a YAML document.

    A key's own line for a mapping entry (`("fleet", "max_lora_rank")`), an item's line for a list
    entry (`("fleet", "instances", 0)`). An alias is walked once (no expansion). {} when it does not parse.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[Loc, int] = {}
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, Loc]] = [(root, ())] if root is not None else []
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = loc + (k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark.line),)
                out[key] = k.start_mark.line + 1
                stack.append((v, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[loc + (i,)] = v.start_mark.line + 1
                stack.append((v, loc + (i,)))
    return out


def _model_of(annotation) -> type | None:
    """The pydantic model an annotation holds (`X`, `X | None`, `list[X]`), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            if (m := _model_of(arg)) is not None:
                return m
    return None


def fields_at(model: type, loc: Loc) -> list[str]:
    """The field names the schema has at `loc` (a mapping's location), [] when it is not a model there."""
    current: type | None = model
    for part in loc:
        if current is None:
            return []
        if isinstance(part, int):
            continue  # a list item: the list's own item model was taken with its field
        field = current.model_fields.get(str(part))
        current = _model_of(field.annotation) if field else None
    return sorted(current.model_fields) if current is not None else []


def explain(
    errors: list[dict], model: type, path: Path | None, env_var: Callable[[Loc], str | None]
) -> list[str]:
    """One line per pydantic error: `  loc (line N): message`, with `did you mean` for an unknown key;
    `  loc (from $VAR): message` when the value came from the environment (`env_var`)."""
    lines_of: dict[Loc, int] = {}
    if path is not None:
        try:
            lines_of = key_lines(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            lines_of = {}
    out = []
    for err in errors:
        loc = tuple(err["loc"])
        name = ".".join(str(x) for x in loc)
        msg = err["msg"]
        var = env_var(loc)
        if err.get("type") == "extra_forbidden":
            known = fields_at(model, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            msg = "unknown key" + (
                f"; did you mean {near[0]!r}?" if near else f" (known here: {', '.join(known)})"
            )
        if var:
            out.append(f"  {name} (from ${var}): {msg}")
            continue
        line = next((lines_of[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines_of), None)
        out.append(f"  {name}{f' (line {line})' if line else ''}: {msg}")
    return out
