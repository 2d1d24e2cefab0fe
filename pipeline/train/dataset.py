"""Dataset checks before any training: chat-format JSONL, read the way axolotl will read it.

Each row's conversation is read through axolotl's own `chat_template` prompt strategy
(`axolotl.prompt_strategies.chat_template`: `field_messages`, `message_property_mappings`,
`roles`, `drop_system_message`, the legacy `message_field_role/content` normalised by axolotl's
dataset model, and the chat template's message variables), so a ShareGPT-style file
(`conversations` with `from`/`value`) mapped in the config is checked as the turns axolotl
builds from it, not as raw JSON. Each file is read with the options of its own `datasets` /
`test_datasets` entry. Every finding names `file:line`. A dataset with errors stops the run before the trainer
starts and nothing is written (the check only reads).

Fingerprint: sha256 over each file's bytes (hex), and a combined sha256 over the sorted
(role, file sha256) pairs, so renaming a file does not change it but any byte does.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.bounded import MIB, BoundsError, check_json_bounds, loads_json
from pipeline.artifacts.hashing import sha256_file
from pipeline.findings import Finding, Report

ROLES = {"system", "user", "assistant", "tool"}


MAX_LINE_BYTES = 16 * MIB  # one JSONL conversation (pipeline.artifacts.bounded)


def _error(where: str, message: str, id: str = "dataset.schema") -> Finding:
    return Finding(id, "error", message, where)


def _warning(where: str, message: str, id: str) -> Finding:
    return Finding(id, "warning", message, where)


@dataclass
class FileStats:
    path: str
    role: str  # "train" | "validation"
    sha256: str
    conversations: int = 0
    too_long: int = 0
    max_tokens: int = 0
    mean_tokens: float = 0.0


@dataclass
class DatasetReport(Report):
    files: list[FileStats] = field(default_factory=list)
    duplicates: int = 0
    overlap: int = 0
    sequence_len: int | None = None
    fingerprint: str = ""
    # what axolotl keeps per split (pipeline.train.gate.SplitCount.to_dict), filled by `pipeline train`
    kept: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "fingerprint": self.fingerprint,
            "sequence_len": self.sequence_len,
            "duplicates": self.duplicates,
            "train_validation_overlap": self.overlap,
            "files": [vars(f) for f in self.files],
            "findings": [f.to_dict() for f in self.findings],
            "kept": self.kept,
        }


def _check_tool_call(tc, where: str, out: list[Finding]) -> None:
    if not isinstance(tc, dict):
        out.append(_error(where, "tool_calls entries must be objects", id="dataset.tool_call"))
        return
    fn = tc.get("function", tc)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn.get("name"):
        out.append(
            _error(where, "tool call needs function.name (a non-empty string)", id="dataset.tool_call")
        )
        return
    args = fn.get("arguments")
    if isinstance(args, str):
        try:  # a string inside the line: its depth was not counted with the line's (bounded)
            args = loads_json(args, where, MAX_LINE_BYTES)
        except BoundsError as e:
            out.append(
                _error(
                    where,
                    f"tool call {fn['name']!r}: arguments: {str(e).removeprefix(f'{where}: ')}",
                    id="dataset.tool_call",
                )
            )
            return
        except json.JSONDecodeError as e:
            out.append(
                _error(
                    where,
                    f"tool call {fn['name']!r}: arguments is not valid JSON ({e.msg})",
                    id="dataset.tool_call",
                )
            )
            return
    if not isinstance(args, dict):
        out.append(
            _error(
                where,
                f"tool call {fn['name']!r}: arguments must be a JSON object, got {type(args).__name__}",
                id="dataset.tool_call",
            )
        )


def _parsed_strings_problem(row: dict, messages) -> str | None:
    """Why a string axolotl's reader parses with `json.loads` is over a bound, or None.

    axolotl's chat_template strategy parses a `messages` or `tools` field given as a string, each
    tool's `function.parameters` and each tool call's `function.arguments` given as strings; the
    line's own depth check counts none of them (they are string literals there). 100,000 `[` in a
    tool call's arguments ended `dataset check` and `train` in a RecursionError.
    """
    texts = [("messages", messages)] if isinstance(messages, str) else []
    tools = row.get("tools")
    texts += [("tools", tools)] if isinstance(tools, str) else []
    for t in tools if isinstance(tools, list) else []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), str):
            texts.append((f"tool {fn.get('name')!r} parameters", fn["parameters"]))
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        for v in m.values() if isinstance(m, dict) else []:
            for call in v if isinstance(v, list) else []:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    texts.append((f"message {i}: tool call {fn.get('name')!r} arguments", fn["arguments"]))
    for what, text in texts:
        try:
            check_json_bounds(text, what, MAX_LINE_BYTES)
        except BoundsError as e:
            return str(e)
    return None


def shape_problem(messages, field: str = "messages") -> str | None:
    """What is wrong with the shape of a conversation's list (before any field mapping), or None."""
    if not isinstance(messages, list) or not messages:
        return f"{field!r} must be a non-empty list of messages"
    bad = next((i for i, m in enumerate(messages) if not isinstance(m, dict)), None)
    if bad is not None:
        return f"{field!r} message {bad} is not an object with role and content (got {type(messages[bad]).__name__})"
    return None


