"""Registry and lineage in a real (sqlite) MLflow store: versions, aliases, events, follow, status."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.errors import UsageError
from tests.support import registry_support
from tests.support.helpers import log_messages
from tests.support.registry_support import free_port, register

# session fixtures shared by the tests/test_registry*.py modules
registry_project = registry_support.registry_project
two_adapters = registry_support.two_adapters


def _client(cfg):
    return registry.client(cfg)


def _names(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# -- lineage -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lineage_dataset_run_model_version(trained, tiny_base):
    """dataset digest -> run (params, per-step metrics, throughput, artifacts) -> LoggedModel -> version."""
    from pipeline.artifacts.hashing import sha256_file
    from pipeline.artifacts.manifest import read_manifest

    cfg, res = trained
    name = _names("lineage")
    reg = register(cfg, res.adapter_dir, tiny_base, name)
    client = _client(cfg)
    manifest = read_manifest(res.adapter_dir)

    # run: params, dataset inputs with our sha256 as digest, per-step + summary metrics, artifacts
    run = client.get_run(res.run_id)
    assert reg.run_id == res.run_id
    assert run.data.params["dataset_fingerprint"] == manifest.dataset.fingerprint
    assert run.data.params["axolotl.lora_r"] == "8"
    digests = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
    for f in manifest.dataset.files:
        from pathlib import Path

        assert digests[Path(f.path).name] == sha256_file(Path(f.path))[:36]
    loss = client.get_metric_history(res.run_id, "loss")
    assert len(loss) >= 2, "axolotl's MLflow integration logs the training loss per step"
    assert {"eval_loss", "learning_rate", "grad_norm", "summary.tokens_per_s"} <= set(run.data.metrics)
    assert run.data.metrics["summary.tokens_per_s"] > 0
    assert "mfu.unavailable" in run.data.tags  # CPU: no peak FLOP/s to compute MFU against
    arts = {a.path for a in client.list_artifacts(res.run_id)}
    assert {"manifest.json", "dataset_report.json"} <= arts
    reports = [a.path for a in client.list_artifacts(res.run_id, f"validation/{name}")]
    assert reports == [f"validation/{name}/v{reg.version}.json"]

    # logged model: source run, exactly the adapter directory as artifact (no base weights)
    lm = client.get_logged_model(reg.model_id)
    assert lm.source_run_id == res.run_id
    files = {a.path for a in client.list_logged_model_artifacts(reg.model_id)}
    assert files == {p.name for p in res.adapter_dir.iterdir()}
    assert "final_eval_loss" in {m.key for m in lm.metrics}

    # version: run, source model, tags, description, alias
    mv = client.get_model_version(name, str(reg.version))
    assert mv.run_id == res.run_id and mv.source == f"models:/{reg.model_id}"
    assert mv.tags["weights_sha256"] == sha256_file(res.adapter_dir / "adapter_model.safetensors")
    assert mv.tags["dataset_fingerprint"] == manifest.dataset.fingerprint
    assert mv.tags["validation.verdict"] == "pass"
    assert mv.tags["base_fingerprint"] == manifest.base_model.fingerprint
    assert float(mv.tags["eval_loss"]) == pytest.approx(manifest.metrics.eval_loss, rel=1e-3)
    for fact in (
        "LoRA r=8",
        str(tiny_base),
        "served on tiny-qwen3.5",
        manifest.dataset.fingerprint[:16],
        "eval_loss",
        "validation pass",
    ):
        assert fact in mv.description
    assert client.get_model_version_by_alias(name, "candidate").version == mv.version
    found = client.search_model_versions(f"name='{name}' and tags.`validation.verdict` = 'pass'")
    assert [v.version for v in found] == [mv.version]


# -- aliases and events ----------------------------------------------------------------------------------
def test_aliases_move_on_publish_promote_and_rollback(registry_project, two_adapters, tiny_base):
    from pipeline.cli import app
    from pipeline.release.publish import publish

    cfg = registry_project
    name = _names("aliases")
    v1 = register(cfg, two_adapters[0], tiny_base, name).version
    v2 = register(cfg, two_adapters[1], tiny_base, name).version
    assert (v1, v2) == (1, 2)
    assert registry.aliases(cfg, name) == {"candidate": 2}

    pub = publish(cfg, name, version=1)
    assert registry.aliases(cfg, name) == {"candidate": 2, "production": 1}
    ev = registry.events(_client(cfg).get_model_version(name, "1"))
    assert [e["type"] for e in ev] == ["publish"] and ev[0]["path"] == str(pub.path)

    # `pipeline promote NAME 2`: production moves, previous is the version it replaced
    runner = CliRunner()
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    r = runner.invoke(app, ["promote", name, "2"], env=env)
    assert r.exit_code == 0, r.output
    assert "promoted" in r.output and "previous: v1" in r.output
    assert registry.aliases(cfg, name) == {"candidate": 2, "production": 2, "previous": 1}
    assert (cfg.volume.path / f"{name}-v2" / "manifest.json").exists()

    # the fleet records which instances confirmed
    registry.record_event(cfg, name, 2, {"type": "rollout", "instances": ["i0", "i1"]})
    mv2 = _client(cfg).get_model_version(name, "2")
    assert mv2.tags["rollout.instances"] == "i0,i1"
    assert mv2.tags["published.path"] == str(cfg.volume.path / f"{name}-v2")

    # rollback: production back to previous, previous to the version rolled back from
    assert registry.rollback_aliases(cfg, name, instances=["i0"]) == (2, 1)
    assert registry.aliases(cfg, name) == {"candidate": 2, "production": 1, "previous": 2}
    ev1 = registry.events(_client(cfg).get_model_version(name, "1"))
    assert ev1[-1]["type"] == "rollback" and ev1[-1]["from_version"] == 2 and ev1[-1]["instances"] == ["i0"]
    ev2 = registry.events(_client(cfg).get_model_version(name, "2"))
    assert [e["type"] for e in ev2] == ["publish", "rollout", "rolled_back"]

    # status: one row per version with aliases, verdict, path; --json is the same data
    r = runner.invoke(app, ["status", name, "--json"], env=env)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    rows = {v["version"]: v for v in data["models"][0]["versions"]}
    assert rows[1]["aliases"] == ["production"] and rows[2]["aliases"] == ["candidate", "previous"]
    assert rows[2]["verdict"] == "pass" and rows[2]["published_path"].endswith(f"{name}-v2")
    r = runner.invoke(app, ["status", name], env={**env, "COLUMNS": "250"})
    assert r.exit_code == 0 and "production" in r.output and f"{name}-v2" in r.output


def test_bad_requests_fail_clearly(registry_project, two_adapters, tiny_base):
    from pipeline.cli import app

    cfg = registry_project
    name = _names("bad")
    register(cfg, two_adapters[0], tiny_base, name)
    with pytest.raises(UsageError, match="no version has alias 'production'"):
        registry.rollback_aliases(cfg, name)
    with pytest.raises(UsageError, match="needs a 'type'"):
        registry.record_event(cfg, name, 1, {"instances": ["i0"]})
    with pytest.raises(UsageError, match="version 7 not found"):
        registry.record_event(cfg, name, 7, {"type": "rollout"})
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    r = CliRunner().invoke(app, ["promote", name, "9"], env=env)
    assert r.exit_code == 2 and "version 9 not found" in r.output and "versions [1]" in r.output
    r = CliRunner().invoke(app, ["status", "no-such-model"], env=env)
    assert r.exit_code == 2 and "not found" in r.output


def test_failed_validation_is_registered_but_never_promoted(registry_project, two_adapters, tiny_base):
    from pipeline.cli import app
    from pipeline.validate import validate_adapter

    cfg = registry_project
    name = _names("failing")
    rep = validate_adapter(two_adapters[0], tiny_base)
    rep.add("test.injected", "error", "injected failure")
    registry.register_adapter(cfg, two_adapters[0], name, rep.to_dict())
    r = CliRunner().invoke(app, ["promote", name, "1"], env={"PIPELINE_CONFIG": str(cfg.source)})
    assert r.exit_code == 1 and "validation verdict is 'fail'" in r.output
    assert registry.aliases(cfg, name) == {"candidate": 1}
    assert not (cfg.volume.path / f"{name}-v1").exists()


# -- follow the alias ---------------------------------------------------------------------------------
def _follow_in_thread(cfg, name, interval, **kw):
    from pipeline.jobs.follow import follow_alias

    shipped: list = []
    got = threading.Event()
    stop = threading.Event()
    polled = threading.Event()

    def on_publish(pub):
        shipped.append((time.monotonic(), pub))
        got.set()

    t = threading.Thread(
        target=follow_alias,
        args=(cfg, "production", interval),
        kwargs={
            "names": [name],
            "on_publish": on_publish,
            "stop": stop,
            "on_poll": polled.set,
            **kw,
        },
        daemon=True,
    )
    t.start()
    assert polled.wait(60), "first poll did not finish"
    return t, stop, got, shipped


def test_follow_alias_publishes_within_one_poll_interval(registry_project, two_adapters, tiny_base):
    from pipeline.jobs.follow import follow_alias
    from pipeline.release.publish import publish

    cfg = registry_project
    name = _names("follow")
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    publish(cfg, name, version=1)
    # already shipped: nothing to do
    assert follow_alias(cfg, "production", 1, once=True, names=[name]) == []

    interval = 2.0
    t, stop, got, shipped = _follow_in_thread(cfg, name, interval)
    try:
        moved = time.monotonic()
        _client(cfg).set_registered_model_alias(name, "production", "2")  # what the MLflow UI does
        assert got.wait(60), "follower did not publish"
    finally:
        stop.set()
        t.join(30)
    when, pub = shipped[0]
    # one poll interval plus the publish itself (a download and a copy: well under 10 s even on
    # two busy cores); a poll loop that missed a round would take at least 2 intervals + publish
    assert when - moved < interval + 10, when - moved
    assert (pub.version, len(shipped)) == (2, 1)
    assert registry.aliases(cfg, name) == {"candidate": 2, "production": 2, "previous": 1}
    assert (cfg.volume.path / f"{name}-v2" / "manifest.json").exists()
    ev = registry.events(_client(cfg).get_model_version(name, "2"))
    assert ev[-1]["type"] == "publish"


def test_follow_alias_catches_up_after_downtime_and_skips_failing_versions(
    registry_project, two_adapters, tiny_base
):
    from pipeline.jobs.follow import follow_alias
    from pipeline.release.publish import publish
    from pipeline.validate import validate_adapter

    cfg = registry_project
    name = _names("catchup")
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    publish(cfg, name, version=2)
    publish(cfg, name, version=1)  # v2 is on the volume, but v1 was shipped last
    _client(cfg).set_registered_model_alias(name, "production", "2")  # moved while nobody followed
    done = follow_alias(cfg, "production", 1, once=True, names=[name])
    assert [p.version for p in done] == [2]
    assert registry.aliases(cfg, name)["previous"] == 1

    rep = validate_adapter(two_adapters[0], tiny_base)
    rep.add("test.injected", "error", "injected failure")
    registry.register_adapter(cfg, two_adapters[0], name, rep.to_dict())  # v3 fails validation
    _client(cfg).set_registered_model_alias(name, "production", "3")
    with log_messages() as msgs:
        assert follow_alias(cfg, "production", 1, once=True, names=[name]) == []
    assert any("v3 not published" in m and "verdict" in m for m in msgs)
    assert not (cfg.volume.path / f"{name}-v3").exists()


def test_webhook_wakes_the_follower_and_bad_signatures_are_refused(registry_project, two_adapters, tiny_base):
    from mlflow.webhooks.delivery import _generate_hmac_signature  # MLflow's own signing

    from pipeline.jobs.webhook import WebhookReceiver
    from pipeline.release.publish import publish

    cfg = registry_project
    name = _names("hook")
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    publish(cfg, name, version=1)
    secret = "s3cret"
    wake = threading.Event()
    with WebhookReceiver("127.0.0.1", free_port(), secret, wake, alias="production") as hook:
        body = json.dumps(
            {
                "entity": "model_version_alias",
                "action": "created",
                "timestamp": "now",
                "data": {"name": name, "alias": "production", "version": "2"},
            }
        )

        def post(sig=None, ts=None, payload=body):
            ts = ts or str(int(time.time()))
            delivery = str(
                uuid.uuid4()
            )  # a new id per delivery, as MLflow sends (a repeated one is a replay)
            sig = sig or _generate_hmac_signature(secret, delivery, ts, payload)
            return httpx.post(
                hook.url,
                content=payload,
                timeout=10,
                headers={
                    "X-MLflow-Signature": sig,
                    "X-MLflow-Delivery-Id": delivery,
                    "X-MLflow-Timestamp": ts,
                },
            )

        assert post(sig="v1,AAAA").status_code == 401
        assert post(ts=str(int(time.time()) - 3600)).status_code == 401  # replayed
        assert post(payload=body.replace("production", "x")).status_code == 204  # other alias: ignored
        assert not wake.is_set()

        # a poll interval of 10 minutes: only the webhook can make this publish happen in time
        t, stop, got, shipped = _follow_in_thread(cfg, name, 600, wake=wake)
        try:
            _client(cfg).set_registered_model_alias(name, "production", "2")
            assert post().status_code == 204
            assert got.wait(60), "webhook did not wake the follower"
        finally:
            stop.set()
            t.join(30)
    assert shipped[0][1].version == 2


def test_using_one_store_does_not_redirect_the_next_config(registry_project, tmp_path, monkeypatch):
    """Regression: mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI, which the config prefers,
    so every later config in the process (and its child processes) used the first store."""
    from pipeline.config import load_config
    from tests.support.helpers import write_project_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    registry.experiment_id(registry_project)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    other = load_config(write_project_config(tmp_path))
    assert other.tracking_uri != registry_project.tracking_uri
    assert str(tmp_path) in other.tracking_uri


def test_status_survives_an_unreachable_fleet(registry_project, two_adapters, tiny_base, capsys):
    """The fleet column comes from the instances; one that refuses connections is reported, not fatal."""
    from pipeline.cli._common import setup_logging
    from pipeline.cli.render import Output, print_status
    from pipeline.config import Instance
    from pipeline.release.status import collect

    cfg = registry_project.model_copy(deep=True)
    cfg.fleet.instances = [Instance(name="i0", url=f"http://127.0.0.1:{free_port()}")]
    name = _names("status")
    register(cfg, two_adapters[0], tiny_base, name)
    data = collect(cfg, name)
    assert [v["version"] for v in data["models"][0]["versions"]] == [1]
    assert data["models"][0]["versions"][0]["serving"] == []
    fleet_states = {r["state"] for r in data["fleet"] or []}
    assert fleet_states == {"unreachable"} or data["fleet_error"], data
    setup_logging()  # messages on this test's stderr
    print_status(data, Output.table)
    out, err = capsys.readouterr()
    assert name in out and "i0" in err  # the row on stdout, the unreachable instance on stderr


def test_fleet_sync_follow_alias_cli_ships_the_moved_alias(registry_project, two_adapters, tiny_base):
    """`pipeline fleet sync --follow-alias production` (one pass, as a CronJob step) publishes the
    version an operator moved the alias to in the MLflow UI."""
    import os
    import subprocess
    import sys

    from pipeline.release.publish import publish

    cfg = registry_project
    name = _names("cli-follow")
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    publish(cfg, name, version=1)
    _client(cfg).set_registered_model_alias(name, "production", "2")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "fleet", "sync", "--follow-alias", "production"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PIPELINE_CONFIG=str(cfg.source)),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (cfg.volume.path / f"{name}-v2" / "manifest.json").exists()
    assert registry.aliases(cfg, name)["previous"] == 1


def test_register_refuses_files_that_differ_from_the_manifest(
    registry_project, two_adapters, tiny_base, tmp_path
):
    """An adapter edited after training (here `r`) is not registered under the training's lineage."""
    import shutil

    cfg = registry_project
    bad = tmp_path / "edited"
    shutil.copytree(two_adapters[0], bad)
    acfg = json.loads((bad / "adapter_config.json").read_text())
    acfg["r"] = 16
    (bad / "adapter_config.json").write_text(json.dumps(acfg))
    with pytest.raises(registry.RegistryError, match="adapter_config.json: sha256"):
        registry.register_adapter(cfg, bad, _names("edited"), {"verdict": "pass"})
    from pipeline.cli import app

    r = CliRunner().invoke(
        app,
        ["register", str(bad), "--name", _names("edited"), "--base", str(tiny_base)],
        env={"PIPELINE_CONFIG": str(cfg.source)},
    )
    assert r.exit_code == 2 and "differ from manifest.json" in r.output
