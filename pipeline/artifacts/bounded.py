"""Bounded parsing: every JSON, YAML and template text the pipeline reads is checked for size and depth first.

Python's parsers recurse once per nesting level: 100,000 `[` in a `manifest.json` ends `json.loads`
in a `RecursionError` (a traceback, not an error message), a YAML file nested a few thousand levels
deep does the same in PyYAML's composer, and Jinja's parser takes about fifteen Python frames per
parenthesis. So before a text is parsed:

- its size is checked (`max_bytes`, from `os.fstat` before reading; never more than that is read);
- JSON: its nesting depth is counted outside string literals (`nesting_depth`, linear, in C);
- YAML: the composer refuses a node nested deeper than `max_depth` and a document whose aliases
  expand to more than `MAX_YAML_NODES` nodes ("billion laughs") or refer to themselves;
- Jinja templates: bracket nesting and block (`{% if %}`, `{% for %}` ...) nesting are counted;
- numbers: an integer literal longer than `MAX_INT_DIGITS` (Python's own limit on decimal
  conversion, 4300 digits) is refused while parsing, JSON or YAML. Python raised a bare ValueError
  ("Exceeds the limit (4300 digits) ... use sys.set_int_max_str_digits()"): a traceback from
  `dataset check`, `fleet status`, `publish` and `validate` (a safetensors header), and that advice
  in the messages of the rest.

A text over a bound raises `BoundsError` (a ValueError) naming the file, the bound and how far it
went; the callers turn it into their own clear error (exit 2) as for any other unreadable file.
Real files stay far inside the bounds: a manifest nests 5 levels, a chat template about 8.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from itertools import accumulate
from pathlib import Path

import yaml

from pipeline.errors import UsageError

KIB, MIB = 1 << 10, 1 << 20
MAX_DEPTH = 64  # JSON / YAML nesting (Python's C JSON parser overflows near 1,000 minus the stack in use)
MAX_TEMPLATE_DEPTH = 32  # Jinja brackets and blocks: ~15 frames per level in jinja2's parser
MAX_YAML_NODES = 1_000_000  # nodes after alias expansion
MAX_JSON_BYTES = 16 * MIB  # default for records the pipeline writes itself
# digits of an integer literal (Python's limit on decimal conversion; real records: at most ~31, a
# tokenizer's model_max_length 1000000000000000019884624838656)
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")


class BoundsError(UsageError, ValueError):
    """A text over a size or depth bound (bad input, exit 2); the message names the file and the bound."""


def nesting_depth(raw: bytes | str) -> int:
    """The deepest `[`/`{` nesting of a JSON text, string literals left out (unbalanced text: a bound still)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    brackets = _STRING.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(0, max(accumulate(memoryview(brackets).cast("b"))))  # +1 per opener, -1 per closer


def read_bounded(path: Path, max_bytes: int, what: str = "") -> bytes:
    """The bytes of `path`, refusing a file larger than `max_bytes` before reading it.

    Only a regular file or a character device (`/dev/null`) is read: a FIFO or a socket blocks
    `open` until another process writes (`--config` pointed at a named pipe hung every command),
    so the file is opened without blocking and refused on its `fstat`.

    Raises BoundsError, or OSError (FileNotFoundError, IsADirectoryError, ...) as `open` does.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            kind = {
                stat.S_IFIFO: "a named pipe (FIFO)",
                stat.S_IFSOCK: "a socket",
                stat.S_IFBLK: "a block device",
            }
            raise BoundsError(
                f"{path}: {kind.get(stat.S_IFMT(st.st_mode), 'a special file')}, not a regular file: nothing read"
            )
        os.set_blocking(f.fileno(), True)
        size = st.st_size
        if size > max_bytes:
            raise BoundsError(
                f"{path}: {size} bytes, more than {_fmt(max_bytes)} allowed for {what or 'this file'}"
            )
        data = f.read(max_bytes + 1)  # a file that grows (or a /proc file reporting 0) is bounded too
    if len(data) > max_bytes:
        raise BoundsError(f"{path}: more than {_fmt(max_bytes)} allowed for {what or 'this file'}")
    return data


def check_json_text(
    raw: bytes | str, where: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> None:
    """Raise BoundsError when a JSON text is over `max_bytes` or nests deeper than `max_depth`."""
    n = len(raw)
    if n > max_bytes:
        raise BoundsError(f"{where}: {n} bytes, more than {_fmt(max_bytes)}")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise BoundsError(f"{where}: nested {depth} levels deep (at most {max_depth})")


def _int_parser(where: str):
    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise BoundsError(f"{where}: a number of {len(text)} digits (at most {MAX_INT_DIGITS})")
        return int(text)

    return parse_int


_LONG_NUMBER = re.compile(rf"\d{{{MAX_INT_DIGITS + 1}}}")


def check_json_bounds(
    text: str, where: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> None:
    """`check_json_text` plus the number bound, for a JSON text another library will parse (axolotl
    parses a dataset's tool-call arguments with `json.loads`). Raises BoundsError."""
    check_json_text(text, where, max_bytes, max_depth)
    if _LONG_NUMBER.search(text):
        raise BoundsError(f"{where}: a number of more than {MAX_INT_DIGITS} digits")


def loads_json(raw: bytes | str, where: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH):
    """`json.loads` after `check_json_text`, refusing integers over `MAX_INT_DIGITS` digits.

    Raises BoundsError, json.JSONDecodeError, UnicodeDecodeError."""
    check_json_text(raw, where, max_bytes, max_depth)
    return json.loads(raw, parse_int=_int_parser(where))


def load_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH):
    """Read and parse a JSON file within the bounds. Raises BoundsError, OSError, JSONDecodeError, UnicodeDecodeError."""
    raw = read_bounded(path, max_bytes)
    return loads_json(raw, str(path), max_bytes, max_depth)


