"""axolotl's prepared datasets (pipeline.train.prepared): keyed by content, written whole, the trainer's own.

The defect: axolotl keys `dataset_prepared_path/<md5>` by the dataset entries and the tokenizer's
name, not the files' bytes. 60 rows appended to the training file, `pipeline train` again: the
trainer loaded the first run's 120 rows while the manifest recorded the new file and 180 kept.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.train.config import load_training_config
from pipeline.train.dataset import check_datasets
from pipeline.train.launch import axolotl_view, prepare_datasets
from pipeline.train.prepared import COMPLETE, prepared_key, prune, write_prepared
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


def _fingerprint(tc) -> str:
    return check_datasets(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets")).fingerprint


def test_a_data_file_changed_in_place_is_not_trained_from_its_stale_copy(tiny_base, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    data = tmp_path / "train.jsonl"
    shutil.copy(REPO / "datasets" / "agent_chat_train.jsonl", data)
    tc = _tc(tiny_base, [data], f"dataset_prepared_path={tmp_path / 'prep'}")
    first = prepare_datasets(tc, tmp_path / "state", _fingerprint(tc))
    assert len(_trainer_view(tc, first)["train"]) == 120
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines + lines[:60]) + "\n")  # same path, new bytes
    second = prepare_datasets(tc, tmp_path / "state", _fingerprint(tc))
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
