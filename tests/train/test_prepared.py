"""axolotl's prepared datasets (pipeline.train.prepared): keyed by content, written whole, the trainer's own.

The defect: axolotl keys `dataset_prepared_path/<md5>` by the dataset entries and the tokenizer's
name, not the files' bytes. 60 rows appended to the training file, `pipeline train` again: the
trainer loaded the first run's 120 rows while the manifest recorded the new file and 180 kept.
Then: the datasets library's cache keys a file by its mtime (a rewrite with the old mtime gave the
old rows), a killed writer's temporary directory stayed, a relative path followed the working
directory, an unwritable one failed in the trainer, and progress bars reached stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from pipeline.errors import CheckFailed, VolumeError
from pipeline.train.config import load_training_config
from pipeline.train.dataset import check_datasets
from pipeline.train.launch import axolotl_view, check_inputs, prepare_datasets
from pipeline.train.prepared import COMPLETE, prepared_dir, prepared_key, prune, write_prepared
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def _entry(path) -> str:
    return (
        f"{{path: {path}, ds_type: json, type: chat_template, field_messages: messages, "
        "roles_to_train: [assistant]}"
    )


def _tc(tiny_base, data, *sets):
    return load_training_config(
        TINY,
        [f"base_model={tiny_base}", f"datasets=[{', '.join(_entry(d) for d in data)}]", *sets],
    )


def _trainer_view(tc, keyed):
    """What the trainer's axolotl loads for each split from `keyed`: axolotl's own lookup."""
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data.shared import generate_dataset_hash_from_config, load_preprocessed_dataset

    from pipeline.train.gate import axolotl_cfg

    cfg = axolotl_cfg(axolotl_view(tc, keyed))
    tok = load_tokenizer(cfg)
    return {
        split: load_preprocessed_dataset(
            cfg, generate_dataset_hash_from_config(cfg, cfg[key], tok.name_or_path)
        )
        for split, key in (("train", "datasets"), ("test", "test_datasets"))
    }


def _report(tc):
    return check_datasets(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets"))


def _fingerprint(tc) -> str:
    return _report(tc).fingerprint


def test_a_data_file_changed_in_place_is_not_trained_from_its_stale_copy(
    project, tiny_base, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    data = tmp_path / "train.jsonl"
    shutil.copy(REPO / "datasets" / "agent_chat_train.jsonl", data)
    tc = _tc(tiny_base, [data], f"dataset_prepared_path={tmp_path / 'prep'}")
    first = prepare_datasets(project, tc, _report(tc))
    assert len(_trainer_view(tc, first)["train"]) == 120
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines + lines[:60]) + "\n")  # same path, new bytes
    second = prepare_datasets(project, tc, _report(tc))
    assert second != first and second.parent == first.parent == (tmp_path / "prep")
    seen = _trainer_view(tc, second)
    assert len(seen["train"]) == 180 and len(seen["test"]) == 20


def test_the_key_covers_what_axolotls_hash_leaves_out(tiny_base, tmp_path, monkeypatch):
    """Siblings of the same kind: options and files axolotl's md5 does not cover."""
    monkeypatch.chdir(REPO)
    data = [REPO / "datasets" / "agent_chat_train.jsonl"]
    tc = _tc(tiny_base, data)
    fp = _fingerprint(tc)
    key = prepared_key(fp, tc.data)
    assert prepared_key(fp, tc.data) == key  # stable
    for option in ("excess_length_strategy=truncate", "min_sample_len=8", "eval_sequence_len=256"):
        assert prepared_key(fp, _tc(tiny_base, data, option).data) != key, option
    # the tokenizer's bytes at the same path (a base rebuilt or updated in place)
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    moved = _tc(base, data)
    before = prepared_key(fp, moved.data)
    cfg_file = base / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["model_max_length"] = 77
    cfg_file.write_text(json.dumps(tok_cfg))
    assert prepared_key(fp, moved.data) != before
    # where things are does not count: the same inputs from another prepared root share the key
    assert prepared_key(fp, _tc(tiny_base, data, "dataset_prepared_path=/elsewhere").data) == key


