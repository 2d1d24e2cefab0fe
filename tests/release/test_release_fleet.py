"""The release transaction with a real vLLM CPU instance: a crash after the rollout is completed (or undone)
by the next command, and a tampered version is never loaded by `fleet sync` (issue 16 sections 1 and 4).

One instance (the serving behaviour under load is tests/fleet/test_fleet_vllm.py's): ~60 s start-up.
Run under the shared lock: `flock /tmp/heavy-tests.lock pytest -m fleet tests/release/test_release_fleet.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.fleet.state import load_state
from pipeline.release.publish import publish
from pipeline.release.rollback import rollback
from tests.support.fleet_server import VllmServer, fleet_env_available
from tests.support.helpers import peft_adapter
from tests.support.release_support import Killed, crash_at, new_project

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.skipif(not fleet_env_available(), reason=".fleet-venv missing: run `make fleet-env`"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_base):
    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.manifest import MANIFEST, file_hashes
    from pipeline.validate import FleetRules, validate_adapter

    root = tmp_path_factory.mktemp("release-fleet")
    server = VllmServer(tiny_base, root, "a").start()
    try:
        volume = (root / "volume").resolve()
        cfg = new_project(
            root / "p",
            volume={"path": str(volume)},
            served={"model": str(Path(tiny_base).resolve())},
            fleet={
                "instances": [{"name": "a", "url": server.url}],
                "volume_mount": str(volume),
                "timeout_s": 60,
            },
        )
        for seed in (21, 22, 23):  # while the instance boots
            d = peft_adapter(tiny_base, root / f"src-{seed}", seed=seed)
            write_json_atomic(
                d / MANIFEST,
                {"schema": 1, "name": "chat", "files": file_hashes(d), "base_model": {"id": str(tiny_base)}},
            )
            rep = validate_adapter(d, tiny_base, FleetRules()).to_dict()
            registry.register_adapter(cfg, d, "chat", rep)
        server.wait_ready()
        yield cfg, server
    finally:
        server.stop()


def served_root(server, name="chat"):
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c["root"] for c in data if c.get("parent")}.get(name)


def vdir(cfg, v):
    return str(cfg.volume.path / f"chat-v{v}")


def cli(cfg, *args):
    from pipeline.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


def test_crash_after_the_rollout_is_completed_by_the_rerun(fleet):
    cfg, server = fleet
    publish(cfg, "chat", version=1)
    with crash_at("after-fleet"), pytest.raises(Killed):
        publish(cfg, "chat", version=2)  # the instance switched; aliases never moved
    assert served_root(server) == vdir(cfg, 2) and registry.alias_version(cfg, "chat", "production") == 1
    st = cli(cfg, "fleet", "status", "--json")
    assert st.exit_code == 4 and any(r["state"] == "drift" for r in json.loads(st.stdout))
    res = publish(cfg, "chat", version=2)
    assert res.previous_production == 1 and res.instances == ["a"]
    assert (
        registry.alias_version(cfg, "chat", "production") == load_state(cfg.volume.path).version("chat") == 2
    )
    assert cli(cfg, "fleet", "status").exit_code == 0


def test_crash_after_the_rollout_then_rollback_puts_the_instance_back(fleet):
    cfg, server = fleet
    assert registry.alias_version(cfg, "chat", "production") == 2
    with crash_at("after-fleet"), pytest.raises(Killed):
        publish(cfg, "chat", version=3)
    assert served_root(server) == vdir(cfg, 3)
    res = rollback(cfg, "chat")  # undoes the half-done publish of v3, then 2 -> 1
    assert res[:2] == (2, 1) and "undone" in res.notes[0]
    assert served_root(server) == vdir(cfg, 1)
    assert (
        registry.alias_version(cfg, "chat", "production") == load_state(cfg.volume.path).version("chat") == 1
    )


def test_tampered_version_is_never_loaded_by_sync(fleet):
    """Issue 16: after an instance restart, `fleet sync` loaded a version with a byte flipped."""
    from pipeline.fleet.client import InstanceClient

    cfg, server = fleet
    assert load_state(cfg.volume.path).version("chat") == 1
    f = Path(vdir(cfg, 1)) / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.chmod(0o644)
    f.write_bytes(bytes(data))
    with InstanceClient(cfg.fleet.instances[0], 60) as c:  # as after a restart: the instance lost it
        for n in list(c.adapters()):
            c.unload(n)
    r = cli(cfg, "fleet", "sync")
    assert r.exit_code == 4 and "fails its manifest" in r.output, r.output
    assert served_root(server) is None  # never told to load the tampered weights
    st = cli(cfg, "fleet", "status", "--json")
    rows = json.loads(st.stdout)
    assert st.exit_code == 4 and any(x["state"] == "corrupt" and x["adapter"] == "chat" for x in rows)
