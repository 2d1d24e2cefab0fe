"""The main job on real components: axolotl trains, validate passes, MLflow registers, publish writes the volume."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from pipeline.artifacts.manifest import read_manifest, verify_files
from tests.support.helpers import REPO

pytestmark = pytest.mark.slow


def test_train_leaves_adapter_and_manifest(trained, tiny_base):
    cfg, res = trained
    m = res.manifest
    assert (res.adapter_dir / "adapter_model.safetensors").exists()
    assert verify_files(res.adapter_dir, m.files) == []
    assert m.base_model.id == str(tiny_base) and len(m.base_model.fingerprint) == 64
    assert len(m.dataset.fingerprint) == 64 and len(m.config_sha256) == 64
    assert m.versions["axolotl"].startswith("0.") and m.versions["peft"]
    assert m.metrics.steps == 6 and m.metrics.train_loss > 0 and m.metrics.eval_loss > 0
    assert m.adapter.r == 8
    assert read_manifest(res.adapter_dir) == m  # what was written reads back as the same object
    # per-step metrics reached the MLflow run through axolotl's integration
    from mlflow import MlflowClient

    client = MlflowClient(cfg.tracking_uri)
    hist = client.get_metric_history(res.run_id, "train/loss") or client.get_metric_history(
        res.run_id, "loss"
    )
    assert len(hist) >= 5
    run = client.get_run(res.run_id)
    assert run.info.status == "FINISHED" and run.data.params["dataset_fingerprint"] == m.dataset.fingerprint
    assert {i.dataset.digest for i in run.inputs.dataset_inputs} == {f.sha256[:36] for f in m.dataset.files}


def test_validate_register_publish(trained, tiny_base, monkeypatch):
    from pipeline import registry
    from pipeline.release.publish import publish
    from pipeline.validate import validate_adapter

    cfg, res = trained
    report = validate_adapter(res.adapter_dir, tiny_base)
    assert report.verdict == "pass", [c for c in report.checks if c.severity == "error"]
    reg = registry.register_adapter(cfg, res.adapter_dir, "agent-tools", report.to_dict())
    mv = registry.resolve_version(cfg, "agent-tools", alias="candidate")
    assert int(mv.version) == reg.version and mv.tags["validation.verdict"] == "pass"

    # debris of a publish killed an hour ago is cleared by the next publish
    stale = cfg.volume.path / ".staging" / "agent-tools-v9.dead"
    (stale / "adapter").mkdir(parents=True)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    pub = publish(cfg, "agent-tools", alias="candidate")
    assert pub.created and pub.path == cfg.volume.path / f"agent-tools-v{reg.version}"
    # the registered artifact, except what publish records in `normalised`: the base name, and (vLLM 0.19
    # serves qwen3_5 only through Qwen3_5ForConditionalGeneration) the text-layout keys renamed into
    # model.language_model.layers.N with every tensor's bytes unchanged
    man = read_manifest(pub.path)
    layout = man.normalised["layout"]
    assert layout["from"] == "model.layers.N" and layout["to"] == "model.language_model.layers.N"
    for name in res.manifest.files:
        if name not in ("adapter_config.json", "adapter_model.safetensors"):
            assert (pub.path / name).read_bytes() == (res.adapter_dir / name).read_bytes()
    before = load_file(res.adapter_dir / "adapter_model.safetensors")
    after = load_file(pub.path / "adapter_model.safetensors")
    renamed = {k.replace(".model.layers.", ".model.language_model.layers."): v for k, v in before.items()}
    assert renamed.keys() == after.keys() and len(after) == layout["tensors"]
    assert all(torch.equal(after[k], v) for k, v in renamed.items())
    acfg = json.loads((pub.path / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == cfg.served.model
    orig = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert {k: v for k, v in acfg.items() if k != "base_model_name_or_path"} == {
        k: v for k, v in orig.items() if k != "base_model_name_or_path"
    }  # target_modules are module names (q_proj...): the same in both layouts
    assert man.published.original_base_model_name_or_path == orig["base_model_name_or_path"]
    assert verify_files(pub.path, man.files) == []
    assert not (cfg.volume.path / ".staging").exists()  # removed once empty: no debris on the volume
    assert int(registry.resolve_version(cfg, "agent-tools", alias="production").version) == reg.version

    # republishing is a no-op: nothing rewritten
    before = {p.name: p.stat().st_mtime_ns for p in pub.path.iterdir()}
    again = publish(cfg, "agent-tools", version=reg.version)
    assert not again.created and {p.name: p.stat().st_mtime_ns for p in pub.path.iterdir()} == before

    # unknown version / alias: clear error, volume untouched
    listing = sorted(p.name for p in cfg.volume.path.iterdir())
    env = dict(os.environ, PIPELINE_CONFIG=str(cfg.source))
    for args in (["--version", "99"], ["--alias", "nope"]):
        r = subprocess.run(
            [sys.executable, "-m", "pipeline", "publish", "agent-tools", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert r.returncode == 2, r.stderr
        assert "not found" in r.stderr and "versions [" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "publish", "ghost", "--version", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 2 and "registered model 'ghost' not found" in r.stderr
    assert sorted(p.name for p in cfg.volume.path.iterdir()) == listing


def test_failing_version_is_not_published(trained, tiny_base, tmp_path):
    """A registered version whose validation failed never reaches the volume."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline import registry
    from pipeline.artifacts.manifest import file_hashes, write_manifest
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish
    from pipeline.validate import validate_adapter

    cfg, res = trained
    bad = tmp_path / "bad"
    shutil.copytree(res.adapter_dir, bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    k = next(k for k in tensors if "lora_B" in k)
    tensors[k][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    man = read_manifest(bad)
    man.files = file_hashes(bad)
    write_manifest(bad, man)
    report = validate_adapter(bad, tiny_base)
    assert report.verdict == "fail" and any(c.id == "values.nonfinite" for c in report.checks)
    reg = registry.register_adapter(cfg, bad, "bad-adapter", report.to_dict())
    with pytest.raises(CheckFailed, match="validation verdict is 'fail'"):
        publish(cfg, "bad-adapter", version=reg.version)
    assert not (cfg.volume.path / f"bad-adapter-v{reg.version}").exists()


def test_bad_dataset_stops_before_training_and_writes_nothing(project, tmp_path, tiny_base):
    bad = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    bad.write_text(good + "\n" + '{"messages": [{"role": "user", "content": "q"}' + "\n")
    env = dict(os.environ, PIPELINE_CONFIG=str(project.source))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "train",
            str(REPO / "axolotl_configs/tiny-cpu.yml"),
            "--set",
            f"base_model={tiny_base}",
            "--set",
            f"datasets=[{{path: {bad}, type: chat_template}}]",
            "--set",
            "test_datasets=null",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert f"{bad}:2" in r.stderr and "invalid JSON" in r.stderr
    assert not project.train.runs_dir.exists()
    assert not (project.state_dir / "mlflow.db").exists()