def test_the_written_dataset_is_axolotls_own(tiny_base, tmp_path, monkeypatch):
    """Two files, packing, truncation and de-duplication: what write_prepared leaves equals what
    axolotl's `_load_raw_datasets` builds from the same config."""
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data.sft import _load_raw_datasets

    from datasets import load_from_disk
    from pipeline.train.gate import axolotl_cfg

    monkeypatch.chdir(REPO)
    half = tmp_path / "half.jsonl"
    half.write_text(
        "\n".join((REPO / "datasets" / "agent_chat_train.jsonl").read_text().splitlines()[:40]) + "\n"
    )
    tc = _tc(
        tiny_base,
        [REPO / "datasets" / "agent_chat_train.jsonl", half],
        "sequence_len=96",
        "excess_length_strategy=truncate",
        "sample_packing=true",
        "dataset_exact_deduplication=true",
    )
    (train_dir, test_dir) = write_prepared(axolotl_view(tc, tmp_path / "ours"))
    assert (train_dir / COMPLETE).is_file() and not [
        p for p in (tmp_path / "ours").iterdir() if p.name.startswith(".")
    ]
    cfg = axolotl_cfg(axolotl_view(tc, tmp_path / "axolotl"))
    theirs, _ = _load_raw_datasets(cfg, cfg.datasets, load_tokenizer(cfg), "train")
    ours = load_from_disk(str(train_dir))
    assert 0 < len(ours) < 160 and ours.to_dict() == theirs.to_dict()
    assert train_dir.name == next((tmp_path / "axolotl").iterdir()).name  # where the trainer looks


def test_a_part_written_directory_is_replaced_and_a_complete_one_kept(tiny_base, tmp_path, monkeypatch):
    """A trainer killed while saving left files without state.json: axolotl loads any non-empty
    directory, so every later run failed on it. The pipeline writes whole directories only."""
    from datasets import load_from_disk

    monkeypatch.chdir(REPO)
    tc = _tc(tiny_base, [REPO / "datasets" / "agent_chat_train.jsonl"])
    view = axolotl_view(tc, tmp_path / "k")
    (train_dir, _) = write_prepared(view)
    shutil.rmtree(train_dir)
    train_dir.mkdir()
    (train_dir / "data-00000-of-00001.arrow").write_bytes(b"cut short")
    assert write_prepared(view)[0] == train_dir and len(load_from_disk(str(train_dir))) == 120
    stamp = (train_dir / COMPLETE).stat().st_mtime_ns
    write_prepared(view)
    assert (train_dir / COMPLETE).stat().st_mtime_ns == stamp  # complete: kept, not rewritten


def test_prune_keeps_the_newest_keys_and_nothing_else(tmp_path):
    import os

    root = tmp_path / "prep"
    keyed = []
    for i in range(6):
        d = root / f"{i:016x}"
        d.mkdir(parents=True)
        os.utime(d, (1000 + i, 1000 + i))
        keyed.append(d)
    other = root / "d41d8cd98f00b204e9800998ecf8427e"  # axolotl's own (32 digits): not ours
    other.mkdir()
    gone = prune(root, keyed[0], keep=3)
    assert sorted(gone) == keyed[1:4]
    assert sorted(p for p in root.iterdir()) == sorted([keyed[0], keyed[4], keyed[5], other])


@pytest.mark.slow
def test_the_trainer_loads_what_the_pipeline_prepared(trained):
    """The session's training: axolotl found the keyed directory (its hash matched) and tokenized nothing."""
    cfg, res = trained
    resolved = res.run_dir / "resolved.yml"
    import yaml

    keyed = yaml.safe_load(resolved.read_text())["dataset_prepared_path"]
    log = (res.run_dir / "train.log").read_text()
    assert log.count(f"Loading prepared dataset from disk at {keyed}/") == 2, log[:3000]
    assert "Unable to find prepared dataset" not in log and "Saving the dataset" not in log