def check_conversation(messages, where: str, roles_to_train: Iterable[str]) -> list[Finding]:
    """Schema checks for one conversation. Returns findings (empty when fine)."""
    out: list[Finding] = []
    if not isinstance(messages, list) or not messages:
        return [_error(where, shape_problem(messages))]
    trainable = 0
    for i, m in enumerate(messages):
        w = f"{where} (message {i})"
        if not isinstance(m, dict):
            out.append(_error(w, "each message must be an object"))
            continue
        role = m.get("role")
        if role not in ROLES:
            hint = (
                " (no role after axolotl's field mapping: set message_property_mappings, e.g. "
                "{role: from, content: value}, and roles in this datasets entry)"
                if role is None
                else " (map it with `roles` in the datasets entry, e.g. {user: [human], assistant: [gpt]})"
            )
            out.append(_error(w, f"role {role!r} is not one of {sorted(ROLES)}{hint}"))
            continue
        content = m.get("content")
        tool_calls = m.get("tool_calls")
        if content is not None and not isinstance(content, str):
            out.append(_error(w, f"content must be a string, got {type(content).__name__}"))
        if role == "system" and i != 0:
            out.append(_error(w, "a system message may only come first"))
        if isinstance(tool_calls, list):  # axolotl parses string arguments itself: check them as JSON again
            tool_calls = [
                {**tc, "function": {**tc["function"], "arguments": json.dumps(tc["function"]["arguments"])}}
                if isinstance(tc, dict)
                and isinstance(tc.get("function"), dict)
                and isinstance(tc["function"].get("arguments"), dict)
                else tc
                for tc in tool_calls
            ]
        if tool_calls is not None:
            if role != "assistant":
                out.append(_error(w, "only assistant messages may carry tool_calls"))
            elif not isinstance(tool_calls, list):
                out.append(_error(w, "tool_calls must be a list"))
            else:
                for tc in tool_calls:
                    _check_tool_call(tc, w, out)
        if role == "tool":
            prev = next(
                (p for p in reversed(messages[:i]) if isinstance(p, dict) and p.get("role") != "tool"), None
            )
            if not prev or prev.get("role") != "assistant" or not prev.get("tool_calls"):
                out.append(_error(w, "a tool result must follow an assistant message with tool_calls"))
        if (role in roles_to_train or m.get("training") is True) and (content or tool_calls):
            trainable += 1
        if role in ("user", "system") and not content:
            out.append(_error(w, f"{role} message has empty content"))
    if trainable == 0:
        out.append(
            _error(
                where,
                f"no trainable turn: needs a non-empty message with role in {sorted(roles_to_train)}",
                id="dataset.no_trainable_turn",
            )
        )
    return out


# Used when no tokenizer (so no chat template) is at hand: the message variables templates use.
_FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}{{ message.content }}{{ message.tool_calls }}"
    "{{ message.tool_call_id }}{{ message.name }}{{ message.reasoning_content }}{% endfor %}"
)


