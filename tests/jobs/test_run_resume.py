"""`pipeline run` killed between register and publish resumes the candidate instead of skipping it
(issue 16 section 1). No training: the registered version carries the fingerprint `run` computes for
these inputs, exactly as a run killed after registering leaves it (training is made to fail loudly)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.artifacts.fingerprint import training_inputs
from pipeline.cli import app
from pipeline.errors import GateFailed
from pipeline.jobs import run as run_mod
from pipeline.jobs.run import FINGERPRINT_TAG, run
from pipeline.release.publish import publish
from pipeline.train.config import load_training_config
from pipeline.train.dataset import files_fingerprint
from pipeline.train.launch import check_inputs
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import new_project

release_adapters = release_support.release_adapters
TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"
TRAIN, VALIDATION = REPO / "datasets/agent_chat_train.jsonl", REPO / "datasets/agent_chat_validation.jsonl"


def inputs(base, train=TRAIN, validation=VALIDATION) -> list[str]:
    """The `--set` overrides of tiny-cpu.yml for this base and data files."""
    return [
        f"base_model={base}",
        f"datasets=[{{path: {train}, ds_type: json, type: chat_template, "
        "field_messages: messages, roles_to_train: [assistant]}]",
        f"test_datasets=[{{path: {validation}, ds_type: json, split: train, "
        "type: chat_template, field_messages: messages, roles_to_train: [assistant]}]",
    ]


def cli_run(cfg, name: str, sets: list[str], **env: str):
    """`pipeline run` as a scheduler starts it: (exit code, its last line as JSON, stderr)."""
    args = ["run", str(TINY), "--name", name]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(app, args, env={"PIPELINE_CONFIG": str(cfg.source), **env})
    return r.exit_code, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


class Checked(Exception):
    """Raised in place of `check_inputs`: the run went past the quick skip."""


def checks(*a, **k):
    raise Checked


def shipped(cfg, name: str, fp: str, adapter) -> int:
    """A version of `name` trained from inputs `fp`, published: a later run with them skips."""
    reg = registry.register_adapter(cfg, adapter[0], name, adapter[1])
    registry.set_version_tags(cfg, name, reg.version, {FINGERPRINT_TAG: fp})
    publish(cfg, name, version=reg.version)
    return reg.version


@pytest.fixture
def setup(tmp_path, tiny_base, monkeypatch):
    cfg = new_project(tmp_path / "p")
    sets = inputs(tiny_base)
    tc = load_training_config(TINY, sets, [])
    ds = check_inputs(cfg, tc, set())
    fp = training_inputs(ds.fingerprint, tc.data)["fingerprint"]

    def no_training(*a, **k):
        raise AssertionError("pipeline run trained although a candidate from these inputs was registered")

    monkeypatch.setattr(run_mod, "train", no_training)
    return cfg, sets, fp


def test_killed_between_register_and_publish_is_published_by_the_next_run(setup, release_adapters):
    """Issue 16: later runs reported `skipped` (exit 0) and the version was never published."""
    cfg, sets, fp = setup
    adapter, report = release_adapters[0]
    reg = registry.register_adapter(cfg, adapter, "resume", report)
    registry.set_version_tags(cfg, "resume", reg.version, {FINGERPRINT_TAG: fp})  # then the kill

    out = run(cfg, TINY, name="resume", overrides=sets)
    assert (out.status, out.version) == ("published", reg.version)
    assert registry.alias_version(cfg, "resume", "production") == reg.version
    out = run(cfg, TINY, name="resume", overrides=sets)  # now it is shipped
    assert (out.status, out.version, out.fingerprint) == ("skipped", reg.version, fp)


def test_unchanged_inputs_skip_before_the_checks_and_a_changed_byte_runs_them(
    setup, release_adapters, monkeypatch, tmp_path
):
    """A nightly run with nothing new ran every check and axolotl's dataset gate (its import, a tokenization
    of every row: 9-10 s of a no-op run on the tiny data, minutes on a real dataset) only to skip. The
    files' bytes decide now; the checks run when a byte changed."""
    cfg, sets, fp = setup
    adapter, report = release_adapters[0]
    reg = registry.register_adapter(cfg, adapter, "nightly", report)
    registry.set_version_tags(cfg, "nightly", reg.version, {FINGERPRINT_TAG: fp})
    assert run(cfg, TINY, name="nightly", overrides=sets).status == "published"

    monkeypatch.setattr(run_mod, "check_inputs", checks)
    out = run(cfg, TINY, name="nightly", overrides=sets)
    assert (out.status, out.version, out.fingerprint) == ("skipped", reg.version, fp)
    with pytest.raises(Checked):  # --force retrains: checked first
        run(cfg, TINY, name="nightly", overrides=sets, force=True)
    changed = tmp_path / "train.jsonl"
    changed.write_bytes((REPO / "datasets/agent_chat_train.jsonl").read_bytes() + b"\n")
    with pytest.raises(Checked):
        run(
            cfg,
            TINY,
            name="nightly",
            overrides=[*sets, sets[1].replace(str(REPO / "datasets/agent_chat_train.jsonl"), str(changed))],
        )