def _rows(upper: bool) -> str:
    """The training file's rows (json.dumps), each message's text upper-cased or not: the same bytes'
    length, other tokens."""
    out = []
    for line in (REPO / "datasets" / "agent_chat_train.jsonl").read_text().splitlines():
        row = json.loads(line)
        for m in row["messages"]:
            if upper and isinstance(m.get("content"), str):
                m["content"] = m["content"].upper()
        out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def _train_dir(tc, keyed):
    """The train split's directory under `keyed`, where the trainer's axolotl looks."""
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data.shared import generate_dataset_hash_from_config

    from pipeline.train.gate import axolotl_cfg

    cfg = axolotl_cfg(axolotl_view(tc, keyed))
    return keyed / generate_dataset_hash_from_config(cfg, cfg.datasets, load_tokenizer(cfg).name_or_path)


def test_a_rewrite_that_keeps_the_old_mtime_is_prepared_from_its_new_bytes(
    project, tiny_base, tmp_path, monkeypatch
):
    """`cp -p`, `rsync -a`, `touch -r`: other rows, the old mtime and size. The datasets library keys
    its json cache by path and mtime, so the gate counted the old rows and the new key's prepared
    dataset held them."""
    from datasets import load_from_disk

    monkeypatch.chdir(REPO)
    data, fresh = tmp_path / "train.jsonl", tmp_path / "fresh" / "train.jsonl"
    data.write_text(_rows(upper=False))
    tc = _tc(tiny_base, [data], f"dataset_prepared_path={tmp_path / 'prep'}")
    before = check_inputs(project, tc, set(), gpus=[])
    first = prepare_datasets(project, tc, before)
    st = data.stat()
    data.write_text(_rows(upper=True))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    after = check_inputs(project, tc, set(), gpus=[])
    second = prepare_datasets(project, tc, after)
    # the truth: the same bytes at a path no cache has seen
    fresh.parent.mkdir()
    fresh.write_text(_rows(upper=True))
    tc_fresh = _tc(tiny_base, [fresh], f"dataset_prepared_path={tmp_path / 'prep-fresh'}")
    truth = check_inputs(project, tc_fresh, set(), gpus=[])
    truth_dir = prepare_datasets(project, tc_fresh, truth)

    tokens = [{k["split"]: k["tokens"] for k in r.kept} for r in (before, after, truth)]
    assert tokens[0]["train"] != tokens[2]["train"]  # upper case is other tokens: the test can fail
    assert tokens[1] == tokens[2]  # the gate counted the new rows
    ours = load_from_disk(str(_train_dir(tc, second))).to_dict()
    assert ours == load_from_disk(str(_train_dir(tc_fresh, truth_dir))).to_dict()
    assert ours != load_from_disk(str(_train_dir(tc, first))).to_dict()


def test_rows_other_than_the_gate_counted_are_refused(project, tiny_base, tmp_path, monkeypatch):
    """The files changed between the gate and the write (the key names the checked bytes): the
    prepared split would hold rows the manifest does not describe."""
    monkeypatch.chdir(REPO)
    data = tmp_path / "train.jsonl"
    shutil.copy(REPO / "datasets" / "agent_chat_train.jsonl", data)
    tc = _tc(tiny_base, [data], f"dataset_prepared_path={tmp_path / 'prep'}")
    report = check_inputs(project, tc, set(), gpus=[])
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines + lines[:60]) + "\n")
    with pytest.raises(CheckFailed, match="train split has 180 rows where the dataset gate kept 120"):
        prepare_datasets(project, tc, report)
    assert not _train_dir(tc, prepared_dir(tc.data, report.fingerprint, project.state_dir)).exists()


_WRITER = """
import sys, time
from pathlib import Path
from pipeline.train.prepared import _temporary
with _temporary(Path(sys.argv[1]), sys.argv[2]) as tmp:
    (tmp / "data-00000-of-00001.arrow").write_bytes(b"half")
    print(tmp, flush=True)
    time.sleep(120)
"""