# -- YAML --------------------------------------------------------------------------------------------
class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader whose composer refuses deep nesting and alias bombs."""

    max_depth = MAX_DEPTH
    where = "YAML"

    def compose_node(self, parent, index):
        depth = getattr(self, "_depth", 0) + 1
        if depth > self.max_depth:
            mark = self.peek_event().start_mark
            raise BoundsError(f"{self.where}:{mark.line + 1}: nested more than {self.max_depth} levels deep")
        self._depth = depth
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth - 1

    def construct_bounded_int(self, node):
        if len(node.value) > MAX_INT_DIGITS:
            raise BoundsError(
                f"{self.where}:{node.start_mark.line + 1}: a number of {len(node.value)} digits "
                f"(at most {MAX_INT_DIGITS})"
            )
        return self.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_bounded_int)


def _expanded_size(node, where: str) -> int:
    """Nodes of a composed document with every alias expanded; refuses self-reference and bombs."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        key = id(n)
        if done:
            children = _children(n)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            active.discard(key)
            if sizes[key] > MAX_YAML_NODES:
                raise BoundsError(f"{where}: its aliases expand to more than {MAX_YAML_NODES} values")
            continue
        if key in sizes:
            continue
        if key in active:
            raise BoundsError(f"{where}: an alias refers to a node that contains it (a recursive document)")
        active.add(key)
        stack.append((n, True))
        stack.extend((c, False) for c in _children(n) if id(c) not in sizes)
    return sizes[id(node)]


def _children(n) -> list:
    if isinstance(n, yaml.SequenceNode):
        return list(n.value)
    if isinstance(n, yaml.MappingNode):
        return [x for kv in n.value for x in kv]
    return []


def loads_yaml(text: str | bytes, where: str, max_bytes: int = MIB, max_depth: int = MAX_DEPTH):
    """`yaml.safe_load` within the bounds of the module doc. Raises BoundsError or yaml.YAMLError."""
    if len(text) > max_bytes:
        raise BoundsError(f"{where}: {len(text)} bytes, more than {_fmt(max_bytes)}")
    loader = _BoundedLoader(text)
    loader.max_depth, loader.where = max_depth, where
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml_file(path: Path, max_bytes: int = MIB, max_depth: int = MAX_DEPTH):
    """Read and parse a YAML file within the bounds. Raises BoundsError, OSError, UnicodeDecodeError, yaml.YAMLError."""
    raw = read_bounded(path, max_bytes)
    return loads_yaml(raw.decode("utf-8"), str(path), max_bytes, max_depth)


# -- chat templates (Jinja) --------------------------------------------------------------------------
_TPL_BRACKETS = bytes.maketrans(b"([{)]}", b"\x01\x01\x01\xff\xff\xff")
_TPL_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"([{)]}")
_BLOCK = re.compile(r"{%[-+]?\s*(end)?(if|for|macro|call|filter|block|with|generation)\b")


def check_template(text: str, where: str, max_bytes: int = MIB, max_depth: int = MAX_TEMPLATE_DEPTH) -> None:
    """Raise BoundsError when a Jinja template is larger than `max_bytes` or nests deeper than `max_depth`
    (brackets inside expressions, or blocks)."""
    if len(text) > max_bytes:
        raise BoundsError(f"{where}: {len(text)} characters, more than {_fmt(max_bytes)}")
    # brackets: `{{`/`{%` delimiters count like any bracket and close again, so only the excess matters
    raw = text.encode("utf-8", "surrogatepass").translate(_TPL_BRACKETS, _TPL_NOT_BRACKETS)
    depth = max(accumulate(memoryview(raw).cast("b")), default=0)
    if depth > max_depth + 2:  # + the `{{` of the expression itself
        raise BoundsError(f"{where}: brackets nested {depth} levels deep (at most {max_depth})")
    level = peak = 0
    for m in _BLOCK.finditer(text):
        level += -1 if m.group(1) else 1
        peak = max(peak, level)
        if peak > max_depth:
            raise BoundsError(f"{where}: blocks nested more than {max_depth} levels deep")


def _fmt(n: int) -> str:
    return (
        f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else (f"{n // KIB} KiB" if n >= KIB else f"{n} bytes")
    )