def test_unchanged_inputs_still_meet_the_fleet_s_rules(setup, release_adapters, monkeypatch):
    """The quick skip came before every check: with `PIPELINE_FLEET__MAX_LORA_RANK=1` (the fleet serves
    rank <= 1, the config trains r=8) `pipeline run` said `skipped` and exited 0, hiding that the fleet can no
    longer serve what the job trains (before the skip existed: exit 1). The config's own rules run first
    now; the dataset checks and gate still do not."""
    cfg, sets, fp = setup
    v = shipped(cfg, "fleet", fp, release_adapters[0])
    monkeypatch.setattr(run_mod, "check_inputs", checks)
    code, last, err = cli_run(cfg, "fleet", sets, PIPELINE_FLEET__MAX_LORA_RANK="1")
    assert (code, last["status"], last["exit_code"]) == (1, "failed", 1), (last, err)
    assert "lora_r = 8 exceeds the fleet's --max-lora-rank 1" in err and "[config.rank]" in err
    code, last, err = cli_run(cfg, "fleet", sets, PIPELINE_FLEET__MAX_LORA_RANK="8")  # served: skipped
    assert (code, last["status"], last["version"]) == (0, "skipped", v), (last, err)


def test_swapped_files_of_two_dataset_entries_are_not_skipped(
    tmp_path, tiny_base, release_adapters, monkeypatch
):
    """Two training entries with different options: swapping their files changes what is trained, but the
    fingerprint (options without paths, sorted file hashes) stayed and the run skipped."""
    cfg = new_project(tmp_path / "p")

    def two(first: Path, second: Path) -> list[str]:
        return [
            inputs(tiny_base)[0],
            f"datasets=[{{path: {first}, ds_type: json, type: chat_template, roles_to_train: [assistant]}}, "
            f"{{path: {second}, ds_type: json, type: chat_template, roles_to_train: [assistant, tool]}}]",
            "test_datasets=null",
        ]

    data_fp = files_fingerprint([TRAIN, VALIDATION])
    fp = training_inputs(data_fp, load_training_config(TINY, two(TRAIN, VALIDATION)).data)["fingerprint"]
    v = shipped(cfg, "entries", fp, release_adapters[0])
    monkeypatch.setattr(run_mod, "check_inputs", checks)
    out = run(cfg, TINY, name="entries", overrides=two(TRAIN, VALIDATION))
    assert (out.status, out.version) == ("skipped", v)
    with pytest.raises(Checked):  # the same files, the other way round: checked, then trained
        run(cfg, TINY, name="entries", overrides=two(VALIDATION, TRAIN))


