"""`pipeline draft NAME --version N` (issue 38 item 2): a drafter distilled for one version on the tiny VL base
improves the estimate, and is recorded: an MLflow run linked to the version holding the drafter, `drafter.*`
tags, the description's `Speed:` line and `pipeline status -o wide`."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from pipeline.cli import app
from tests.support.drafter import conversations, drafted_base, vl_adapter, write_jsonl


def _registered(cfg, base, root):
    """A VL-keyed adapter with the manifest `pipeline train` writes (train and validation files), registered."""
    from pipeline import registry
    from pipeline.artifacts.manifest import (
        AdapterManifest,
        BaseModelRef,
        DatasetFile,
        DatasetRecord,
        LoraSettings,
        file_hashes,
        write_manifest,
    )

    adapter = vl_adapter(base, root / "adapter", b_std=0.3)
    train = write_jsonl(root / "train.jsonl", conversations(8))
    val = write_jsonl(root / "val.jsonl", conversations(4, offset=8))
    manifest = AdapterManifest(
        name="agent",
        created="2026-01-01T00:00:00+00:00",
        files=file_hashes(adapter),
        base_model=BaseModelRef(id=str(base)),
        dataset=DatasetRecord(
            fingerprint="ab" * 32,
            files=[DatasetFile(path=str(train), role="train"), DatasetFile(path=str(val), role="validation")],
        ),
        adapter=LoraSettings(r=8, lora_alpha=16, peft_type="LORA"),
    )
    write_manifest(adapter, manifest)
    figures = {  # what `validate --behaviour` / `pipeline run` put in the report (validate.acceptance.summary)
        "acceptance_length_base": 2.0, "acceptance_length_adapter": 1.5, "acceptance_base": [0.6, 0.3, 0.1],
        "acceptance_adapter": [0.4, 0.1, 0.0], "acceptance_ratio": 0.75, "speed_ratio": 0.6975,
        "lora_speed_factor": 0.93, "positions": 40, "prompts": 4, "data_sha256": "c" * 64,
    }  # fmt: skip
    report = {
        "verdict": "pass",
        "weights_sha256": manifest.weights_sha256,
        "checks": [],
        "stats": {"acceptance": figures},
    }
    return registry.register_adapter(cfg, adapter, "agent", report)


def test_draft_trains_a_better_drafter_and_records_it(project, tiny_vl_base, tmp_path, tmp_path_factory):
    from pipeline.draft.artifact import check_drafter
    from pipeline.registry.store import mlflow_for
    from pipeline.release.status import collect

    base = drafted_base(tiny_vl_base, tmp_path_factory)
    reg = _registered(project, base, tmp_path)
    client = mlflow_for(project).MlflowClient()
    mv = client.get_model_version("agent", "1")
    assert (
        mv.tags["acceptance.ratio"] == "0.75" and "Speed: MTP acceptance length 2 base, 1.5" in mv.description
    )

    out = tmp_path / "kept"

    def runs() -> int:
        return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))

    n_runs = runs()
    # --dry-run (issue 41 item 5's sibling): the checks and the plan, no run, no drafter, no tags
    r = CliRunner().invoke(
        app, ["draft", "agent", "--version", str(reg.version), "--base", str(base), "--out", str(out), "--dry-run",
              "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and plan["action"] == "draft" and plan["base"] == str(base)
    assert len(plan["train_files"]) == 1 and len(plan["validation_files"]) == 1 and plan["mtp_tensors"] > 0
    assert not out.exists() and runs() == n_runs
    assert not any(k.startswith("drafter.") for k in client.get_model_version("agent", "1").tags)
    r = CliRunner().invoke(app, ["draft", "agent", "--version", "9", "--base", str(base), "--dry-run"])
    assert r.exit_code == 2 and "9" in r.output  # an unknown version: refused as the real run refuses it
    r = CliRunner().invoke(
        app,
        ["draft", "agent", "--version", str(reg.version), "--base", str(base), "--max-steps", "30", "--lr", "0.01",
         "--budget-s", "600", "--out", str(out), "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)  # --json: stdout is one JSON document
    assert res["acceptance_length_after"] > res["acceptance_length_before"], res

    mv = client.get_model_version("agent", "1")
    assert mv.tags["drafter.run_id"] == res["run_id"] and mv.tags["drafter.sha256"] == res["sha256"]
    assert mv.tags["acceptance.ratio"] == "0.75"  # the estimate recorded at registration stays
    assert "drafter " + res["sha256"][:12] in mv.description.splitlines()[-1]
    run = client.get_run(res["run_id"])
    assert run.data.tags["model_version"] == "agent/1" and run.info.status == "FINISHED"
    assert run.data.metrics["acceptance_length_after"] == res["acceptance_length_after"]
    got = tmp_path / "downloaded"
    import mlflow

    mlflow.set_tracking_uri(project.tracking_uri)
    d = mlflow.artifacts.download_artifacts(artifact_uri=res["artifact_uri"], dst_path=str(got))
    assert check_drafter(d, base).sha256 == res["sha256"]  # the artifact is the checked drafter
    assert check_drafter(out, base).sha256 == res["sha256"]

    row = collect(project, "agent", fleet=False)["models"][0]["versions"][0]
    assert row["speed"]["acceptance.speed_ratio"] == 0.6975
    assert row["speed"]["drafter.length_after"] == res["acceptance_length_after"]
    wide = CliRunner().invoke(app, ["status", "agent", "-o", "wide", "--no-headers"])
    assert "AL=1.5/2.0,x0.6975,drafter=" in wide.stdout, wide.output
    shutil.rmtree(got)


def test_draft_refuses_an_unknown_version_and_a_base_without_mtp(
    project, tiny_vl_base, tiny_base, tmp_path, tmp_path_factory
):
    base = drafted_base(tiny_vl_base, tmp_path_factory)
    _registered(project, base, tmp_path)
    r = CliRunner().invoke(app, ["draft", "agent", "--version", "7"])
    assert r.exit_code == 2 and "version 7 not found" in r.output
    r = CliRunner().invoke(app, ["draft", "agent", "--version", "1", "--base", str(tiny_base)])
    assert r.exit_code == 2 and "no mtp.* tensors" in r.output, r.output


def test_no_continuation_to_distil_on_is_a_clear_error(project, tiny_vl_base, tmp_path):
    """helper-2: when no training prompt gives a greedy continuation of the drafter's 3+ steps (there: the random
    tiny VL base answered EOS at once; here: a training file with no conversation left), `distil`'s ValueError
    came out as a traceback, exit 1, no JSON; now exit 2 naming the fix."""
    reg = _registered(project, tiny_vl_base, tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    r = CliRunner().invoke(
        app, ["draft", "agent", "--version", str(reg.version), "--base", str(tiny_vl_base), "--max-steps", "1",
              "--json"],
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    err = json.loads(r.stdout)["error"]
    assert "no greedy continuation" in err and "more (or longer) training conversations" in err
