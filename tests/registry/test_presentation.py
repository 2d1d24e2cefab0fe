"""What the MLflow UI shows first (issue 27 item 10): a version's headline, the model's summary tags and
description, rewritten from the registry's state after every change. The browser test
(test_registry_ui.py) checks the same on the pages."""

from __future__ import annotations

import json
import uuid

from pipeline import registry
from pipeline.registry.presentation import body, headline, model_summary
from pipeline.release.publish import publish
from tests.support import registry_support
from tests.support.registry_support import register

registry_project = registry_support.registry_project
two_adapters = registry_support.two_adapters


def test_headline_answers_first():
    assert headline({"validation.verdict": "fail"}).startswith("NOT SHIPPABLE: validation fail")
    gated = {"validation.verdict": "pass", "gate.verdict": "gated", "gate.reason": "eval_loss 7.1 is worse"}
    assert headline(gated) == "GATED, stays candidate: eval_loss 7.1 is worse"
    shipped = {"validation.verdict": "pass", "published.path": "/vol/a-v1", "published.time": "T"}
    assert headline(shipped) == "PUBLISHED to /vol/a-v1 at T"
    assert headline({"validation.verdict": "pass"}).startswith("candidate: validation pass, not published")
    forced = {**gated, "published.path": "/vol/a-v2", "published.time": "T"}  # shipped with --force
    assert headline(forced) == "PUBLISHED to /vol/a-v2 at T (past the gate: shipped with --force)"
    # the facts paragraph survives a new headline; the `Gate:` lines of older versions go
    assert body("GATED, stays candidate: x\n\nLoRA r=8 ...\nGate: gated: x") == "LoRA r=8 ..."
    assert (
        body("LoRA r=8 ... (registered by an older pipeline)")
        == "LoRA r=8 ... (registered by an older pipeline)"
    )


def test_model_summary_names_production_even_when_a_candidate_is_newer():
    """The model list shows one alias and hides `production` behind "+2": the tags column says it."""
    tags, text = model_summary(
        "a",
        {"production": 1, "candidate": 2, "previous": 0},
        {1: {"published.path": "/vol/a-v1"}, 2: {"gate.verdict": "gated", "gate.reason": "worse"}},
    )
    assert tags == {"production": "v1", "production.path": "/vol/a-v1", "candidate": "v2 gated"}
    lines = text.splitlines()
    assert lines[0] == "production: v1, published to /vol/a-v1" and lines[1] == "candidate: v2, gated: worse"
    assert "pipeline promote a VERSION" in text and "'Promote model' button" in text
    assert model_summary("a", {"candidate": 1}, {1: {}})[0] == {"candidate": "v1"}


def test_the_registry_keeps_them_current(registry_project, two_adapters, tiny_base):
    cfg = registry_project
    name = f"ui-{uuid.uuid4().hex[:6]}"
    register(cfg, two_adapters[0], tiny_base, name)
    c = registry.client(cfg)
    assert c.get_model_version(name, "1").description.startswith("candidate: validation pass")
    assert c.get_registered_model(name).tags == {"candidate": "v1"}
    pub = publish(cfg, name, version=1)
    first = c.get_model_version(name, "1").description.splitlines()
    assert (
        first[0].startswith(f"PUBLISHED to {pub.path} at ")
        and first[1] == ""
        and first[2].startswith("LoRA r=8")
    )
    register(cfg, two_adapters[1], tiny_base, name)
    registry.record_gate(cfg, name, 2, "gated", "eval_loss 9.0 is worse than production v1's 1.5")
    rm = c.get_registered_model(name)
    assert rm.tags == {"production": "v1", "production.path": str(pub.path), "candidate": "v2 gated"}
    assert rm.description.startswith(
        f"production: v1, published to {pub.path}\ncandidate: v2, gated: eval_loss 9.0"
    )
    assert c.get_model_version(name, "2").description.startswith("GATED, stays candidate: eval_loss 9.0")
    publish(cfg, name, version=2, force=True)  # promoted by hand after all
    rm = c.get_registered_model(name)
    assert rm.tags["production"] == "v2" and "candidate" not in rm.tags
    assert "previous: v1" in rm.description
    assert c.get_model_version(name, "2").description.startswith("PUBLISHED to ")


def test_a_version_keeps_one_events_tag_not_one_tag_per_event(registry_project, two_adapters, tiny_base):
    """The version page lists every tag in one box sorted by name: a tag per event (`event.<stamp>.<type>`
    JSON) grew with every publish, rollout and rollback and pushed `published.path` below it."""
    cfg = registry_project
    name = f"ev-{uuid.uuid4().hex[:6]}"
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    for v in (1, 2, 1, 2):
        publish(cfg, name, version=v)
    c = registry.client(cfg)
    for v in (1, 2):
        tags = c.get_model_version(name, str(v)).tags
        assert not [k for k in tags if k.startswith("event.")], sorted(tags)
        assert [e["type"] for e in registry.events(c.get_model_version(name, str(v)))] == [
            "publish",
            "publish",
        ]
    assert registry.ship_history(registry.versions(cfg, name)) == [1, 2, 1, 2]
    # a version written by an older pipeline (a tag per event) reads the same, in time order
    from types import SimpleNamespace

    old = SimpleNamespace(
        version=3,
        tags={
            "event.20260101T000000.000001Z.publish": '{"type": "publish", "time": "2026-01-01T00:00:00+00:00"}',
            "events": '[{"type": "rollback", "stamp": "20260102T000000.000000Z"}]',
        },
    )
    assert [e["type"] for e in registry.events(old)] == ["publish", "rollback"]