def message_reader(ds_cfg: dict | None = None, config: dict | None = None, tokenizer=None) -> Callable:
    """`row -> turns` as axolotl's chat_template strategy builds them for this dataset entry.

    `ds_cfg`: the `datasets` entry (field mappings, roles...); `config`: the whole axolotl config
    (for `chat_template`); `tokenizer`: gives the chat template (its message variables decide
    which extra keys, e.g. `tool_calls`, axolotl keeps). Raises what axolotl raises on a bad row
    (ValueError, TypeError, AttributeError, json.JSONDecodeError).
    """
    from axolotl.prompt_strategies.chat_template import ChatTemplatePrompter, ChatTemplateStrategy
    from axolotl.utils.chat_templates import get_chat_template_from_config
    from axolotl.utils.dict import DictDefault
    from axolotl.utils.schemas.datasets import SFTDataset

    raw = {k: v for k, v in (ds_cfg or {}).items() if v is not None}
    ds = SFTDataset(**{"path": "-", "type": "chat_template", **raw}).model_dump()  # legacy fields -> mappings
    template = _FALLBACK_TEMPLATE
    if tokenizer is not None:
        try:
            template = get_chat_template_from_config(DictDefault(config or {}), ds, tokenizer) or template
        except Exception:  # no template for this choice: axolotl itself reports it when it starts
            pass
    prompter = ChatTemplatePrompter(
        tokenizer=tokenizer,
        chat_template=template,
        message_property_mappings=ds.get("message_property_mappings") or {},
        message_field_training=ds.get("message_field_training"),
        message_field_training_detail=ds.get("message_field_training_detail"),
        field_messages=ds.get("field_messages") or "messages",
        field_thinking=ds.get("field_thinking") or "reasoning_content",
        template_thinking_key=ds.get("template_thinking_key") or "reasoning_content",
        roles=ds.get("roles"),
        drop_system_message=bool(ds.get("drop_system_message")),
    )
    # The strategy's message reading needs only its prompter (no tokenisation happens here).
    strategy = ChatTemplateStrategy.__new__(ChatTemplateStrategy)
    strategy.prompter = prompter
    strategy.split_thinking = bool(ds.get("split_thinking"))

    def read(row):
        return strategy.get_conversation_thread(copy.deepcopy(row))

    # What axolotl keeps of a message (chat_template.py transform_message): the mapped source keys, the
    # variables the template reads from a message, and the training fields; every other key is dropped.
    read.keeps = (
        frozenset(prompter.message_property_mappings.values())
        | frozenset(prompter.chat_template_msg_variables)
        | {f for f in (ds.get("message_field_training"), ds.get("message_field_training_detail")) if f}
    )
    read.template = template if tokenizer is not None else None
    return read


THINKING_KEYS = {
    "thinking",
    "reasoning",
    "thought",
    "thoughts",
    "think",
    "reasoning_text",
    "chain_of_thought",
}


def dropped_keys(raw, keeps) -> list[str]:
    """Message keys with a value that axolotl's reader drops (not mapped, not read by the template)."""
    if not isinstance(raw, list):
        return []
    return sorted(
        {
            k
            for m in raw
            if isinstance(m, dict)
            for k, v in m.items()
            if k not in keeps and v not in (None, "", [], {})
        }
    )


def eos_problem(tokenizer, template: str | None, config: dict | None) -> str | None:
    """Why the tokenizer's eos_token is not the token that ends an assistant turn in `template`, or None.

    axolotl trains the EOS token at the end of each assistant turn (chat_template strategy, `train_on_eos`
    turn): when the template ends turns with another token, the turn terminator is never learned and the
    adapter does not stop. The eos of the config's `special_tokens` wins over the tokenizer's."""
    if tokenizer is None or not template:
        return None
    st = (config or {}).get("special_tokens")
    eos = st.get("eos_token") if isinstance(st, dict) and st.get("eos_token") else tokenizer.eos_token
    marker = "ZQXJ marker reply"  # as pipeline.validate.template.turn_terminator probes it
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that does not render is reported by validate/train
        return None
    if marker not in text:
        return None
    tail = text[text.rindex(marker) + len(marker) :]
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    term = next((t for t in tokenizer.convert_ids_to_tokens(ids) if t in special), None)
    if term is None or term == eos:
        return None
    return (
        f"assistant turns end with {term!r} in the chat template but the eos_token is {eos!r}: axolotl trains the "
        "EOS token at the end of each assistant turn, so the turn terminator is never learned and the adapter does "
        f'not stop; set special_tokens: {{eos_token: "{term}"}} in the axolotl config'
    )


