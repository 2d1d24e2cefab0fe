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