def test_a_missing_input_exits_2_and_names_it(tmp_path, tiny_base):
    """README: bad input exits 2. A missing data file exited 1 and the last line said only `training config
    refused:`; a base directory that was moved was reported as "a hub id without base_model_revision"."""
    cfg = new_project(tmp_path / "p")
    gone = tmp_path / "gone.jsonl"
    code, last, err = cli_run(cfg, "missing", inputs(tiny_base, validation=gone))
    assert (code, last["status"], last["exit_code"]) == (2, "failed", 2), (last, err)
    assert f"test_datasets[0] (type chat_template) path {gone} does not exist" in last["reason"]
    moved = tmp_path / "moved-base"  # where the base was
    code, last, err = cli_run(cfg, "missing", inputs(moved))
    assert (code, last["exit_code"]) == (2, 2), (last, err)
    assert (
        f"base_model {moved} does not exist: the base model directory was moved or deleted" in last["reason"]
    )
    assert "point base_model at the directory" in last["reason"] and "hub id without" not in err


def test_a_gated_candidate_is_gated_again_not_skipped(setup, release_adapters):
    cfg, sets, fp = setup
    prod = registry.register_adapter(cfg, release_adapters[1][0], "gated", release_adapters[1][1])
    publish(cfg, "gated", version=prod.version)
    registry.set_version_tags(cfg, "gated", prod.version, {"eval_loss": "0.0001"})  # unbeatable
    cand = registry.register_adapter(cfg, release_adapters[0][0], "gated", release_adapters[0][1])
    registry.set_version_tags(cfg, "gated", cand.version, {FINGERPRINT_TAG: fp})
    with pytest.raises(GateFailed) as e:
        run(cfg, TINY, name="gated", overrides=sets)
    assert e.value.outcome.status == "gated" and e.value.outcome.version == cand.version
    assert registry.alias_version(cfg, "gated", "production") == prod.version


def test_killed_between_register_and_fingerprint_tag_registers_once(setup, release_adapters, tiny_base):
    """Sibling: killed after `register` but before the fingerprint tag. The finished training is
    reused and the version with the same weights is reused too: no duplicate version."""
    cfg, sets, fp = setup
    run_dir = cfg.train.runs_dir / f"tagless-{fp[:12]}"
    shutil.copytree(release_adapters[0][0], run_dir / "adapter")
    reg = registry.register_adapter(cfg, run_dir / "adapter", "tagless", release_adapters[0][1])
    cfg.base.path = Path(tiny_base)
    out = run(cfg, TINY, name="tagless", overrides=sets)
    assert (out.status, out.version) == ("published", reg.version)
    assert [int(v.version) for v in registry.versions(cfg, "tagless")] == [reg.version]
    assert registry.versions(cfg, "tagless")[0].tags[FINGERPRINT_TAG] == fp


def test_publish_gate_refusal_is_a_gated_run(setup, release_adapters):
    """A refusal from publish's own gates (here: `canary.required` with no canary recorded) keeps
    the candidate, records the gate on the version and raises GateFailed (exit 5), like the eval gate."""
    cfg, sets, fp = setup
    cand = registry.register_adapter(cfg, release_adapters[0][0], "canaried", release_adapters[0][1])
    registry.set_version_tags(cfg, "canaried", cand.version, {FINGERPRINT_TAG: fp})
    cfg.canary.required = True
    with pytest.raises(GateFailed) as e:
        run(cfg, TINY, name="canaried", overrides=sets)
    out = e.value.outcome
    assert (out.status, out.version) == ("gated", cand.version) and "canary" in out.reason
    assert registry.alias_version(cfg, "canaried", "production") is None
    tags = registry.resolve_version(cfg, "canaried", version=cand.version).tags
    assert tags["gate.verdict"] == "gated" and "canary" in tags["gate.reason"]
    assert not (cfg.volume.path / f"canaried-v{cand.version}").exists()