def _writer(root, name):
    """A process in the middle of a write under `root`: (process, its temporary directory)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), name], stdout=subprocess.PIPE, text=True, env=env
    )
    return proc, root / os.path.basename(proc.stdout.readline().strip())


def test_a_killed_writers_temporary_directory_is_removed_a_live_ones_kept(tiny_base, tmp_path, monkeypatch):
    """SIGKILL during a write left `.<md5>.xxxx` under the key forever; a concurrent writer's is its own."""
    from datasets import load_from_disk

    monkeypatch.chdir(REPO)
    tc = _tc(tiny_base, [REPO / "datasets" / "agent_chat_train.jsonl"])
    root = tmp_path / "k"
    root.mkdir()
    dead, dead_tmp = _writer(root, "a" * 32)
    live, live_tmp = _writer(root, "b" * 32)
    old_style = root / f".{'c' * 32}.x1_y2z3"  # tempfile.mkdtemp's, from before the lock files
    old_style.mkdir()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert dead_tmp.is_dir() and live_tmp.is_dir()
        (train_dir, _) = write_prepared(axolotl_view(tc, root))
        assert not dead_tmp.exists() and not old_style.exists()
        assert live_tmp.is_dir() and (root / f"{live_tmp.name}.lock").exists()
        assert len(load_from_disk(str(train_dir))) == 120
        leftovers = {p.name for p in root.iterdir() if p.name.startswith(".")}
        assert leftovers == {live_tmp.name, f"{live_tmp.name}.lock"}
    finally:
        live.kill()
        live.wait(10)
        dead.wait(10)


def test_a_relative_prepared_path_is_the_projects_from_any_working_directory(
    project, tiny_base, tmp_path, monkeypatch
):
    """The shipped configs say `.state/prepared`: like pipeline.yaml's paths, it is the project
    root's (`ProjectConfig.root`), not the working directory's."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    test_entry = _entry(REPO / "datasets" / "agent_chat_validation.jsonl").replace("}", ", split: train}")
    tc = _tc(
        tiny_base,
        [REPO / "datasets" / "agent_chat_train.jsonl"],
        f"test_datasets=[{test_entry}]",
    )
    assert tc.data["dataset_prepared_path"] == ".state/prepared"
    report = check_inputs(project, tc, set(), gpus=[])
    keyed = prepare_datasets(project, tc, report)
    assert keyed.parent == project.root / ".state" / "prepared" != elsewhere / ".state" / "prepared"
    assert len(_trainer_view(tc, keyed)["train"]) == 120
    assert list(elsewhere.iterdir()) == []


def test_an_unwritable_prepared_path_is_refused_before_a_run_exists(
    project, tiny_base, tmp_path, monkeypatch
):
    """It was a trainer traceback, a run directory and a FAILED MLflow run. A path under a regular
    file: unwritable for root too."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.chdir(REPO)
    (tmp_path / "afile").write_text("not a directory\n")
    bad = tmp_path / "afile" / "prepared"
    res = CliRunner().invoke(
        app,
        ["train", str(TINY), "--set", f"base_model={tiny_base}", "--set", f"dataset_prepared_path={bad}"]
        + ["--no-progress"],
    )
    assert res.exit_code == 2, res.output
    assert f"dataset_prepared_path {bad}: cannot write the prepared datasets there" in res.output
    assert "--set dataset_prepared_path=DIR" in res.output and "Traceback" not in res.output
    assert not project.train.runs_dir.exists() or not any(project.train.runs_dir.iterdir())
    assert not (project.state_dir / "mlflow.db").exists()  # no MLflow run either
    # the default place, under an unwritable state_dir: the message says which setting to change
    with pytest.raises(VolumeError, match="set state_dir in pipeline.yaml"):
        prepared_dir({}, "0" * 64, tmp_path / "afile" / "state")


def test_preparing_shows_no_progress_bars(tiny_base, tmp_path, monkeypatch, capfd):
    """datasets' bars ("Map", "Saving the dataset") reached the CLI's stderr; the setting is restored."""
    import datasets

    monkeypatch.chdir(REPO)
    tc = _tc(tiny_base, [REPO / "datasets" / "agent_chat_train.jsonl"])
    capfd.readouterr()
    assert datasets.is_progress_bar_enabled()
    write_prepared(axolotl_view(tc, tmp_path / "k"))
    err = capfd.readouterr().err
    assert "Saving the dataset" not in err and "it/s]" not in err and "examples/s]" not in err, err
    assert datasets.is_progress_bar_enabled()
