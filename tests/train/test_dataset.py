"""Dataset checks: every finding names file:line; the shipped sample dataset passes."""

import json

import pytest

from pipeline.train.dataset import check_datasets
from tests.support.helpers import REPO

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_sample_dataset_passes_with_fingerprint():
    rep = check_datasets(
        [REPO / "datasets/agent_chat_train.jsonl"], [REPO / "datasets/agent_chat_validation.jsonl"]
    )
    assert rep.ok, [str(f) for f in rep.errors]
    assert rep.files[0].conversations == 120 and rep.files[1].conversations == 20
    assert len(rep.fingerprint) == 64 and rep.overlap == 0


def test_fingerprint_changes_with_any_byte(tmp_path):
    a = write(tmp_path / "a.jsonl", [GOOD])
    f1 = check_datasets([a]).fingerprint
    write(tmp_path / "a.jsonl", [GOOD, GOOD])
    assert check_datasets([a]).fingerprint != f1


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"messages": [', "invalid JSON"),
        ({"msgs": []}, "expected an object with a 'messages' list"),
        # new-user finding: a string here was reported as a tool-call error
        ({"messages": "nope"}, "'messages' is a string that is not a JSON list"),
        ({"messages": 7}, "'messages' must be a list of messages, got int"),
        ({"messages": []}, "'messages' must be a non-empty list"),  # helper-7: "list index out of range"
        (
            {"messages": [7]},
            "'messages' message 0 is not an object",
        ),  # helper-7: "'int' object has no attribute 'get'"
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no trainable turn"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]},
            "content must be a string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                    },
                ]
            },
            "arguments is not valid JSON",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "tool", "content": "r"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "must follow an assistant message with tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": "s"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "system message may only come first",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, row, message):
    f = write(tmp_path / "d.jsonl", [GOOD, GOOD | {"id": 1}, row])
    rep = check_datasets([f])
    assert not rep.ok
    err = rep.errors[0]
    assert err.where.startswith(f"{f}:3"), err.where
    assert message in err.message


def test_duplicates_warn_and_overlap_errors(tmp_path):
    t = write(tmp_path / "t.jsonl", [GOOD, GOOD])
    v = write(tmp_path / "v.jsonl", [GOOD])
    rep = check_datasets([t], [v])
    assert rep.duplicates == 2 and rep.overlap == 1
    assert any(f.where == f"{v}:1" and "also in the training set" in f.message for f in rep.errors)


def test_length_check_counts_too_long(tmp_path, tiny_base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    long = {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}
    f = write(tmp_path / "d.jsonl", [GOOD, long])
    rep = check_datasets([f], tokenizer=tok, sequence_len=64)
    assert rep.files[0].too_long == 1 and rep.ok
    assert any("exceed sequence_len 64" in w.message for w in rep.findings)


# -- read as axolotl reads (issue 17 item 5) -------------------------------------------------------------------
def _sharegpt(src, dst, role_key="from", content_key="value", names=None):
    """The sample dataset rewritten ShareGPT-style: `conversations` with `from`/`value` and human/gpt roles."""
    names = names or {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
    rows = []
    for line in src.read_text().splitlines():
        row = json.loads(line)
        conv = []
        for m in row["messages"]:
            t = {k: v for k, v in m.items() if k not in ("role", "content")}
            t[role_key] = names[m["role"]]
            t[content_key] = m.get("content")
            conv.append(t)
        rows.append({"conversations": conv})
    return write(dst, rows)


SHAREGPT = {
    "type": "chat_template",
    "field_messages": "conversations",
    "message_property_mappings": {"role": "from", "content": "value"},
    "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"], "tool": ["tool"]},
}


def test_sharegpt_with_mappings_passes(tmp_path):
    """The issue's instance: ShareGPT with message_property_mappings/roles got one 'role None' error per row."""
    t = _sharegpt(REPO / "datasets/agent_chat_train.jsonl", tmp_path / "t.jsonl")
    v = _sharegpt(REPO / "datasets/agent_chat_validation.jsonl", tmp_path / "v.jsonl")
    fmt = {str(t): SHAREGPT, str(v): SHAREGPT}
    rep = check_datasets([t], [v], formats=fmt)
    assert rep.ok, [str(f) for f in rep.errors[:3]]
    assert rep.files[0].conversations == 120
    # without the mapping, the error says how to fix it
    bad = check_datasets([t], formats={str(t): {"field_messages": "conversations"}})
    assert not bad.ok and "message_property_mappings" in bad.errors[0].message


