"""`pipeline run` killed between register and publish resumes the candidate instead of skipping it
(issue 16 section 1). No training: the registered version carries the fingerprint `run` computes for
these inputs, exactly as a run killed after registering leaves it (training is made to fail loudly)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline import registry
from pipeline.artifacts.fingerprint import training_inputs
from pipeline.errors import GateFailed
from pipeline.jobs import run as run_mod
from pipeline.jobs.run import FINGERPRINT_TAG, run
from pipeline.train.config import load_training_config
from pipeline.train.launch import check_inputs
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import new_project

release_adapters = release_support.release_adapters
TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


@pytest.fixture
def setup(tmp_path, tiny_base, monkeypatch):
    cfg = new_project(tmp_path / "p")
    sets = [
        f"base_model={tiny_base}",
        f"datasets=[{{path: {REPO / 'datasets/agent_chat_train.jsonl'}, ds_type: json, type: chat_template, "
        "field_messages: messages, roles_to_train: [assistant]}]",
        f"test_datasets=[{{path: {REPO / 'datasets/agent_chat_validation.jsonl'}, ds_type: json, split: train, "
        "type: chat_template, field_messages: messages, roles_to_train: [assistant]}]",
    ]
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

    class Checked(Exception):
        pass

    def checks(*a, **k):
        raise Checked

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


def test_a_gated_candidate_is_gated_again_not_skipped(setup, release_adapters):
    cfg, sets, fp = setup
    prod = registry.register_adapter(cfg, release_adapters[1][0], "gated", release_adapters[1][1])
    from pipeline.release.publish import publish

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
