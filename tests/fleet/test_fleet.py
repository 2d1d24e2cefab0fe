"""Fleet logic without servers: desired-state file, lock, resolver layout rules, unreachable instances.

The serving behaviour (publish under load, kill/restart, rollback) is in test_fleet_vllm.py
against real vLLM CPU instances.
"""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pipeline.config import load_config
from pipeline.errors import LockedError, UsageError
from pipeline.fleet.modes import resolver_layout_problems
from pipeline.fleet.reconcile import status
from pipeline.fleet.state import FleetState, fleet_lock, load_state, save_state, state_path
from tests.support.fleet_server import free_port
from tests.support.helpers import write_project_config


def _cfg(tmp_path, **fleet):
    fleet.setdefault("volume_mount", str(tmp_path / "volume"))
    return load_config(write_project_config(tmp_path, served={"model": "/models/base"}, fleet=fleet))


def test_state_round_trip_and_history(tmp_path):
    vol = tmp_path / "vol"
    assert load_state(vol).adapters == {}
    st = FleetState()
    st.set("chat", 1)
    st.set("chat", 2)
    st.set("chat", 1)  # rollback: 1 moves to the end of the history
    save_state(vol, st)
    back = load_state(vol)
    assert back.version("chat") == 1
    assert back.adapters["chat"]["history"] == [2, 1]
    assert back.previous("chat") == 2
    assert not list(vol.glob(".fleet-state.json.*.tmp"))  # atomic write leaves no temp file


def test_state_file_errors_name_the_file(tmp_path):
    state_path(tmp_path).write_text("{not json")
    with pytest.raises(UsageError, match="fleet-state.json: not valid JSON"):
        load_state(tmp_path)
    state_path(tmp_path).write_text(json.dumps({"schema": 1, "adapters": {"chat": {"version": "2"}}}))
    with pytest.raises(UsageError, match="adapters.chat: needs an integer 'version'"):
        load_state(tmp_path)


def test_lock_refuses_a_second_fleet_operation(tmp_path):
    """Another thread (or process) is refused; the holder itself may take it again (re-entrant)."""
    import threading

    errors: list[Exception] = []

    def other():
        try:
            with fleet_lock(tmp_path, 0.2):
                pass
        except LockedError as e:
            errors.append(e)

    with fleet_lock(tmp_path, 5):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        with fleet_lock(tmp_path, 0.2):  # re-entrant: a publish holding it calls the rollout, which takes it
            pass
    assert len(errors) == 1 and "another fleet operation" in str(errors[0])
    with fleet_lock(tmp_path, 0.2):  # released
        pass


def _adapter_dir(vol, name, base="/models/base"):
    d = vol / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    (d / "adapter_model.safetensors").write_bytes(b"x")
    return d


def test_resolver_layout_rules(tmp_path):
    cfg = _cfg(tmp_path, loading_mode="resolver")
    vol = cfg.volume.path
    good = _adapter_dir(vol, "chat-v1")
    assert resolver_layout_problems(cfg, "chat", 1, good) == []
    assert any(
        "directory name must be the model id 'chat-v2'" in p
        for p in resolver_layout_problems(cfg, "chat", 2, good)
    )
    wrong_base = _adapter_dir(vol, "chat-v3", base="Qwen/Qwen3.6-27B")
    assert any("base_model_name_or_path" in p for p in resolver_layout_problems(cfg, "chat", 3, wrong_base))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"y")
    leaky = _adapter_dir(vol, "chat-v4")
    os.symlink(outside, leaky / "extra.safetensors")
    assert any("leaves the volume root" in p for p in resolver_layout_problems(cfg, "chat", 4, leaky))


def test_status_reports_unreachable_instance(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, instances=[{"name": "down", "url": f"http://127.0.0.1:{free_port()}"}], timeout_s=2)
    st = FleetState()
    st.set("chat", 1)
    save_state(cfg.volume.path, st)
    rows = status(cfg)
    assert [(r.instance, r.state) for r in rows] == [("down", "unreachable")]

    from pipeline.cli import app

    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["fleet", "status", "--json"])
    assert res.exit_code == 4, res.output
    assert json.loads(res.output)[0]["state"] == "unreachable"
    res = CliRunner().invoke(app, ["fleet", "sync"])
    assert res.exit_code == 4 and "unreachable" in res.output


def test_missing_api_key_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEET_TEST_KEY", raising=False)
    cfg = _cfg(
        tmp_path, instances=[{"name": "a", "url": "http://127.0.0.1:9", "api_key_env": "FLEET_TEST_KEY"}]
    )
    with pytest.raises(UsageError, match="FLEET_TEST_KEY"):
        status(cfg)


def test_rollback_of_an_unknown_adapter_is_a_usage_error(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    from pipeline.cli import app

    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["rollback", "chat"])
    assert res.exit_code == 2
    assert "chat" in res.output and "not found" in res.output


def test_rollback_without_a_fleet_uses_the_registry_aliases(tmp_path, monkeypatch, tiny_base):
    """No instances and no fleet-state.json: rollback moves `production` back via the aliases."""
    from pipeline import registry
    from pipeline.config import load_config
    from pipeline.release.publish import publish
    from pipeline.release.rollback import rollback
    from tests.support.helpers import write_project_config
    from tests.support.registry_support import adapter_with_manifest, register

    cfg = load_config(write_project_config(tmp_path))
    for seed in (0, 1):
        register(cfg, adapter_with_manifest(tiny_base, tmp_path / f"a{seed}", seed=seed), tiny_base, "solo")
        publish(cfg, "solo", version=seed + 1)
    assert rollback(cfg, "solo")[:2] == (2, 1)
    assert registry.aliases(cfg, "solo")["production"] == 1
    import pytest

    from pipeline.errors import UsageError

    with pytest.raises(UsageError, match="version 9 not found"):
        rollback(cfg, "solo", to=9)