def test_the_events_tag_stays_bounded():
    from pipeline.registry.events import MAX_EVENTS_CHARS, _bounded

    items = [{"type": "rollout", "id": f"{i:012d}", "instances": ["i"] * 20} for i in range(500)]
    text = _bounded(items)
    assert len(text) <= MAX_EVENTS_CHARS and json.loads(text)[-1]["id"] == f"{499:012d}"


def test_a_publish_in_the_same_second_as_a_prune_is_published():
    """test_kills' prune-then-publish failed 2 runs in 3 under load: both events' `time` fall in one
    second and `pruned.time >= published.time` called the re-published version pruned. The order is
    the microsecond `stamp`; `time` only for tags written before stamps were kept."""
    from pipeline.registry.presentation import published_path

    same = "2026-12-01T10:00:00+00:00"
    tags = {"published.path": "/v/a-v1", "published.time": same, "pruned.time": same}
    assert published_path(tags) is None  # no stamps: the second decides, as before
    assert (
        published_path(
            tags | {"pruned.stamp": "20261201T100000.100000Z", "published.stamp": "20261201T100000.200000Z"}
        )
        == "/v/a-v1"
    )
    assert (
        published_path(
            tags | {"pruned.stamp": "20261201T100000.300000Z", "published.stamp": "20261201T100000.200000Z"}
        )
        is None
    )
    assert published_path({"pruned.time": same}) is None


def test_a_training_run_reads_right_in_the_ui(registry_project, tiny_base, tmp_path):
    """Issue 41.7: the run's summary figures were logged at step 0 under the trainer's own keys (`eval_loss`
    drew a vertical segment at step 0, `train_loss` seemed to rise); the experiment was filed as GenAI
    ("Evaluation runs"); the run had no description and its page never said it was gated. Siblings: the
    figures registration links to the LoggedModel, and a killed run's description."""
    from pipeline.registry.presentation import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, NOTE_TAG
    from tests.support.registry_support import adapter_with_manifest

    cfg = registry_project
    name = f"run-{uuid.uuid4().hex[:6]}"
    params = {
        "axolotl": {"lora_r": 8, "lora_alpha": 16, "base_model": "tiny"},
        "dataset_fingerprint": "f" * 64,
    }
    rid = registry.start_training_run(cfg, name, params, [])
    c = registry.client(cfg)
    run = c.get_run(rid)
    assert c.get_experiment(run.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert run.data.tags[NOTE_TAG].startswith("TRAINING (axolotl)\n\nLoRA r=8 alpha=16 on tiny")
    for step, loss in ((1, 7.0), (2, 6.5), (3, 6.2)):  # the trainer's own per-step curves
        c.log_metric(rid, "loss", loss, step=step)
        c.log_metric(rid, "eval_loss", loss + 0.1, step=step)
    summary = {"train_loss": 6.2, "eval_loss": 6.30000001, "tokens_per_s": 1234.5, "steps": 3}
    registry.finish_training_run(cfg, rid, {**summary, "dataset.train.kept": 120}, [], ok=True)
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "eval_loss")] == [
        (1, 7.1),
        (2, 6.6),
        (3, 6.3),
    ]
    assert c.get_metric_history(rid, "train_loss") == []
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "summary.eval_loss")] == [(3, 6.30000001)]
    run = c.get_run(rid)
    assert {"summary.train_loss", "summary.tokens_per_s", "dataset.train.kept"} <= set(run.data.metrics)
    assert run.data.tags[NOTE_TAG].startswith("TRAINED in 3 steps: train_loss 6.2, eval_loss 6.3\n\nLoRA r=8")

    # registered from this run, then gated: the run's page says so first, and carries the verdict
    adapter = adapter_with_manifest(tiny_base, tmp_path / "a", seed=5, run_id=rid, eval_loss=6.3)
    reg = register(cfg, adapter, tiny_base, name)
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "final_eval_loss")] == [(0, 6.3)]
    assert "eval_loss" not in {m.key for m in c.get_logged_model(reg.model_id).metrics}
    registry.record_gate(cfg, name, reg.version, "gated", "eval_loss 6.3 is worse than production v1's 6.2")
    note = c.get_run(rid).data.tags[NOTE_TAG].splitlines()
    assert (
        note[0]
        == f"{name} v{reg.version}: GATED, stays candidate: eval_loss 6.3 is worse than production v1's 6.2"
    )
    assert note[2].startswith("TRAINED in 3 steps") and c.get_run(rid).data.tags["gate.verdict"] == "gated"

    killed = registry.start_training_run(cfg, name + "-k", params, [])
    registry.finish_training_run(cfg, killed, {}, [], ok=False, status="KILLED")
    assert c.get_run(killed).data.tags[NOTE_TAG].startswith("KILLED: stopped by a signal")
