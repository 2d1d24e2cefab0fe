"""Tokenizer and chat-template parity: the fleet must tokenize conversations as training did.

vLLM serves a LoRA with the served checkpoint's tokenizer and chat template (the adapter's own
tokenizer files are not used), so:
- tokenizer files shipped with the adapter must match the served base: same vocabulary, no added
  tokens (an added token has no trained embedding row in the served model);
- a fixed set of conversations (plain, multi-turn, system prompt, tool call + tool result,
  reasoning) rendered with the training template and with the served template must give the same
  token ids, and so must every prompt (`add_generation_prompt`); the first divergence is reported
  with decoded context;
- the token that ends an assistant turn in the training template must be the training tokenizer's
  `eos_token` (axolotl trains the EOS token at the end of each turn: otherwise the turn terminator is
  never learned and the adapter does not stop), and one the served engine stops at.

The training template is the one axolotl resolved (`chat_template` / `chat_template_jinja`, per-dataset
override first: axolotl/utils/chat_templates/base.py `get_chat_template_from_config`, whose named templates
are read from axolotl's package data without importing it), else the template shipped with the adapter
(`chat_template.jinja`, even without tokenizer files). Rendering uses `pipeline.validate.chat` (jinja2 +
tokenizers, no transformers).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from pipeline.artifacts.bounded import MIB, load_yaml_file
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.errors import UsageError
from pipeline.validate.chat import ChatTokenizer, TokenizerError, has_tokenizer, read_template, render
from pipeline.validate.facts import Fact, Unavailable

CONTEXT_TOKENS = 8
BOTH = ("adapter", "train")

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# The fixed conversations rendered with both templates: {name: (messages, tools)}.
CONVERSATIONS: dict[str, tuple[list[dict], list[dict] | None]] = {
    "plain": (
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
        ],
        None,
    ),
    "multi_turn": (
        [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And an even one?"},
            {"role": "assistant", "content": "2"},
        ],
        None,
    ),
    "system": (
        [
            {"role": "system", "content": "You are a careful operations agent."},
            {"role": "user", "content": "Status?"},
            {"role": "assistant", "content": "All systems nominal."},
        ],
        None,
    ),
    "tool_call": (
        [
            {"role": "user", "content": "Weather in Tokyo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}
                ],
            },
            {"role": "tool", "name": "get_weather", "content": '{"temp_c": 3}'},
            {"role": "assistant", "content": "It is 3 C in Tokyo."},
        ],
        _TOOLS,
    ),
    "reasoning": (
        [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No, 91 = 7 x 13."},
        ],
        None,
    ),
    # reasoning on an earlier turn too: templates differ in which turns keep it (every turn, the last only,
    # those after the last user message), which no conversation with reasoning on its last turn alone shows
    "reasoning_history": (
        [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No."},
            {"role": "user", "content": "And 97?"},
            {"role": "assistant", "reasoning_content": "No divisor up to 9.", "content": "Yes."},
        ],
        None,
    ),
}
MARKER = "ZQXJ marker reply"


# -- resolving the training template ------------------------------------------------------------------------------
def axolotl_named_template(name: str) -> str | None:
    """The text of axolotl's named chat template `name` (axolotl/utils/chat_templates/templates/<name>.jinja)."""
    spec = importlib.util.find_spec("axolotl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        f = Path(root) / "utils" / "chat_templates" / "templates" / f"{name}.jinja"
        if f.is_file():
            return f.read_text()
    return None


def _template_choice(data: dict) -> tuple[str, str | None]:
    """(chat_template, chat_template_jinja) for the first dataset, as axolotl picks them: the dataset's
    own entry, else the config's, else `tokenizer_default`."""
    ds = (data.get("datasets") or [None])[0]
    src = ds if isinstance(ds, dict) and ds.get("chat_template") else data
    return src.get("chat_template") or "tokenizer_default", src.get("chat_template_jinja")


def resolve_axolotl_template(data: dict, tokenizer_template: str | None) -> tuple[str, str]:
    """(template text, choice) the way axolotl's `get_chat_template_from_config` resolves it for the first dataset.

    Raises ValueError when axolotl would (no template on the tokenizer for tokenizer_default, unknown name).
    """
    choice, jinja = _template_choice(data)
    if choice == "jinja":
        if not jinja:
            raise ValueError("chat_template: jinja without chat_template_jinja")
        p = Path(str(jinja))
        return (p.read_text() if p.is_file() else str(jinja)), choice
    if choice == "tokenizer_default":
        if not tokenizer_template:
            raise ValueError("chat_template: tokenizer_default but the tokenizer has no chat_template")
        return tokenizer_template, choice
    prefix = "tokenizer_default_fallback_"
    if choice.startswith(prefix):
        if tokenizer_template:
            return tokenizer_template, choice
        choice = choice[len(prefix) :]
    named = axolotl_named_template(choice)
    if named is None:
        raise ValueError(f"chat_template {choice!r} is not one of axolotl's templates")
    return named, choice


def check_training_config(path: Path) -> dict:
    """An explicitly given `--training-config`: its mapping. Raises UsageError (exit 2: the option is
    wrong, not the adapter) when the file is missing, not YAML or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--training-config {p}: no such file (give the run's resolved.yml)")
    try:
        data = load_yaml_file(p, 4 * MIB)
    except (yaml.YAMLError, ValueError) as e:  # not YAML, not UTF-8, over the bounds
        raise UsageError(f"--training-config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is not None and not isinstance(data, dict):
        raise UsageError(f"--training-config {p}: an axolotl config is a mapping, got {type(data).__name__}")
    return data or {}


def training_config_path(adapter_dir: Path, training_config: Path | None) -> Path | None:
    """The resolved axolotl config: the one given, else `resolved_config` from manifest.json if it exists."""
    if training_config is not None:
        return Path(training_config)
    mp = Path(adapter_dir) / "manifest.json"
    if mp.is_symlink() or not mp.is_file():
        return None
    try:
        rc = read_adapter_manifest(adapter_dir).resolved_config
    except (FileNotFoundError, ValueError, OSError):
        return None
    return Path(rc) if rc and Path(rc).is_file() else None


@dataclass
class TrainingSide:
    template: str
    tokenizer: ChatTokenizer | None  # None: the adapter ships a template only
    source: str
    # what axolotl passed the template besides the messages (the config's `chat_template_kwargs`, e.g.
    # enable_thinking: false; axolotl/prompt_strategies/chat_template.py build_prompt); vLLM renders a request
    # without them unless the client sends them
    kwargs: dict = field(default_factory=dict)


def training_side_from_config(
    data: dict, cfg_path, adapter_dir: Path | None = None, base_dir: Path | None = None
) -> TrainingSide | None:
    """The training template and tokenizer from an axolotl config (tokenizer from `tokenizer_config` /
    `base_model`, else the adapter's, else `base_dir`'s: the base the adapter is validated against,
    whose tokenizer axolotl loads from `base_model`). A named template (chatml, qwen3_5...) is
    resolved without a tokenizer (the served one tokenizes it). Raises TokenizerError / ValueError
    (e.g. an unknown chat_template name)."""
    tok_src = data.get("tokenizer_config") or data.get("base_model")
    tok = None
    for d in (Path(str(tok_src)) if tok_src else None, adapter_dir, base_dir):
        if d is not None and has_tokenizer(Path(d)):
            tok = ChatTokenizer.load(Path(d))
            break
    if tok is None:
        needs_tokenizer = str(_template_choice(data)[0]).startswith("tokenizer_default")
        tmpl, choice = (None, None) if needs_tokenizer else resolve_axolotl_template(data, None)
        kwargs = data.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        return TrainingSide(tmpl, None, f"{cfg_path} (chat_template: {choice})", kwargs) if tmpl else None
    overrides = (data.get("special_tokens") or {}) if isinstance(data.get("special_tokens"), dict) else {}
    for k, v in overrides.items():
        if isinstance(v, str):
            tok.special[k] = v
            if k == "eos_token":
                i = tok.tokenizer.token_to_id(v)
                tok.eos_ids = {i} if i is not None else set()
    tmpl, choice = resolve_axolotl_template(data, tok.template)
    kwargs = data.get("chat_template_kwargs")
    return TrainingSide(
        tmpl, tok, f"{cfg_path} (chat_template: {choice})", dict(kwargs) if isinstance(kwargs, dict) else {}
    )


def training_side(
    adapter_dir: Path, training_config: Path | None, base_dir: Path | None = None
) -> TrainingSide | None:
    cfg_path = training_config_path(adapter_dir, training_config)
    if cfg_path is not None:
        data = load_yaml_file(Path(cfg_path), 4 * MIB) or {}
        side = training_side_from_config(data, cfg_path, adapter_dir, base_dir)
        if side is not None:
            return side
    tmpl = read_template(adapter_dir)
    if tmpl:
        tok = ChatTokenizer.load(adapter_dir) if has_tokenizer(adapter_dir) else None
        what = "tokenizer files" if tok else "chat_template.jinja (no tokenizer files)"
        return TrainingSide(tmpl, tok, f"{adapter_dir} {what}")
    return None


# -- rendering and comparing --------------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token id (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def turn_terminator(tok: ChatTokenizer, template: str) -> str | None:
    """The first special/added token after an assistant reply in `template`, as text (e.g. `<|im_end|>`)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": MARKER}]
    text = render(template, msgs, None, tok.special, enable_thinking=True)
    if MARKER not in text:
        return None
    tail = text[text.rindex(MARKER) + len(MARKER) :]
    added = tok.added()
    for i in tok.encode(tail):
        content = tok.tokenizer.id_to_token(i)
        if content in added:
            return content
    return None


# -- facts per context ---------------------------------------------------------------------------------------------
def served_tokenizer_dir(ctx) -> Path | None:
    """The tokenizer the fleet uses: the served checkpoint's, else the base's (same model)."""
    for ck in (ctx.served_fact.value, ctx.base_fact.value):
        if ck is not None and has_tokenizer(ck.path):
            return ck.path
    return None


def compare(train: TrainingSide, served: ChatTokenizer):
    """([(name, train ids, served ids, first differing index)], [(name, render error)])."""
    diverged, failed = [], []
    try:
        items = list(_safe_renderings(train, served, failed))
    except Exception as e:  # noqa: BLE001 - a template that does not compile is a finding
        return [], [("all", f"{type(e).__name__}: {e}")]
    for name, a, b in items:
        i = first_divergence(a, b)
        if i is not None:
            diverged.append((name, a, b, i))
    return diverged, failed


def _safe_renderings(train, served, failed):
    ttok = train.tokenizer or served
    for name, (messages, tools) in CONVERSATIONS.items():
        last_user = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
        for label, msgs, gen in (
            (name, messages, False),
            (f"{name} (generation prompt)", messages[: last_user + 1], True),
        ):
            try:
                a = ttok.render_ids(  # as axolotl rendered it: with the config's chat_template_kwargs
                    train.template,
                    msgs,
                    tools,
                    add_generation_prompt=gen,
                    **{"enable_thinking": True, **train.kwargs},
                )
                b = served.render_ids(  # vLLM picks the tokenizer's "tool_use" template for requests with tools
                    served.template_for(tools), msgs, tools, add_generation_prompt=gen, enable_thinking=True
                )
            except Exception as e:  # noqa: BLE001 - jinja errors are findings
                failed.append((label, f"{type(e).__name__}: {e}"))
                continue
            yield label, a, b


@dataclass(frozen=True)
class AddedTokens:
    """Tokens the training tokenizer adds that the served one lacks: [(token, id or None)], and where."""

    tokens: list
    where: str


@dataclass(frozen=True)
class Comparison:
    """The fixed conversations rendered with the training and the served template."""

    diverged: list  # [(name, training ids, served ids, first differing index)]
    failed: list  # [(name, render error)]
    where: str
    train: TrainingSide
    served: ChatTokenizer


class TemplateFacts:
    """Tokenizer/template facts, shared by the adapter and the training-config contexts.

    Subclasses provide `_training_side()` -> TrainingSide | None (raising TokenizerError / ValueError /
    OSError), `training_where` and `_added_tokens()` -> AddedTokens.
    """

    @cached_property
    def served_tokenizer_dir(self) -> Path | None:
        return served_tokenizer_dir(self)

    @cached_property
    def served_tokenizer(self) -> Fact[ChatTokenizer]:
        """The tokenizer the fleet uses (the served checkpoint's, else the base's), or why it cannot be loaded."""
        d = self.served_tokenizer_dir
        if d is None:
            return Fact()
        return Fact.of(lambda: ChatTokenizer.load(d), TokenizerError, OSError)

    @cached_property
    def training(self) -> Fact[TrainingSide]:
        try:
            return Fact(self._training_side())
        except (TokenizerError, ValueError, OSError) as e:
            return Fact(None, f"{type(e).__name__}: {e}")

    @cached_property
    def added_tokens(self) -> AddedTokens:
        return self._added_tokens()

    @cached_property
    def template_comparison(self) -> Comparison:
        """The comparison of both templates; Unavailable when there is nothing to compare."""
        train, served = self.training.value, self.served_tokenizer.value
        if train is None or served is None or not served.template:
            raise Unavailable
        diverged, failed = compare(train, served)
        return Comparison(diverged, failed, f"training {train.source} vs served {served.path}", train, served)
