"""Publish, kill/restart, sync and rollback against two REAL vLLM CPU instances on 127.0.0.1.

Base: the tiny Qwen3.5 hybrid from `pipeline.dev.tinybase` (hidden 128, 4 heads of 64, linear head
dims 128: vLLM's CPU build serves it). Adapters: random PEFT LoRAs (`tests/helpers.peft_adapter`)
registered in a real sqlite MLflow, published through `pipeline publish`. The instances see the
volume at its real path (volume_mount = volume path). Both instances start once per module,
in parallel (~40-80 s on 2 busy cores); one restart in the kill test.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.support.fleet_server import VllmServer, fleet_env_available
from tests.support.helpers import peft_adapter, write_project_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.skipif(not fleet_env_available(), reason=".fleet-venv missing: run `make fleet-env`"),
]

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_base):
    """Two running instances + a project whose fleet section points at them; yields a namespace."""
    from pipeline.config import load_config

    root = tmp_path_factory.mktemp("fleet")
    servers = [VllmServer(tiny_base, root, "a").start(), VllmServer(tiny_base, root, "b").start()]
    volume = (root / "volume").resolve()
    cfg_path = write_project_config(
        root,
        served={"model": str(Path(tiny_base).resolve())},
        fleet={
            "instances": [{"name": s.name, "url": s.url} for s in servers],
            "volume_mount": str(volume),
            "timeout_s": 60,
            "keep_versions": 2,
        },
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("PIPELINE_CONFIG", str(cfg_path))
    ns = type("Fleet", (), {})()
    ns.servers, ns.cfg, ns.root, ns.base = (
        {s.name: s for s in servers},
        load_config(cfg_path),
        root,
        tiny_base,
    )
    try:
        # Register while the instances boot (~40-80 s): the registry does not need them.
        ns.chat = [_register(ns, "chat", seed) for seed in (11, 12, 13)]
        for s in servers:
            s.wait_ready()
        yield ns
    finally:
        mp.undo()
        for s in servers:
            s.stop()


def _register(fleet, name: str, seed: int, **kw) -> int:
    """A PEFT adapter with a manifest, validated and registered; returns its version number."""
    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.manifest import MANIFEST, file_hashes
    from pipeline.registry import register_adapter
    from pipeline.validate import FleetRules, validate_adapter

    d = peft_adapter(fleet.base, fleet.root / f"src-{name}-{seed}", seed=seed, **kw)
    write_json_atomic(
        d / MANIFEST,
        {"schema": 1, "name": name, "files": file_hashes(d), "base_model": {"id": str(fleet.base)}},
    )
    rep = validate_adapter(d, fleet.base, FleetRules()).to_dict()
    return register_adapter(fleet.cfg, d, name, rep).version


@pytest.fixture(scope="module")
def chat(fleet):
    """Three registered versions of adapter `chat`."""
    return fleet.chat


def cli(*args):
    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def publish(version: int, name: str = "chat"):
    return cli("publish", name, "--version", str(version))


def roots(server) -> dict:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c["root"] for c in data if c.get("parent")}


def complete(server, model: str) -> str:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def vpath(fleet, version: int, name: str = "chat") -> str:
    return str(fleet.cfg.volume.path / f"{name}-v{version}")


def production(fleet, name: str = "chat") -> int:
    from pipeline.registry import mlflow_for

    return int(mlflow_for(fleet.cfg).MlflowClient().get_model_version_by_alias(name, "production").version)


class Stream:
    """One client thread per instance sending greedy requests to the stable name back to back."""

    def __init__(self, servers, model="chat"):
        self.results = []  # (instance, t_start, ok, text or error)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(s, model), daemon=True) for s in servers]

    def _run(self, server, model):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.results.append((server.name, t0, True, complete(server, model)))
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.results.append((server.name, t0, False, repr(e)))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_publish_switches_every_instance_under_load(fleet, chat):
    v1, v2 = chat[0], chat[1]
    res = publish(v1)
    assert res.exit_code == 0, res.output
    a, b = fleet.servers["a"], fleet.servers["b"]
    expect = {s.name: (complete(s, f"chat-v{v1}"), complete(s, f"chat-v{v1}")) for s in (a, b)}
    with Stream([a, b]) as stream:
        time.sleep(1.0)
        res = publish(v2)
        t_done = time.monotonic()
        assert res.exit_code == 0, res.output
        while sum(1 for r in stream.results if r[1] > t_done) < 4:  # a few requests after the switch
            time.sleep(0.2)
    for s in (a, b):
        assert roots(s)["chat"] == vpath(fleet, v2)
        expect[s.name] = (expect[s.name][0], complete(s, f"chat-v{v2}"))
        assert expect[s.name][0] != expect[s.name][1], "v1 and v2 must be distinguishable by output"
    failures = [r for r in stream.results if not r[2]]
    assert failures == []
    after = [r for r in stream.results if r[1] > t_done]
    assert after and all(text == expect[inst][1] for inst, _, _, text in after), after
    assert (
        json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text())["adapters"]["chat"]["version"]
        == v2
    )
    assert production(fleet) == v2
    st = cli("fleet", "status", "--json")
    assert st.exit_code == 0, st.output
    assert {
        (r["instance"], r["state"], r["serving"]) for r in json.loads(st.output) if r["adapter"] == "chat"
    } == {("a", "ok", f"v{v2}"), ("b", "ok", f"v{v2}")}


def test_rollback_restores_previous_version_on_both(fleet, chat):
    v1, v2 = chat[0], chat[1]
    assert publish(v1).exit_code == 0 and publish(v2).exit_code == 0
    res = cli("rollback", "chat")
    assert res.exit_code == 0, res.output
    for s in fleet.servers.values():
        assert roots(s)["chat"] == vpath(fleet, v1)
        assert complete(s, "chat") == complete(s, f"chat-v{v1}")
    assert production(fleet) == v1
    assert (
        json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text())["adapters"]["chat"]["version"]
        == v1
    )


def test_killed_instance_fails_publish_then_sync_converges(fleet, chat):
    v1, v3 = chat[0], chat[2]
    assert publish(v1).exit_code == 0
    a, b = fleet.servers["a"], fleet.servers["b"]
    b.stop()
    res = publish(v3)
    assert res.exit_code == 4, res.output
    assert "b (http" in res.output and "unreachable" in res.output  # per-instance report
    assert "switched, then restored" in res.output and f"restored chat -> {vpath(fleet, v1)}" in res.output
    ra = roots(a)
    assert ra["chat"] == vpath(fleet, v1) and f"chat-v{v3}" not in ra  # undone on the switched instance
    assert production(fleet) == v1
    assert (
        json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text())["adapters"]["chat"]["version"]
        == v1
    )

    b.start()  # restarted empty
    b.wait_ready()
    st = cli("fleet", "status", "--json")
    assert st.exit_code == 4
    assert {"instance": "b", "adapter": "chat", "state": "missing"}.items() <= next(
        r for r in json.loads(st.output) if r["instance"] == "b"
    ).items()
    res = cli("fleet", "sync")
    assert res.exit_code == 0, res.output
    assert roots(b)["chat"] == vpath(fleet, v1)
    assert cli("fleet", "sync").output.count("loaded") == 0  # idempotent: nothing to do
    assert cli("fleet", "status").exit_code == 0
    res = publish(v3)  # with the fleet healthy again the publish goes through
    assert res.exit_code == 0, res.output
    assert all(roots(s)["chat"] == vpath(fleet, v3) for s in (a, b))


def test_adapter_failing_validation_never_reaches_an_instance(fleet):
    bad = _register(fleet, "broken", seed=5, r=32, alpha=64)  # rank 32 > the fleet's max_lora_rank 16
    res = publish(bad, name="broken")
    assert res.exit_code == 1, res.output
    assert "validation verdict is 'fail'" in res.output
    for s in fleet.servers.values():
        assert not any(n.startswith("broken") for n in roots(s))
    assert not (fleet.cfg.volume.path / f"broken-v{bad}").exists()
    assert "broken" not in json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text())["adapters"]


def test_prune_removes_old_versions_but_not_the_served_one(fleet, chat):
    v1, v3 = chat[0], chat[2]
    assert publish(v1).exit_code == 0 and publish(v3).exit_code == 0
    res = cli("fleet", "prune", "chat", "--keep", "1")
    assert res.exit_code == 0, res.output
    assert f"removed {vpath(fleet, v1)}" in res.output
    assert (fleet.cfg.volume.path / f"chat-v{v3}").is_dir() and not (
        fleet.cfg.volume.path / f"chat-v{v1}"
    ).exists()
    for s in fleet.servers.values():
        r = roots(s)
        assert r["chat"] == vpath(fleet, v3) and f"chat-v{v1}" not in r
    res = cli("rollback", "chat", "--to", str(v1))
    assert res.exit_code == 2 and "pruned" in res.output