def _canonical(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def check_datasets(
    train: list[Path],
    validation: list[Path] = (),
    *,
    field_messages: str = "messages",
    roles_to_train: Iterable[str] = ("assistant",),
    tokenizer=None,
    sequence_len: int | None = None,
    formats: dict[str, dict] | None = None,
    config: dict | None = None,
) -> DatasetReport:
    """Check chat JSONL files; never raises for bad content (findings carry file:line).

    Args:
        train, validation: JSONL files, one conversation per line.
        formats: {file path as given: its axolotl dataset entry} (field mappings, roles,
            roles_to_train...); a file without one is read with `field_messages` and the defaults.
        config: the axolotl config (its `chat_template` choice).
        tokenizer: a transformers tokenizer with a chat template; when given with
            `sequence_len` (tokens), counts conversations longer than it (axolotl drops them).

    Raises:
        FileNotFoundError: a listed file does not exist.
    """
    default_roles = tuple(roles_to_train)
    report = DatasetReport(sequence_len=sequence_len)
    readers: dict[str, Callable] = {}
    eos_checked: set[str] = set()
    seen: dict[str, str] = {}
    train_keys: set[str] = set()
    for role, files in (("train", train), ("validation", validation)):
        for path in files:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: dataset file not found")
            stats = FileStats(path=str(path), role=role, sha256=sha256_file(path))
            ds_cfg = (formats or {}).get(str(path)) or {"field_messages": field_messages}
            key = json.dumps(ds_cfg, sort_keys=True, default=str)
            if key not in readers:
                readers[key] = message_reader(ds_cfg, config, tokenizer)
            read = readers[key]
            if key not in eos_checked:
                eos_checked.add(key)
                if msg := eos_problem(tokenizer, getattr(read, "template", None), config):
                    report.findings.append(_error(str(path), msg, id="dataset.eos"))
            roles_to_train = tuple(ds_cfg.get("roles_to_train") or default_roles)
            fm = ds_cfg.get("field_messages") or "messages"
            lengths: list[int] = []
            with open(path, encoding="utf-8", errors="strict") as f:
                try:
                    lines = f.read().splitlines()
                except UnicodeDecodeError as e:
                    report.findings.append(
                        _error(f"{path}", f"not UTF-8 ({e.reason} at byte {e.start})", id="dataset.encoding")
                    )
                    report.files.append(stats)
                    continue
            for lineno, line in enumerate(lines, 1):
                where = f"{path}:{lineno}"
                if not line.strip():
                    continue
                try:
                    row = loads_json(line, where, MAX_LINE_BYTES)
                except BoundsError as e:
                    report.findings.append(
                        _error(where, str(e).removeprefix(f"{where}: "), id="dataset.json")
                    )
                    continue
                except json.JSONDecodeError as e:
                    report.findings.append(
                        _error(where, f"invalid JSON: {e.msg} (column {e.colno})", id="dataset.json")
                    )
                    continue
                if not isinstance(row, dict) or row.get(fm) is None:
                    report.findings.append(_error(where, f"expected an object with a {fm!r} list"))
                    continue
                raw = row[fm]
                if not isinstance(raw, list | str):
                    report.findings.append(
                        _error(where, f"{fm!r} must be a list of messages, got {type(raw).__name__}")
                    )
                    continue
                # axolotl's reader would fail on these with a bare IndexError / AttributeError
                if isinstance(raw, list) and (why := shape_problem(raw, fm)):
                    report.findings.append(_error(where, why))
                    continue
                if why := _parsed_strings_problem(row, raw):
                    report.findings.append(_error(where, why, id="dataset.json"))
                    continue
                try:
                    messages = read(row)
                except json.JSONDecodeError as e:
                    if isinstance(raw, str):  # axolotl reads a string field as JSON
                        msg = f"{fm!r} is a string that is not a JSON list of messages ({e.msg}): write the list itself"
                        report.findings.append(_error(where, msg))
                    else:
                        report.findings.append(
                            _error(
                                where,
                                f"tool call arguments is not valid JSON ({e.msg})",
                                id="dataset.tool_call",
                            )
                        )
                    continue
                except KeyError as e:  # axolotl's own reading fails the same way (e.g. KeyError 'role')
                    report.findings.append(
                        _error(
                            where,
                            f"axolotl finds no {e} in the messages of {fm!r}: map your fields with "
                            "message_property_mappings (e.g. {role: from, content: value}) and roles "
                            "in this datasets entry",
                        )
                    )
                    continue
                except (ValueError, TypeError, AttributeError, AssertionError, IndexError) as e:
                    report.findings.append(
                        _error(where, f"axolotl cannot read this conversation from {fm!r}: {e}".strip())
                    )
                    continue
                if dropped := sorted(set(dropped_keys(raw, read.keeps)) & THINKING_KEYS):
                    report.findings.append(
                        _error(
                            where,
                            f"message key(s) {dropped} hold reasoning, but axolotl's chat_template reader drops "
                            f"them (it keeps {sorted(read.keeps)}): that reasoning is never trained; name the key "
                            f"reasoning_content, or set field_thinking: {dropped[0]} in this datasets entry",
                            id="dataset.message_key",
                        )
                    )
                found = check_conversation(messages, where, roles_to_train)
                report.findings.extend(found)
                if any(f.severity == "error" for f in found):
                    continue
                stats.conversations += 1
                key = _canonical(messages)
                if key in seen:
                    report.duplicates += 1
                    report.findings.append(
                        _warning(where, f"exact duplicate of {seen[key]}", id="dataset.duplicate")
                    )
                else:
                    seen[key] = where
                if role == "train":
                    train_keys.add(key)
                elif key in train_keys:
                    report.overlap += 1
                    report.findings.append(
                        _error(
                            where,
                            "conversation also in the training set (leaks into eval)",
                            id="dataset.overlap",
                        )
                    )
                if tokenizer is not None and sequence_len:
                    n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
                    lengths.append(n)
                    if n > sequence_len:
                        stats.too_long += 1
            if lengths:
                stats.max_tokens = max(lengths)
                stats.mean_tokens = round(sum(lengths) / len(lengths), 1)
            if (
                stats.too_long and stats.too_long == stats.conversations
            ):  # axolotl keeps none: train refuses it
                report.findings.append(
                    _error(
                        str(path),
                        f"all {stats.conversations} conversations exceed sequence_len {sequence_len} tokens: "
                        "axolotl keeps none of them (shorten them or raise sequence_len)",
                        id="dataset.too_long",
                    )
                )
            elif stats.too_long:
                report.findings.append(
                    _warning(
                        str(path),
                        f"{stats.too_long} of {stats.conversations} conversations exceed sequence_len "
                        f"{sequence_len} tokens and will be dropped by axolotl",
                        id="dataset.too_long",
                    )
                )
            if stats.conversations == 0 and not any(f.where.startswith(str(path)) for f in report.errors):
                report.findings.append(_error(str(path), "no conversations", id="dataset.empty"))
            report.files.append(stats)
    report.fingerprint = combined_fingerprint([(s.role, s.sha256) for s in report.files])
    return report


def combined_fingerprint(files: Iterable[tuple[str, str]]) -> str:
    """The dataset fingerprint (module docstring) of (role, file sha256) pairs."""
    h = hashlib.sha256()
    for role, sha in sorted(files):
        h.update(f"{role}:{sha}\n".encode())
    return h.hexdigest()


def files_fingerprint(train: list[Path], validation: list[Path] = ()) -> str | None:
    """The fingerprint `check_datasets` would report for these files, from their bytes alone (nothing
    parsed); None when one is not a readable file (the checks then say which and why)."""
    try:
        pairs = [
            (role, sha256_file(Path(p)))
            for role, ps in (("train", train), ("validation", validation))
            for p in ps
        ]
    except OSError:
        return None
    return combined_fingerprint(pairs)
