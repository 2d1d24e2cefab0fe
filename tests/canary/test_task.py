"""Task metrics (pipeline.canary.task) and the stand-in task data they score (pipeline.dev.tasks)."""

from __future__ import annotations

import json

import pytest

from pipeline.canary.task import expected_text, parse_tool_calls, score, summarise
from pipeline.dev.tasks import generate, write_task_data
from pipeline.errors import UsageError


def _render(messages):
    """The assistant turn as the project's chat template writes it (the text a model learns to produce)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from pipeline.dev.tinybase import chat_template_text

    # transformers' own environment (jinja2's `tojson` returns Markup, which escapes what is added to it)
    text = _compile_jinja_template(chat_template_text()).render(
        messages=messages, add_generation_prompt=False
    )
    return text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")


def test_the_expected_call_is_what_the_chat_template_renders():
    train, _ = generate("toolcall", 40, 4)
    for conv in train:
        msg = conv["messages"][-1]
        rendered = _render(conv["messages"])
        assert parse_tool_calls(rendered) == parse_tool_calls(expected_text(msg)) is not None
        assert score("tool_call", expected_text(msg), rendered) == {"parsed": True, "exact": True}


def test_tool_call_scores_a_wrong_argument_and_a_non_call():
    want = expected_text(
        {
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}
            ]
        }
    )
    wrong = want.replace("Oslo", "Osaka")
    assert score("tool_call", want, wrong) == {"parsed": True, "exact": False}
    assert score("tool_call", want, "It is sunny in Oslo.") == {"parsed": False, "exact": False}
    assert score("tool_call", want, want[:-5]) == {"parsed": False, "exact": False}  # cut before </tool_call>
    s = summarise(
        "tool_call",
        [
            {"parsed": True, "exact": True},
            {"parsed": True, "exact": False},
            {"parsed": False, "exact": False},
        ],
    )
    assert s == {"kind": "tool_call", "n": 3, "exact_match": 0.3333, "parse_rate": 0.6667}
    assert summarise("exact_match", [])["exact_match"] is None
    assert score("exact_match", "max_retry", " max_retry\n") == {"exact": True}
    with pytest.raises(ValueError, match="unknown task metric"):
        score("bleu", "a", "b")


@pytest.mark.parametrize("task", ["toolcall", "snake"])
def test_held_out_data_never_shows_a_training_case(task):
    train, val = generate(task, 300, 32)
    assert len(train) == 300 and len(val) == 32
    assert generate(task, 300, 32) == (train, val)  # deterministic
    if task == "snake":
        seen = {c["messages"][-1]["content"] for c in train}
        assert not seen & {c["messages"][-1]["content"] for c in val}
    else:

        def values(convs):
            return {
                str(v)
                for c in convs
                for v in c["messages"][-1]["tool_calls"][0]["function"]["arguments"].values()
                if not isinstance(v, int) and v not in ("celsius", "fahrenheit") and len(str(v)) > 3
            }

        assert not values(train) & values(val)


def test_task_data_cli_writes_both_splits(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(
        app,
        ["dev", "task-data", "snake", str(tmp_path / "d"), "--train", "20", "--validation", "5", "--json"],
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["metric"] == "exact_match"
    rows = [json.loads(x) for x in open(res["train"])]
    assert len(rows) == 20 and rows[0]["messages"][-1]["role"] == "assistant"
    assert len(open(res["validation"]).readlines()) == 5
    with pytest.raises(UsageError, match="unknown task"):
        write_task_data("poetry", tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        write_task_data("snake", tmp_path / "f")
