"""Tokenizer and chat-template checks: the fleet must tokenize conversations as training did.

vLLM serves a LoRA with the served checkpoint's tokenizer and chat template (the adapter's
own tokenizer files are not used), so:
- tokenizer files shipped with the adapter must match the served base: same vocabulary, no
  added tokens (an added token has no trained embedding row in the served model);
- a fixed set of conversations (plain, multi-turn, system prompt, tool call + tool result,
  reasoning) rendered with the training template (axolotl's `chat_template` choice, resolved by
  axolotl itself) and with the served template must give the same token ids; the first
  divergence is reported with decoded context.

transformers (and axolotl's template lookup) are imported only when there is something to compare.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.artifacts.manifest import read_manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONTEXT_TOKENS = 8

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
}


def _has_tokenizer(d: Path | None) -> bool:
    return d is not None and any((Path(d) / f).is_file() for f in TOKENIZER_FILES)


def _load_tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def served_tokenizer_dir(served, base) -> Path | None:
    """The tokenizer the fleet uses: the served checkpoint's, else the base's (same model)."""
    for ck in (served, base):
        if ck is not None and _has_tokenizer(ck.path):
            return ck.path
    return None


def check_tokenizer(adapter_dir: Path, served_tok, served_dir: Path, rep) -> None:
    """Adapter-shipped tokenizer vs the served one: same vocabulary and no added tokens."""
    try:
        atok = _load_tokenizer(adapter_dir)
    except Exception as e:  # noqa: BLE001 - any load failure is a finding, not a crash
        rep.add(
            "tokenizer.unreadable",
            "error",
            f"tokenizer files cannot be loaded ({type(e).__name__}: {e}): remove "
            "them or copy the served base's",
            str(adapter_dir),
        )
        return
    av, sv = atok.get_vocab(), served_tok.get_vocab()
    s_added = {t.content for t in served_tok.added_tokens_decoder.values()}
    added = sorted((t.content, i) for i, t in atok.added_tokens_decoder.items() if t.content not in s_added)
    extra = sorted((i, t) for t, i in av.items() if t not in sv)
    if added:
        rep.add(
            "tokenizer.added_tokens",
            "error",
            f"the adapter's tokenizer adds {len(added)} token(s) the served base "
            f"lacks, e.g. {added[:5]}: they have no trained embedding in the served model; retrain without "
            "adding tokens (no `tokens:`/`special_tokens` additions in the axolotl config)",
            str(adapter_dir / "tokenizer.json"),
        )
    added_ids = {i for _, i in added}
    other = [(i, t) for i, t in extra if i not in added_ids]
    moved = sorted((av[t], t, sv[t]) for t in av.keys() & sv.keys() if av[t] != sv[t])
    lacking = sorted((i, t) for t, i in sv.items() if t not in av)
    if other or moved or lacking:
        first = (
            other[:3]
            or [(i, f"{t} (served id {j})") for i, t, j in moved[:3]]
            or [(i, f"{t} (only in served)") for i, t in lacking[:3]]
        )
        rep.add(
            "tokenizer.vocab",
            "error",
            f"vocabulary differs from the served base ({len(av)} vs {len(sv)} "
            f"tokens; first differences {first}): the adapter was trained with another tokenizer; retrain with "
            f"the served base's tokenizer ({served_dir})",
            str(adapter_dir / "tokenizer.json"),
        )


def training_config_path(adapter_dir: Path, training_config: Path | None) -> Path | None:
    """The resolved axolotl config: the one given, else `resolved_config` from manifest.json if it exists."""
    if training_config is not None:
        return Path(training_config)
    try:
        rc = read_manifest(adapter_dir).get("resolved_config")
    except (FileNotFoundError, ValueError):
        return None
    return Path(rc) if rc and Path(rc).is_file() else None


def training_template(adapter_dir: Path, training_config: Path | None):
    """(template source text, tokenizer, description) of the template used in training, or None.

    From the resolved axolotl config (`chat_template` / `chat_template_jinja`, per-dataset
    override first, `tokenizer_default` read from `tokenizer_config` or `base_model`) via
    axolotl's own `get_chat_template_from_config`; else the template axolotl saved with the
    adapter's tokenizer files.
    """
    import yaml

    cfg_path = training_config_path(adapter_dir, training_config)
    if cfg_path is not None:
        data = yaml.safe_load(Path(cfg_path).read_text()) or {}
        tok_src = data.get("tokenizer_config") or data.get("base_model")
        tok = None
        if tok_src and _has_tokenizer(Path(str(tok_src))):
            tok = _load_tokenizer(Path(str(tok_src)))
        elif _has_tokenizer(adapter_dir):
            tok = _load_tokenizer(adapter_dir)
        if tok is not None:
            from axolotl.utils.chat_templates import get_chat_template_from_config

            ds = (data.get("datasets") or [None])[0]
            tmpl = get_chat_template_from_config(data, ds if isinstance(ds, dict) else None, tok)
            return (
                tmpl,
                tok,
                f"{cfg_path} (chat_template: {data.get('chat_template') or 'tokenizer_default'})",
            )
    if _has_tokenizer(adapter_dir):
        tok = _load_tokenizer(adapter_dir)
        if tok.chat_template:
            return tok.chat_template, tok, f"{adapter_dir} tokenizer files"
    return None


def _render(tok, template: str, messages, tools) -> list[int]:
    text = tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, enable_thinking=True
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token id (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_templates(train_tmpl: str, train_tok, served_tok, where: str, rep) -> None:
    """Render CONVERSATIONS with both templates; one `template.divergence` per differing conversation."""
    served_tmpl = served_tok.chat_template
    diverged = []
    for name, (messages, tools) in CONVERSATIONS.items():
        try:
            a = _render(train_tok, train_tmpl, messages, tools)
            b = _render(served_tok, served_tmpl, messages, tools)
        except Exception as e:  # noqa: BLE001 - jinja errors are findings
            rep.add(
                "template.render",
                "error",
                f"conversation {name!r} does not render ({type(e).__name__}: {e}): "
                "the two templates do not support the same messages; serve with the training template",
                where,
            )
            continue
        i = first_divergence(a, b)
        if i is None:
            continue
        diverged.append(name)
        ctx = train_tok.decode(a[max(0, i - CONTEXT_TOKENS) : i])
        rep.add(
            "template.divergence",
            "error",
            f"conversation {name!r}: token {i} differs; after {ctx!r} training renders "
            f"{train_tok.decode(a[i : i + CONTEXT_TOKENS])!r} but the fleet renders "
            f"{served_tok.decode(b[i : i + CONTEXT_TOKENS])!r}: serve with the training template "
            "(vLLM --chat-template) or retrain with the served checkpoint's template",
            where,
        )
    rep.stats["template_conversations"] = {"rendered": len(CONVERSATIONS), "diverged": diverged}


def run(adapter_dir: Path, base, served, rep, training_config: Path | None = None) -> None:
    """Tokenizer + template checks; skipped (with an info check) when there is nothing to compare."""
    if training_config_path(adapter_dir, training_config) is None and not _has_tokenizer(adapter_dir):
        rep.add(
            "template.unchecked",
            "info",
            "no training template found (no resolved axolotl config, no tokenizer files with the adapter): "
            "tokenizer and chat template not compared; pass --training-config",
            str(adapter_dir),
        )
        return
    tok_dir = served_tokenizer_dir(served, base)
    if tok_dir is None:
        rep.add(
            "template.unchecked",
            "info",
            "no served or base tokenizer available: tokenizer and chat template not compared",
            "",
        )
        return
    served_tok = _load_tokenizer(tok_dir)
    if _has_tokenizer(adapter_dir):
        check_tokenizer(adapter_dir, served_tok, tok_dir, rep)
    try:
        tt = training_template(adapter_dir, training_config)
    except Exception as e:  # noqa: BLE001
        rep.add(
            "template.training",
            "error",
            f"cannot resolve the training chat template ({type(e).__name__}: {e}): "
            "pass --training-config with the run's resolved.yml",
            str(training_config or adapter_dir),
        )
        return
    if tt is None:
        rep.add(
            "template.unchecked",
            "info",
            "no training template found (no resolved axolotl config, no tokenizer "
            "files with the adapter): chat template not compared; pass --training-config",
            str(adapter_dir),
        )
        return
    if not served_tok.chat_template:
        rep.add(
            "template.served_missing",
            "error",
            f"the served tokenizer ({tok_dir}) has no chat template: vLLM "
            "chat requests would fail; ship chat_template.jinja with the served checkpoint",
            str(tok_dir),
        )
        return
    tmpl, train_tok, source = tt
    rep.stats["template_source"] = {"training": source, "served": str(tok_dir)}
    compare_templates(tmpl, train_tok, served_tok, f"training {source} vs served {tok_dir}", rep)
