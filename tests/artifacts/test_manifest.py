"""`manifest.json` as types (issue 26 item 3): both kinds read and write as objects; the schema-1
manifests that volumes and registries already hold (written before the types) still read."""

from __future__ import annotations

import json

import pytest

from pipeline.artifacts.manifest import (
    AdapterManifest,
    MergedManifest,
    read_adapter_manifest,
    read_manifest,
    write_manifest,
)

# What `pipeline publish` left on a volume before manifests were typed (train's keys, then publish's):
# no `kind`, explicit nulls, an `adapter` block of PEFT settings, one key no release knows.
SCHEMA1_PUBLISHED = {
    "schema": 1,
    "name": "agent-tools",
    "created": "2026-01-01T00:00:00+00:00",
    "files": {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "b" * 64},
    "base_model": {"id": "/models/base", "revision": None, "fingerprint": "f" * 64},
    "served": {"checkpoint": "org/Qwen3.6-27B-NVFP4", "revision": None, "model": "qwen3.6-27b"},
    "dataset": {
        "fingerprint": "d" * 64,
        "files": [
            {"path": "datasets/train.jsonl", "role": "train", "sha256": "1" * 64, "conversations": 40},
            {"path": "datasets/val.jsonl", "role": "validation", "sha256": "2" * 64, "conversations": 8},
        ],
    },
    "config_sha256": "c" * 64,
    "resolved_config": "/runs/x/resolved.yml",
    "adapter": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["q_proj"],
        "rank_pattern": {},
        "use_rslora": False,
    },
    "versions": {"axolotl": "0.19.0", "mlflow": None},
    "metrics": {"eval_loss": 1.25, "train_loss": 1.4, "steps": 6, "grad_norm_final": 0.3},
    "mlflow_run_id": None,
    "gpus": 1,
    "registered_files": {"adapter_config.json": "9" * 64, "adapter_model.safetensors": "8" * 64},
    "published": {
        "name": "agent-tools",
        "version": 3,
        "original_base_model_name_or_path": "/models/base",
        "base_model_name_or_path": "qwen3.6-27b",
        "registry": {"tracking_uri": "sqlite:///x.db", "experiment_id": "1", "source": "models:/m-1"},
        "time": "2026-01-02T00:00:00+00:00",
    },
    "normalised": {"layout": {"to": "model.language_model.layers.N"}},
    "future_field": {"kept": True},
}

# `pipeline merge --no-hash` before the types: `files` null, the old spelling `requantisation`.
SCHEMA1_MERGED = {
    "schema": 1,
    "kind": "merged-lora",
    "created": "2026-01-01T00:00:00+00:00",
    "files": None,
    "base": {"path": "/models/base", "layout": "text", "fingerprint": "f" * 64},
    "adapter": {
        "path": "/runs/x/adapter",
        "name": "agent-tools",
        "weights_sha256": "b" * 64,
        "manifest_base_model": {"id": "/models/base", "revision": None, "fingerprint": "f" * 64},
        "registered": {"name": "agent-tools", "version": 3},
        "config": {"r": 16, "lora_alpha": 32},
    },
    "merge": {"dtype": "bfloat16", "lora_pairs": 25, "merged_modules": 25, "scales": {"2": 25}, "bytes": 10},
    "parity": {
        "verdict": "pass",
        "max_abs_diff": 0.01,
        "tolerance": 0.1,
        "greedy_equal": True,
        "prompts": [],
    },
    "requantisation": {"status": "pending", "keep_bf16": ["lm_head"]},
    "versions": {"peft": "0.18.0"},
}


def _dir(tmp_path, data, name="d"):
    d = tmp_path / name
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(data))
    return d


def test_a_schema1_published_adapter_manifest_reads_as_an_object(tmp_path):
    m = read_manifest(_dir(tmp_path, SCHEMA1_PUBLISHED))
    assert isinstance(m, AdapterManifest) and m.kind == "adapter"
    assert m.adapter.r == 16 and m.adapter.lora_alpha == 32 and isinstance(m.adapter.lora_alpha, int)
    assert m.weights_sha256 == "b" * 64 and m.registered_weights_sha256 == "8" * 64
    assert m.published.registry.source == "models:/m-1" and m.registered_version().version == 3
    assert m.dataset.validation_files()[0].name == "val.jsonl" and len(m.dataset.validation_files()) == 1
    assert (
        m.metrics.eval_loss == 1.25 and m.metrics.figures()["grad_norm_final"] == 0.3
    )  # unknown figures kept


def test_write_then_read_is_the_same_object_and_keeps_unknown_fields(tmp_path):
    m = read_manifest(_dir(tmp_path, SCHEMA1_PUBLISHED))
    out = tmp_path / "out"
    out.mkdir()
    write_manifest(out, m)
    written = json.loads((out / "manifest.json").read_text())
    assert (
        written["schema"] == 1 and written["kind"] == "adapter" and written["future_field"] == {"kept": True}
    )
    assert read_manifest(out) == m


def test_a_schema1_merged_manifest_reads_with_the_old_spelling(tmp_path):
    m = read_manifest(_dir(tmp_path, SCHEMA1_MERGED))
    assert isinstance(m, MergedManifest) and m.files is None
    assert m.requantization.status == "pending" and m.requantization.keep_bf16 == ["lm_head"]
    assert m.adapter.registered.version == 3 and m.merge.merged_modules == 25 and m.parity.verdict == "pass"
    assert "requantization" in m.to_json() and "requantisation" not in m.to_json()


def test_the_kinds_do_not_pass_for_each_other(tmp_path):
    """A merged checkpoint's `adapter` (where it came from) is not an adapter's `adapter` (LoRA settings)."""
    d = _dir(tmp_path, SCHEMA1_MERGED)
    with pytest.raises(ValueError, match="merged-lora checkpoint's manifest, not an adapter's"):
        read_adapter_manifest(d)


@pytest.mark.parametrize(
    "data, says",
    [
        ({"schema": 1}, "files: Field required"),
        ({"files": {"a": "b"}, "adapter": {"r": "sixteen"}}, "adapter.r"),
        ({"files": {}, "kind": "merged-lora"}, "base: Field required"),
        ({"files": {}, "kind": "gguf"}, "kind 'gguf' is not one this pipeline reads"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_manifest_names_the_file_and_the_field(tmp_path, data, says):
    d = _dir(tmp_path, data)
    with pytest.raises(ValueError, match="manifest.json") as e:
        read_manifest(d)
    assert says in str(e.value)
