"""The canary set: validation-split prompts plus templated tool-call conversations, as token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.bounded import MIB, loads_json
from pipeline.errors import UsageError
from pipeline.validate.behaviour import CANARIES
from pipeline.validate.chat import render_hf

# Templated tool-call conversations (qwen3_coder XML tool calls in the chat template): the agent
# workload the fleet serves. The last two end after a tool call / a tool result.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]


_SYSTEM = {"role": "system", "content": "You are a careful operations agent. Use tools when they help."}


_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Osaka", "unit": "celsius"}},
        }
    ],
}


TOOL_CONVERSATIONS = {
    "tool:ask": [_SYSTEM, {"role": "user", "content": "What is the weather in Osaka right now?"}],
    "tool:sql": [_SYSTEM, {"role": "user", "content": "How many invoices were paid last week?"}],
    "tool:result": [
        _SYSTEM,
        {"role": "user", "content": "What is the weather in Osaka right now?"},
        _CALL,
        {
            "role": "tool",
            "name": "get_weather",
            "content": '{"city": "Osaka", "temp_c": 12, "condition": "rain"}',
        },
    ],
}


@dataclass
class Prompt:
    label: str
    ids: list[int]


# -- canary set -----------------------------------------------------------------------------------------------------
def _render(tok, messages: list[dict], tools) -> list[int]:
    text = render_hf(tok, messages, tools, add_generation_prompt=True)  # bounded: the adapter's template
    return list(tok(text, add_special_tokens=False)["input_ids"])


def canary_set(tok, validation_files: list[Path], n: int) -> tuple[list[Prompt], list[str]]:
    """Up to `n` validation conversations cut before their first assistant turn, then the tool-call ones.


    Returns (prompts, notes). Raises UsageError for a file that is not chat JSONL.
    """

    prompts, notes = [], []
    for f in validation_files:
        for i, line in enumerate(Path(f).read_text().splitlines(), 1):
            if len(prompts) >= n:
                break
            if not line.strip():
                continue
            try:
                conv = loads_json(line, f"{f}:{i}", 16 * MIB)
                msgs = conv["messages"]
            except (ValueError, KeyError, TypeError) as e:  # not JSON, over the bounds, no messages
                raise UsageError(f"{f}:{i}: not a chat JSONL line with 'messages' ({e})") from e
            cut = next((j for j, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
            if cut:
                prompts.append(Prompt(f"{Path(f).name}:{i}", _render(tok, msgs[:cut], conv.get("tools"))))
    if not prompts:
        notes.append(
            "no validation conversations (manifest lists none; pass --validation): using fixed prompts"
        )
        prompts = [Prompt(f"fixed:{i}", _render(tok, m, None)) for i, m in enumerate(CANARIES[:n])]
    prompts += [Prompt(label, _render(tok, msgs, TOOLS)) for label, msgs in TOOL_CONVERSATIONS.items()]
    return prompts, notes


def load_tokenizer(adapter_dir: Path, base_dir: Path):
    """The adapter's tokenizer (as trained) when it ships one, else the base's."""
    from transformers import AutoTokenizer

    src = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").exists() else base_dir
    return AutoTokenizer.from_pretrained(str(src))
