"""`pipeline dataset check --config`: train's dataset gate, for a config that is not trained (issue 41 kind 3).

It said OK (exit 0) to data axolotl drops whole: with every conversation longer than sequence_len, and
`too long 0` without a tokenizer, having checked no length at all; it did not read the axolotl config.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.train.config import load_training_config
from pipeline.train.gate import count_kept
from pipeline.train.launch import axolotl_view
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"
TRAIN = REPO / "datasets" / "agent_chat_train.jsonl"


@pytest.fixture()
def here(project, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's dataset paths are relative to the repo root
    return project


def check(*args: str):
    return CliRunner().invoke(app, ["dataset", "check", *args])


def test_every_conversation_too_long_is_refused_as_train_refuses_it(here, tiny_base):
    """The issue's instance: every conversation longer than sequence_len, exit 0. Now train's refusal, exit 1."""
    r = check("--config", str(TINY), "--set", f"base_model={tiny_base}", "--set", "sequence_len=16")
    assert r.exit_code == 1, r.output
    assert (
        "axolotl keeps none of the 120 conversations (dropped: 120 longer than sequence_len 16)" in r.output
    )
    assert "OK" not in r.output.split()


def test_the_counts_are_the_gates_and_its_share_refusal_applies(here, tiny_base, tmp_path):
    """Sibling: a share dropped above train.max_dropped_share is refused (train's rule and message) unless
    --allow dataset.dropped, and the counts printed are axolotl's own (pipeline.train.gate.count_kept)."""
    sets = ["--set", f"base_model={tiny_base}", "--set", "sequence_len=96"]
    r = check("--config", str(TINY), *sets)
    assert r.exit_code == 1 and "more than train.max_dropped_share 0.1" in r.output, r.output
    r = check("--config", str(TINY), *sets, "--allow", "dataset.dropped", "--json")
    assert r.exit_code == 0, r.output
    kept = {k["split"]: k for k in json.loads(r.stdout)["kept"]}
    tc = load_training_config(TINY, [f"base_model={tiny_base}", "sequence_len=96"])
    train, test = count_kept(axolotl_view(tc))
    assert (kept["train"]["kept"], kept["train"]["too_long"]) == (train.kept, train.too_long)
    assert kept["test"]["kept"] == test.kept and 0 < train.kept < 120
    r = check("--config", str(TINY), "--set", f"base_model={tiny_base}")
    assert r.exit_code == 0 and "train: axolotl keeps 120 of 120 conversations" in r.output, r.output
    assert "NOT CHECKED" not in r.output


def test_what_was_not_checked_is_said(here, tiny_base):
    """Sibling: without a tokenizer it printed `too long 0` having measured nothing; with --config whose
    base cannot be read here, the gate is skipped: both say NOT CHECKED instead of implying a pass."""
    r = check(str(TRAIN))
    assert r.exit_code == 0, r.output
    assert "too long" not in r.output and "NOT CHECKED: lengths against sequence_len" in r.output
    r = check("--config", str(TINY), "--set", "base_model=nobody/not-cached-here")
    assert r.exit_code == 0, r.output
    assert "NOT CHECKED: lengths against sequence_len" in r.output and "train: axolotl keeps" not in r.output


def test_files_all_longer_than_sequence_len_fail_without_a_config(here, tiny_base):
    """Sibling: FILES with --tokenizer and --sequence-len counted every row too long, a warning, exit 0."""
    r = check(str(TRAIN), "--tokenizer", str(tiny_base), "--sequence-len", "16")
    assert r.exit_code == 1 and "all 120 conversations exceed sequence_len 16" in r.output, r.output
    r = check(str(TRAIN), "--tokenizer", str(tiny_base), "--sequence-len", "4096")
    assert r.exit_code == 0 and "too long 0" in r.output, r.output


def test_config_and_files_together_are_a_usage_error(here):
    r = check(str(TRAIN), "--config", str(TINY))
    assert r.exit_code == 2 and "--config names the files" in r.output
    r = check()
    assert r.exit_code == 2
