"""The dataset gate (pipeline.train.gate): axolotl's own processing counts what it keeps, before the model loads."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.errors import CheckFailed
from pipeline.train.config import load_training_config
from pipeline.train.gate import count_kept, gate_problems
from pipeline.train.launch import axolotl_view, check_inputs
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def _view(tiny_base, tmp_path, *sets):
    tc = load_training_config(
        TINY, [f"base_model={tiny_base}", f"dataset_prepared_path={tmp_path / 'prep'}", *sets]
    )
    return tc, axolotl_view(tc)


def test_counts_follow_axolotls_filters(tiny_base, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    _, view = _view(tiny_base, tmp_path)
    train, test = count_kept(view)
    assert (train.split, train.conversations, train.kept, train.dropped) == ("train", 120, 120, 0)
    assert train.tokens == train.kept_tokens > train.trainable_tokens == train.kept_trainable_tokens > 0
    assert (test.split, test.conversations, test.kept) == ("test", 20, 20)
    assert gate_problems([train, test], 0.1) == []
    # sequence_len 96: axolotl drops the long ones; reasons and the dropped trainable tokens are counted
    _, view = _view(tiny_base, tmp_path, "sequence_len=96")
    train, _ = count_kept(view)
    assert 0 < train.kept < train.conversations and train.too_long == train.dropped
    assert train.kept_trainable_tokens < train.trainable_tokens
    (msg, *_) = gate_problems([train], 0.1)
    assert f"drops {train.dropped} of 120 conversations" in msg and "longer than sequence_len 96" in msg
    assert "--allow dataset.dropped" in msg and "train.max_dropped_share" in msg
    assert gate_problems([train], 0.1, {"dataset.dropped"}) == []
    assert gate_problems([train], 1.0) == []


def test_a_split_with_no_trainable_token_is_refused(tiny_base, tmp_path, monkeypatch):
    """Every label -100 without packing: rows are kept, so the dropped shares were 0.0 and the gate passed;
    the eval split then gave a NaN eval loss (and a train split trains on nothing)."""
    import json

    monkeypatch.chdir(REPO)
    users = tmp_path / "users.jsonl"
    users.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n" for i in range(5))
    )
    _, view = _view(tiny_base, tmp_path)
    view["test_datasets"][0]["path"] = str(users)
    train, test = count_kept(view)
    assert test.kept == 5 and test.labelled and test.kept_trainable_tokens == 0
    (msg,) = gate_problems([train, test], 0.1, {"dataset.dropped"})
    assert "test_datasets" in msg and "none has a trainable token" in msg


def test_truncation_and_packing_siblings(tiny_base, tmp_path, monkeypatch):
    """excess_length_strategy truncate keeps long rows (cut); with packing, rows cut down to the prompt
    have no trainable token left and axolotl drops them: counted as such, not as too long."""
    monkeypatch.chdir(REPO)
    _, view = _view(
        tiny_base, tmp_path, "sequence_len=40", "excess_length_strategy=truncate", "sample_packing=true"
    )
    train, _ = count_kept(view)
    assert train.truncated > 0 and train.too_long == 0
    assert train.no_trainable == train.dropped > 0


def test_nothing_kept_is_refused_in_seconds_before_anything_is_written(project, tiny_base):
    """The reported failure: every conversation longer than sequence_len passed the checks, the model
    loaded, then `ValueError: num_samples should be a positive integer value, but got num_samples=0`."""
    from pipeline.cli import app

    res = CliRunner().invoke(
        app,
        ["train", str(TINY), "--set", f"base_model={tiny_base}", "--set", "sequence_len=16", "--no-progress"],
    )
    assert res.exit_code == 1, res.output
    assert (
        "axolotl keeps none of the 120 conversations (dropped: 120 longer than sequence_len 16)" in res.output
    )
    assert not project.train.runs_dir.exists() or not any(project.train.runs_dir.iterdir())
    assert not (project.state_dir / "mlflow.db").exists()  # no MLflow run either


def test_share_is_configurable_and_allowable(project, tiny_base, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    tc, _ = _view(tiny_base, tmp_path, "sequence_len=96")
    with pytest.raises(CheckFailed, match="more than train.max_dropped_share 0.1"):
        check_inputs(project, tc, set(), gpus=[])
    report = check_inputs(project, tc, {"dataset.dropped"}, gpus=[])
    kept = {k["split"]: k for k in report.kept}
    assert kept["train"]["dropped"] > 0 and report.to_dict()["kept"] == report.kept
    lenient = project.model_copy(
        update={"train": project.train.model_copy(update={"max_dropped_share": 1.0})}
    )
    assert check_inputs(lenient, tc, set(), gpus=[]).kept == report.kept


def test_counts_reach_the_manifest_and_mlflow(trained):
    cfg, res = trained
    kept = {k.split: k for k in res.manifest.dataset.kept}
    assert kept["train"].kept == kept["train"].conversations == 120 and kept["test"].dropped == 0
    from pipeline.registry.store import mlflow_for

    run = mlflow_for(cfg).MlflowClient().get_run(res.run_id)
    assert run.data.metrics["dataset.train.kept"] == 120.0
    assert run.data.params["dataset_kept.test.conversations"] == "20"
