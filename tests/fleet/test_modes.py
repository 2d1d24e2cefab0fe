"""The loading modes behind one interface (`pipeline.fleet.modes`) and the client-side resolver."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.config import load_config
from pipeline.errors import UsageError
from pipeline.fleet.modes import ApiMode, ResolverMode, loading_mode, resolve_served_name
from pipeline.fleet.state import FleetState, save_state
from tests.support.helpers import write_project_config


def _cfg(tmp_path, **fleet):
    return load_config(write_project_config(tmp_path, served={"model": "/models/base"}, fleet=fleet))


@pytest.mark.parametrize(
    "fleet, cls, strategy, served",
    [
        ({"vllm_version": "0.19.2rc1.dev123+gabc"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.32.0"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.33.0"}, ApiMode, "repoint", "chat"),
        ({"vllm_version": "0.33.0", "swap_strategy": "versioned"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.19.1", "loading_mode": "resolver"}, ResolverMode, None, "chat-v3"),
    ],
)
def test_mode_and_served_name_per_config(tmp_path, fleet, cls, strategy, served):
    cfg = _cfg(tmp_path, **fleet)
    mode = loading_mode(cfg)
    assert isinstance(mode, cls)
    assert getattr(getattr(mode, "plan", None), "strategy", None) == strategy
    assert mode.served_name("chat", 3) == served
    st = FleetState()
    st.set("chat", 3)
    save_state(cfg.volume.path, st)
    assert resolve_served_name(cfg, "chat") == served


def test_unsafe_repoint_is_refused_before_any_request(tmp_path):
    cfg = _cfg(tmp_path, vllm_version="0.19.2rc1.dev123+gabc", swap_strategy="repoint")
    with pytest.raises(UsageError, match="keyed by adapter name only"):
        loading_mode(cfg)


def test_fleet_resolve_cli(tmp_path, monkeypatch):
    from pipeline.cli import app

    cfg = _cfg(tmp_path, vllm_version="0.32.0")
    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat"])
    assert res.exit_code == 2 and "no desired version" in res.output
    st = FleetState()
    st.set("chat", 7)
    save_state(cfg.volume.path, st)
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat"])
    assert res.exit_code == 0 and res.output.strip() == "chat-v7"
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat", "--json"])
    assert json.loads(res.output) == {"adapter": "chat", "model": "chat-v7"}