def test_legacy_message_field_names_are_honoured(tmp_path):
    """Sibling: axolotl's deprecated message_field_role / message_field_content still map fields."""
    t = _sharegpt(REPO / "datasets/agent_chat_validation.jsonl", tmp_path / "t.jsonl", "speaker", "text")
    fmt = {
        str(t): {
            "field_messages": "conversations",
            "message_field_role": "speaker",
            "message_field_content": "text",
        }
    }
    rep = check_datasets([t], formats=fmt)
    assert rep.ok, [str(f) for f in rep.errors[:3]]


def test_each_file_is_read_with_its_own_entry(tmp_path):
    """Sibling: train in ShareGPT, validation in OpenAI messages (the first entry's options used to apply to all)."""
    t = _sharegpt(REPO / "datasets/agent_chat_train.jsonl", tmp_path / "t.jsonl")
    v = tmp_path / "v.jsonl"
    v.write_text((REPO / "datasets/agent_chat_validation.jsonl").read_text())
    rep = check_datasets([t], [v], formats={str(t): SHAREGPT, str(v): {"type": "chat_template"}})
    assert rep.ok, [str(f) for f in rep.errors[:3]]


def test_default_role_aliases_match_axolotl(tmp_path):
    """Sibling: axolotl's default roles map human->user, gpt->assistant even without `roles`."""
    f = write(
        tmp_path / "d.jsonl",
        [{"messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]}],
    )
    assert check_datasets([f]).ok


def test_train_preflight_reads_the_config_mapping(tmp_path):
    """`pipeline train`'s check (check_inputs) passes a ShareGPT config instead of refusing it."""
    from pipeline.config import load_config
    from pipeline.train.config import load_training_config
    from pipeline.train.launch import check_inputs

    t = _sharegpt(REPO / "datasets/agent_chat_train.jsonl", tmp_path / "t.jsonl")
    v = _sharegpt(REPO / "datasets/agent_chat_validation.jsonl", tmp_path / "v.jsonl")
    entry = "type: chat_template, field_messages: conversations, message_property_mappings: {role: from, content: value}, roles: {user: [human], assistant: [gpt], tool: [tool]}"
    tc = load_training_config(
        REPO / "axolotl_configs/tiny-cpu.yml",
        [
            f"base_model={tmp_path}",
            f"datasets=[{{path: {t}, {entry}}}]",
            f"test_datasets=[{{path: {v}, split: train, {entry}}}]",
            f"dataset_prepared_path={tmp_path / 'prepared'}",  # not the checkout's .state
        ],
    )
    rep = check_inputs(load_config(None), tc, set())
    assert rep.ok and rep.files[0].conversations == 120


@pytest.mark.parametrize("key", ["thinking", "reasoning", "thoughts"])
def test_reasoning_under_another_key_is_refused(tmp_path, key):
    """Issue 25.11: axolotl's reader keeps mapped keys and what the template reads; `thinking` is dropped, so the
    reasoning is never trained (siblings: `reasoning`, `thoughts`)."""
    row = {
        "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", key: "91 = 7 x 13.", "content": "No."},
        ]
    }
    rep = check_datasets([write(tmp_path / "d.jsonl", [GOOD, row])])
    err = next(f for f in rep.errors if f.id == "dataset.message_key")
    assert (
        err.where == f"{tmp_path / 'd.jsonl'}:2" and key in err.message and "reasoning_content" in err.message
    )
    ok = {"messages": [row["messages"][0], {"role": "assistant", "reasoning_content": "x", "content": "No."}]}
    assert check_datasets([write(tmp_path / "ok.jsonl", [ok])]).ok


def test_eos_that_is_not_the_turn_terminator_is_refused(tmp_path, tiny_base):
    """Issue 25.11: dataset check compares the eos token with what ends an assistant turn in the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    f = write(tmp_path / "d.jsonl", [GOOD])
    assert not [x for x in check_datasets([f], tokenizer=tok).findings if x.id == "dataset.eos"]
    tok.eos_token = "<|endoftext|>"
    rep = check_datasets([f], tokenizer=tok)
    err = next(x for x in rep.errors if x.id == "dataset.eos")
    assert "'<|im_end|>'" in err.message and "'<|endoftext|>'" in err.message
    # the config's special_tokens override fixes it, as it would in axolotl
    fixed = check_datasets([f], tokenizer=tok, config={"special_tokens": {"eos_token": "<|im_end|>"}})
    assert not [x for x in fixed.findings if x.id == "dataset.eos"]
