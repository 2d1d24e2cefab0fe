"""Tokenizers and chat templates without transformers: `tokenizers` for ids, jinja2 for templates.

Renders exactly as transformers' `apply_chat_template` does (transformers/utils/chat_template_utils.py
`_compile_jinja_template` / `render_jinja_template`; the environment is in `pipeline.artifacts.templates`,
which renders out of process within memory, time and output bounds), with the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) plus caller kwargs as template variables.
`tests/validate/test_chat.py` checks the rendering against transformers on the tiny base.
Importing transformers costs seconds; this keeps `pipeline validate` without `--behaviour` fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts import templates
from pipeline.artifacts.adapter_files import ADAPTER_FILES
from pipeline.artifacts.bounded import MIB, BoundsError, check_template, load_json_file, read_bounded
from pipeline.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # transformers CHAT_TEMPLATE_DIR: named templates
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(UsageError, ValueError):
    """Tokenizer or template files that cannot be read (corrupt JSON, bad template syntax...)."""


def render(template: str, messages, tools=None, special: dict | None = None, **kwargs) -> str:
    """Render `messages` with a chat template as transformers does, in the bounded worker of
    `pipeline.artifacts.templates` (the template may come from an untrusted adapter directory).

    Raises TemplateRenderError (a ValueError): jinja's error, or the template went past a bound.
    """
    variables = {"messages": messages, "tools": tools, "documents": None, **(special or {}), **kwargs}
    return templates.render(template, variables)


def render_hf(tok, messages, tools=None, **kwargs) -> str:
    """`tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)` of a transformers
    tokenizer, rendered in the bounded worker: the template and special tokens are the tokenizer's
    (`get_chat_template`, `special_tokens_map`, as transformers passes them), so an adapter's template
    runs within the bounds in `--behaviour` and `canary` too, not in this process."""
    special = {
        k: (v if isinstance(v, str | list) else str(v)) for k, v in (tok.special_tokens_map or {}).items()
    }
    return render(tok.get_chat_template(None, tools), messages, tools, special, **kwargs)


def _token_text(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(p: Path) -> dict:
    try:
        d = load_json_file(p, ADAPTER_FILES.get(p.name, 64 * MIB))
    except BoundsError as e:
        raise TokenizerError(str(e)) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"{p}: not valid JSON ({getattr(e, 'msg', e)} at line {getattr(e, 'lineno', 1)})"
        ) from e
    if not isinstance(d, dict):
        raise TokenizerError(f"{p}: must be a JSON object")
    return d


def _template_file(f: Path) -> str:
    try:
        text = read_bounded(f, ADAPTER_FILES[TEMPLATE_FILE], "a chat template").decode("utf-8")
        check_template(text, str(f))
    except (BoundsError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{f}: {e}" if isinstance(e, UnicodeDecodeError) else str(e)) from e
    return text


MAX_NAMED_TEMPLATES = 16  # additional_chat_templates/*.jinja read (a tokenizer ships one or two)


def read_templates(d: Path) -> dict[str, str]:
    """The chat templates a directory ships, by name, as transformers reads them (tokenization_utils_base.py
    `from_pretrained`): `chat_template.jinja` ("default") and `additional_chat_templates/<name>.jinja`, which take
    priority over tokenizer_config.json's `chat_template` (a string: "default"; a list of {name, template}).
    Raises TokenizerError."""
    d = Path(d)
    out: dict[str, str] = {}
    f = d / TEMPLATE_FILE
    if f.is_file() and not f.is_symlink():
        out["default"] = _template_file(f)
    extra = d / TEMPLATE_DIR
    if extra.is_dir() and not extra.is_symlink():
        named = sorted(p for p in extra.glob("*.jinja") if p.is_file() and not p.is_symlink())
        for p in named[:MAX_NAMED_TEMPLATES]:
            out[p.name.removesuffix(".jinja")] = _template_file(p)
    if out:
        return out
    tc = d / "tokenizer_config.json"
    if not (tc.is_file() and not tc.is_symlink()):
        return {}
    t = _read_json(tc).get("chat_template")
    if isinstance(t, str):
        out = {"default": t}
    elif isinstance(t, list):
        out = {
            x["name"]: x["template"]
            for x in t[:MAX_NAMED_TEMPLATES]
            if isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("template"), str)
        }
    for name, text in out.items():
        try:
            check_template(text, f"{tc}: chat_template {name}")
        except BoundsError as e:
            raise TokenizerError(str(e)) from e
    return out


def read_template(d: Path) -> str | None:
    """The default chat template a directory ships (`read_templates`' "default"). Raises TokenizerError."""
    return read_templates(d).get("default")


def has_tokenizer(d: Path | None) -> bool:
    return d is not None and (Path(d) / "tokenizer.json").is_file()


@dataclass
class ChatTokenizer:
    """A directory's fast tokenizer (`tokenizer.json`), special tokens and chat template."""

    path: Path
    tokenizer: object  # tokenizers.Tokenizer
    special: dict[str, str] = field(default_factory=dict)  # bos_token/eos_token/... -> text
    template: str | None = None
    eos_ids: set[int] = field(default_factory=set)  # ids generation stops at (eos + generation_config)
    templates: dict[str, str] = field(default_factory=dict)  # every named template ("default", "tool_use"...)

    def template_for(self, tools) -> str | None:
        """The template a request uses: "tool_use" when tools are passed and the tokenizer has one, else the
        default (transformers `get_chat_template`, which vLLM calls with the request's tools: renderers/hf.py
        resolve_chat_template)."""
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.template

    @classmethod
    def load(cls, d: Path) -> ChatTokenizer:
        """Raises TokenizerError naming the file for any unreadable or corrupt tokenizer file."""
        from tokenizers import Tokenizer

        d = Path(d)
        tj = d / "tokenizer.json"
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the Rust error says what is wrong; it becomes a finding
            raise TokenizerError(f"{tj}: cannot be loaded by `tokenizers` ({str(e)[:300]})") from e
        special: dict[str, str] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            p = d / name
            if p.is_file() and not p.is_symlink():
                data = _read_json(p)
                for k in SPECIAL_KEYS:
                    t = _token_text(data.get(k))
                    if t is not None:
                        special[k] = t
        templates = read_templates(d)
        ct = cls(d, tok, special, templates.get("default"), templates=templates)
        if "eos_token" in special and (i := tok.token_to_id(special["eos_token"])) is not None:
            ct.eos_ids.add(i)
        gc = d / "generation_config.json"
        if gc.is_file() and not gc.is_symlink():
            e = _read_json(gc).get("eos_token_id")
            ct.eos_ids.update(x for x in ([e] if isinstance(e, int) else e or []) if isinstance(x, int))
        return ct

    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def added(self) -> dict[str, int]:
        """Added tokens (special or not): {content: id}."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_ids(self, template: str, messages, tools=None, **kwargs) -> list[int]:
        return self.encode(render(template, messages, tools, self.special, **kwargs))
