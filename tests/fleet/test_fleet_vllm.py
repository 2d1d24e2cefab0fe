"""Publish, kill/restart, hang/resume, sync, rollback and the swap strategy against two REAL vLLM CPU
instances on 127.0.0.1.

Base: the tiny Qwen3.5 hybrid from `pipeline.dev.tinybase` (hidden 128, 4 heads of 64, linear head
dims 128: vLLM's CPU build serves it). Adapters: random PEFT LoRAs (`tests/helpers.peft_adapter`)
registered in a real sqlite MLflow, published through `pipeline publish`. The instances see the
volume at its real path (volume_mount = volume path), each on its own core (`cpu_fleet_env`;
docs/fleet.md "A CPU test fleet"). Both instances start once per module, in parallel (~40-80 s on
2 busy cores); one restart in the kill test. The CPU build is vLLM 0.32: the `auto` swap strategy
is `versioned` there (sticky load_inplace), so clients request the name `pipeline fleet resolve`
gives (`chat-vN`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.fleet.client import InstanceClient
from tests.support import prestart
from tests.support.fleet_server import VllmServer, cpu_fleet_env, fleet_env_available, fleet_vllm_version
from tests.support.helpers import peft_adapter, tiny_base_dir, write_project_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.skipif(not fleet_env_available(), reason=".fleet-venv missing: run `make fleet-env`"),
]

PROMPT = "The quick brown fox"


def _instances(root: Path, factory) -> list[VllmServer]:
    """Instances a and b of the tiny base, each on its own core (started early: tests/support/prestart.py)."""
    return [VllmServer(tiny_base_dir(factory), root, n, **cpu_fleet_env(i)) for i, n in enumerate("ab")]


prestart.plan("fleet", __file__, _instances)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_base):
    """Two running instances + a project whose fleet section points at them; yields a namespace."""
    from pipeline.config import load_config

    root, servers = prestart.take("fleet", tmp_path_factory)
    volume = (root / "volume").resolve()
    cfg_path = write_project_config(
        root,
        served={"model": str(Path(tiny_base).resolve())},
        fleet={
            "vllm_version": fleet_vllm_version(),
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
        ns.chat = [_register(ns, "chat", seed) for seed in (11, 12, 13, 14, 15)]
        ns.swap = [_register(ns, "swap", seed) for seed in (21, 22)]
        for s in servers:
            s.wait_ready()
        yield ns
    finally:
        mp.undo()
        for s in servers:
            s.stop()


def _register(fleet, name: str, seed: int, **kw) -> int:
    """A PEFT adapter with a manifest, validated and registered; returns its version number."""
    from pipeline.artifacts.manifest import AdapterManifest, BaseModelRef, file_hashes, write_manifest
    from pipeline.registry import register_adapter
    from pipeline.validate import FleetRules, validate_adapter

    d = peft_adapter(fleet.base, fleet.root / f"src-{name}-{seed}", seed=seed, **kw)
    write_manifest(
        d, AdapterManifest(name=name, files=file_hashes(d), base_model=BaseModelRef(id=str(fleet.base)))
    )
    rep = validate_adapter(d, fleet.base, FleetRules()).to_dict()
    return register_adapter(fleet.cfg, d, name, rep).version


@pytest.fixture(scope="module")
def chat(fleet):
    """Five registered versions of adapter `chat` (the last two are never loaded before the hang tests)."""
    return fleet.chat


def cli(*args):
    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def publish(version: int, name: str = "chat"):
    return cli("publish", name, "--version", str(version))


def roots(server) -> dict:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c["root"] for c in data if c.get("parent")}


def complete(server, model: str, prompt: str = PROMPT) -> str:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def vpath(fleet, version: int, name: str = "chat") -> str:
    return str(fleet.cfg.volume.path / f"{name}-v{version}")


def resolved(fleet, name: str = "chat") -> str:
    """The model id a client sends now (what `pipeline fleet resolve NAME` prints)."""
    from pipeline.config import load_config
    from pipeline.fleet.modes import resolve_served_name

    return resolve_served_name(load_config(), name)


def desired(fleet, name: str = "chat") -> int:
    return json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text())["adapters"][name]["version"]


def marks(fleet) -> dict:
    return json.loads((fleet.cfg.volume.path / "fleet-state.json").read_text()).get("instances", {})


def production(fleet, name: str = "chat") -> int:
    from pipeline.registry import mlflow_for

    return int(mlflow_for(fleet.cfg).MlflowClient().get_model_version_by_alias(name, "production").version)


class Stream:
    """One client thread per instance sending greedy requests back to back, each to the model id the
    pipeline's resolver gives at that moment (as a client of the versioned swap does)."""

    def __init__(self, fleet, servers, name="chat"):
        self.results = []  # (instance, t_start, ok, model, text or error)
        self.stop = threading.Event()
        self.fleet = fleet
        self.threads = [threading.Thread(target=self._run, args=(s, name), daemon=True) for s in servers]

    def _run(self, server, name):
        while not self.stop.is_set():
            t0 = time.monotonic()
            model = resolved(self.fleet, name)
            try:
                self.results.append((server.name, t0, True, model, complete(server, model)))
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.results.append((server.name, t0, False, model, repr(e)))

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
    assert resolved(fleet) == f"chat-v{v1}"
    with Stream(fleet, [a, b]) as stream:
        time.sleep(1.0)
        res = publish(v2)
        t_done = time.monotonic()
        assert res.exit_code == 0, res.output
        while sum(1 for r in stream.results if r[1] > t_done) < 4:  # a few requests after the switch
            time.sleep(0.2)
    expect = {}
    for s in (a, b):
        assert roots(s)[f"chat-v{v2}"] == vpath(fleet, v2)
        assert roots(s)[f"chat-v{v1}"] == vpath(fleet, v1)  # kept (keep_versions=2): its clients keep working
        assert "chat" not in roots(s)  # the versioned swap never serves a re-pointed stable name
        expect[s.name] = complete(s, f"chat-v{v2}")
        assert complete(s, f"chat-v{v1}") != expect[s.name], "v1 and v2 must be distinguishable by output"
    failures = [r for r in stream.results if not r[2]]
    assert failures == []
    after = [r for r in stream.results if r[1] > t_done]
    assert after and all(m == f"chat-v{v2}" and text == expect[inst] for inst, _, _, m, text in after), after
    assert desired(fleet) == v2 and production(fleet) == v2
    assert cli("fleet", "resolve", "chat").output.strip() == f"chat-v{v2}"
    st = cli("fleet", "status", "--json")
    assert st.exit_code == 0, st.output
    assert {
        (r["instance"], r["state"], r["serving"], r["vllm"])
        for r in json.loads(st.output)
        if r["adapter"] == "chat"
    } == {("a", "ok", f"v{v2}", fleet_vllm_version()), ("b", "ok", f"v{v2}", fleet_vllm_version())}


def test_rollback_restores_previous_version_on_both(fleet, chat):
    v1, v2 = chat[0], chat[1]
    assert publish(v1).exit_code == 0 and publish(v2).exit_code == 0
    res = cli("rollback", "chat")
    assert res.exit_code == 0, res.output
    assert resolved(fleet) == f"chat-v{v1}"
    for s in fleet.servers.values():
        assert roots(s)[f"chat-v{v1}"] == vpath(fleet, v1)
    assert production(fleet) == v1 and desired(fleet) == v1


def test_killed_instance_stops_publish_before_any_change_then_sync_converges(fleet, chat):
    v1, v3 = chat[0], chat[2]
    assert publish(v1).exit_code == 0
    a, b = fleet.servers["a"], fleet.servers["b"]
    b.stop()
    res = publish(v3)
    assert res.exit_code == 4, res.output
    assert "b (http" in res.output and "UNREACHABLE" in res.output  # per-instance report
    assert "nothing was changed" in res.output and "pipeline fleet sync" in res.output
    assert f"chat-v{v3}" not in roots(a)  # the preflight stopped it: a was never touched
    assert not (fleet.cfg.volume.path / f"chat-v{v3}").exists()  # nor the volume
    assert production(fleet) == v1 and desired(fleet) == v1

    b.start()  # restarted empty
    b.wait_ready()
    st = cli("fleet", "status", "--json")
    assert st.exit_code == 4
    assert {"instance": "b", "adapter": "chat", "state": "missing"}.items() <= next(
        r for r in json.loads(st.output) if r["instance"] == "b" and r["adapter"] == "chat"
    ).items()
    res = cli("fleet", "sync")
    assert res.exit_code == 0, res.output
    assert roots(b)[f"chat-v{v1}"] == vpath(fleet, v1)
    assert cli("fleet", "sync").output.count("loaded") == 0  # idempotent: nothing to do
    assert cli("fleet", "status").exit_code == 0
    res = publish(v3)  # with the fleet healthy again the publish goes through
    assert res.exit_code == 0, res.output
    assert all(roots(s)[f"chat-v{v3}"] == vpath(fleet, v3) for s in (a, b))


def _hang_b_at_its_load(fleet, monkeypatch):
    """SIGSTOP instance b right before it is sent a load: it accepts the request, answers nothing."""
    from pipeline.fleet.client import InstanceClient

    b = fleet.servers["b"]
    real = InstanceClient.load

    def load(self, name, path, inplace=False):
        if self.name == "b":
            b.pause()
        return real(self, name, path, inplace)

    monkeypatch.setattr(InstanceClient, "load", load)
    # the hang is detected when these run out: 5 s is over ten times what a request or a load of the
    # tiny adapter takes on these instances, so only b's pause can end there (each waited 10 s before)
    for k, v in {"TIMEOUT_S": "5", "LOAD_TIMEOUT_S": "5"}.items():
        monkeypatch.setenv(f"PIPELINE_FLEET__{k}", v)
    return b


def test_hung_instance_mid_rollout_is_undone_marked_unknown_then_synced(fleet, chat, monkeypatch):
    """Default all-or-nothing: b stops (SIGSTOP) while its load is in flight; the publish puts a back,
    marks b unknown, exits 4 saying what to run; after SIGCONT, `fleet sync` converges b."""
    v1, v2 = chat[0], chat[3]  # v2: loaded nowhere yet, so b is sent a load
    assert publish(v1).exit_code == 0
    a = fleet.servers["a"]
    b = _hang_b_at_its_load(fleet, monkeypatch)
    try:
        t0 = time.monotonic()
        res = publish(v2)
        took = time.monotonic() - t0
        assert res.exit_code == 4, res.output
        assert "b (http" in res.output and "HUNG (serving unknown)" in res.output, res.output
        assert "a (http" in res.output and "switched, then restored" in res.output, res.output
        assert "pipeline fleet sync" in res.output and "pipeline fleet status" in res.output
        assert took < 120, took  # bounded: the load timeout, not forever
        assert f"chat-v{v2}" not in roots(a) and resolved(fleet) == f"chat-v{v1}"
        assert desired(fleet) == v1 and production(fleet) == v1
        assert marks(fleet)["b"]["state"] == "unknown" and f"chat v{v2}" in marks(fleet)["b"]["reason"]
        st = cli("fleet", "status", "--json")
        assert st.exit_code == 4
        assert [r["state"] for r in json.loads(st.output) if r["instance"] == "b"] == ["hung"]
    finally:
        b.resume()
    monkeypatch.undo()
    time.sleep(3)  # the load queued in b's listen backlog is processed on SIGCONT (or not): either way
    print(f"late load landed on b after SIGCONT: {f'chat-v{v2}' in roots(b)}")  # sync must converge it
    st = cli("fleet", "status", "--json")  # answers again; still marked until verified
    assert st.exit_code == 4 and any(
        r["instance"] == "b" and r["state"] == "unknown" for r in json.loads(st.output)
    ), st.output
    res = cli("fleet", "sync")
    assert res.exit_code == 0, res.output
    assert "cleared the 'unknown' mark" in res.output
    assert roots(b)[f"chat-v{v1}"] == vpath(fleet, v1) and f"chat-v{v2}" not in roots(b)  # a late load undone
    assert "b" not in marks(fleet)
    assert cli("fleet", "status").exit_code == 0


def test_hung_instance_with_min_healthy_publishes_on_the_rest(fleet, chat, monkeypatch):
    """fleet.min_healthy=1: the publish completes on a while b hangs; b is marked behind and
    `fleet sync` brings it to the new version after SIGCONT."""
    v1, v3 = chat[0], chat[4]  # v3: loaded nowhere yet, so b is sent a load
    assert publish(v1).exit_code == 0
    a = fleet.servers["a"]
    b = _hang_b_at_its_load(fleet, monkeypatch)
    monkeypatch.setenv("PIPELINE_FLEET__MIN_HEALTHY", "1")
    try:
        res = publish(v3)
        assert res.exit_code == 0, res.output
        assert "serving on: a" in res.output and "published without this instance" in res.output
        assert roots(a)[f"chat-v{v3}"] == vpath(fleet, v3)
        assert desired(fleet) == v3 and production(fleet) == v3 and resolved(fleet) == f"chat-v{v3}"
        assert marks(fleet)["b"]["state"] == "unknown"
    finally:
        b.resume()
    monkeypatch.undo()
    res = cli("fleet", "sync")
    assert res.exit_code == 0, res.output
    assert roots(b)[f"chat-v{v3}"] == vpath(fleet, v3) and "b" not in marks(fleet)


def test_the_publish_canary_on_the_real_engine(fleet):
    """The per-instance canary's request (`ignore_eos`, token ids, log-probabilities) as this vLLM answers it:
    an adapter with all-zero lora_B has no effect, a trained-like one has (tests/fleet/test_modes.py: the
    H200's empty replies)."""
    from pipeline.fleet.client import InstanceError
    from pipeline.fleet.modes import canary

    zero = peft_adapter(fleet.base, fleet.root / "canary-zero-b", zero_b=True)
    with InstanceClient(fleet.cfg.fleet.instances[0], 60) as c:
        c.load("canary-zero", str(zero))
        c.load("canary-good", str(fleet.root / "src-chat-11"))
        try:
            with pytest.raises(InstanceError, match="no effect") as e:
                canary(c, fleet.cfg, "canary-zero")
            assert e.value.check == "fleet.canary_no_effect"
            canary(c, fleet.cfg, "canary-good")
        finally:
            c.unload("canary-zero")
            c.unload("canary-good")


def test_other_vllm_version_or_model_stops_publish_before_any_change(fleet, chat, monkeypatch):
    v2 = chat[1]
    before = desired(fleet)
    monkeypatch.setenv("PIPELINE_FLEET__VLLM_VERSION", "0.19.2rc1.dev123+gabcdef0")
    res = publish(v2)
    assert res.exit_code == 4, res.output
    assert (
        f"runs vLLM {fleet_vllm_version()}, but fleet.vllm_version is 0.19.2rc1.dev123+gabcdef0" in res.output
    )
    assert "a (http" in res.output and "b (http" in res.output and "nothing was changed" in res.output
    st = cli("fleet", "status", "--json")
    assert st.exit_code == 4 and {r["state"] for r in json.loads(st.output) if r["adapter"] is None} == {
        "mismatch"
    }
    monkeypatch.delenv("PIPELINE_FLEET__VLLM_VERSION")
    monkeypatch.setenv("PIPELINE_SERVED__SERVED_MODEL_NAME", "Qwen3.6-27b-NVFP4")
    res = publish(v2)
    assert res.exit_code == 4 and "fleet.model_mismatch" in res.output and "nothing was changed" in res.output
    assert desired(fleet) == before


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
        assert r[f"chat-v{v3}"] == vpath(fleet, v3) and f"chat-v{v1}" not in r
    res = cli("rollback", "chat", "--to", str(v1))
    assert res.exit_code == 2 and "pruned" in res.output


# -- stale KV: the same prompt before and after a swap ---------------------------------------------
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."  # 25 tokens


def prefix_hits(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(
        float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total")
    )


def hits_rose(server, before: float, wait_s: float = 5.0) -> bool:
    """Whether the prefix-cache hit counter rose above `before` (the API server records an engine
    step's stats after it answered: poll briefly)."""
    deadline = time.monotonic() + wait_s
    while prefix_hits(server) <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def kv_block_size(server) -> int:
    """The KV block size the engine chose (`vllm:cache_config_info`). For a hybrid model vLLM sizes
    attention blocks so that one holds a Gated-DeltaNet state page (640 tokens for the tiny Qwen3.5
    with a float32 SSM cache): only whole blocks are prefix-cached, so a shorter prompt never hits."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    return int(re.search(r'[{,]block_size="(\d+)"', line).group(1))


@pytest.fixture(scope="module")
def long_prompt(fleet) -> str:
    """A prompt of more than one KV block (and under --max-model-len), so a repeat hits the prefix cache."""
    block = kv_block_size(fleet.servers["a"])
    return " ".join([SENTENCE] * (block // 25 + 4))


@pytest.fixture(scope="module")
def fresh_v2(fleet, long_prompt) -> dict:
    """The reference per instance: v2's weights under a name and path never used before (no cached
    KV can match), answering long_prompt."""
    import shutil

    ref = fleet.root / "swap-reference-v2"
    shutil.copytree(fleet.root / "src-swap-22", ref)
    out = {}
    for s in fleet.servers.values():
        httpx.post(
            f"{s.url}/v1/load_lora_adapter",
            json={"lora_name": "swap-reference", "lora_path": str(ref)},
            timeout=60,
        ).raise_for_status()
        out[s.name] = complete(s, "swap-reference", long_prompt)
    return out


def test_naive_in_place_swap_serves_stale_kv(fleet, fresh_v2, long_prompt):
    """The defect the swap strategy exists for, reproduced on the real server: a stable name
    re-pointed in place while its prefix-cache key stays the same (on 0.19-0.25 the key is the name
    alone; on this 0.32 build it is name+path, so the same path stands in for it) answers a cached
    prompt with KV computed by the OLD weights."""
    import shutil

    a = fleet.servers["a"]
    d = fleet.root / "naive-stable"
    shutil.copytree(fleet.root / "src-swap-21", d)
    httpx.post(
        f"{a.url}/v1/load_lora_adapter", json={"lora_name": "naive", "lora_path": str(d)}, timeout=60
    ).raise_for_status()
    v1_out = complete(a, "naive", long_prompt)
    before = prefix_hits(a)
    assert complete(a, "naive", long_prompt) == v1_out  # second time from the prefix cache
    assert hits_rose(a, before), f"no prefix-cache hit (KV block {kv_block_size(a)} tokens)"
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(fleet.root / "src-swap-22" / f, d / f)
    httpx.post(
        f"{a.url}/v1/load_lora_adapter",
        json={"lora_name": "naive", "lora_path": str(d), "load_inplace": True},
        timeout=60,
    ).raise_for_status()
    hits = prefix_hits(a)
    after = complete(a, "naive", long_prompt)
    assert hits_rose(a, hits)  # the old KV was reused ...
    assert fresh_v2["a"] != v1_out
    assert after != fresh_v2["a"]  # ... so the answer does not reflect the new weights


def test_versioned_swap_answers_with_the_new_weights(fleet, fresh_v2, long_prompt):
    """The pipeline's strategy: same prompt, two versions, same stable name `swap` (resolved by the
    client): after the publish the answer equals v2's on a cold cache, on both instances."""
    s1, s2 = fleet.swap
    assert publish(s1, "swap").exit_code == 0
    for s in fleet.servers.values():
        name = resolved(fleet, "swap")
        complete(s, name, long_prompt)
        hits = prefix_hits(s)
        complete(s, name, long_prompt)  # warm the prefix cache with v1's KV
        assert hits_rose(s, hits)  # the cache does hit: a stale answer below would show
    res = publish(s2, "swap")
    assert res.exit_code == 0, res.output
    name = resolved(fleet, "swap")
    assert name == f"swap-v{s2}"
    for s in fleet.servers.values():
        assert complete(s, name, long_prompt) == fresh_v2[s.name]


# -- the release transaction on the same instances (issue 16 sections 1 and 4) ----------------------
# Last in the module: its own project (registry, volume) and adapter name `txn`, on instances a and b.
@pytest.fixture(scope="module")
def txn(fleet):
    from pipeline.artifacts.manifest import AdapterManifest, BaseModelRef, file_hashes, write_manifest
    from pipeline.validate import FleetRules, validate_adapter
    from tests.support.release_support import new_project

    with InstanceClient(fleet.cfg.fleet.instances[0], 60) as c:
        if "naive" in c.adapters():  # the naive-swap test's sticky in-place name: per-step reloads
            c.unload("naive")
    volume = (fleet.root / "txn-volume").resolve()
    cfg = new_project(
        fleet.root / "txn",
        volume={"path": str(volume)},
        served={"model": str(Path(fleet.base).resolve())},
        fleet={**fleet.cfg.fleet.model_dump(mode="json"), "volume_mount": str(volume)},
    )
    for seed in (21, 22, 23):
        d = peft_adapter(fleet.base, fleet.root / f"src-txn-{seed}", seed=seed)
        man = AdapterManifest(name="txn", files=file_hashes(d), base_model=BaseModelRef(id=str(fleet.base)))
        write_manifest(d, man)
        registry.register_adapter(cfg, d, "txn", validate_adapter(d, fleet.base, FleetRules()).to_dict())
    return cfg


def _txn_cli(cfg, *args):
    from pipeline.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


def _serves(fleet, cfg, version: int) -> bool:
    """Every instance has `txn-vN` loaded from its version directory."""
    want = str(cfg.volume.path / f"txn-v{version}")
    return all(roots(s).get(f"txn-v{version}") == want for s in fleet.servers.values())


def test_txn_crash_after_the_rollout_is_completed_by_the_rerun(fleet, txn):
    from pipeline.fleet.state import load_state
    from pipeline.release.publish import publish as do_publish
    from tests.support.release_support import Killed, crash_at

    cfg = txn
    do_publish(cfg, "txn", version=1)
    with crash_at("after-fleet"), pytest.raises(Killed):
        do_publish(cfg, "txn", version=2)  # the instances switched; aliases never moved
    assert _serves(fleet, cfg, 2) and registry.alias_version(cfg, "txn", "production") == 1
    st = _txn_cli(cfg, "fleet", "status", "--json")
    assert st.exit_code == 4 and any(r["state"] == "drift" for r in json.loads(st.stdout))
    res = do_publish(cfg, "txn", version=2)
    assert res.previous_production == 1 and sorted(res.instances) == ["a", "b"]
    assert registry.alias_version(cfg, "txn", "production") == load_state(cfg.volume.path).version("txn") == 2
    assert _txn_cli(cfg, "fleet", "status").exit_code == 0


def test_txn_crash_after_the_rollout_then_rollback_puts_the_instances_back(fleet, txn):
    from pipeline.fleet.modes import resolve_served_name
    from pipeline.fleet.state import load_state
    from pipeline.release.publish import publish as do_publish
    from pipeline.release.rollback import rollback
    from tests.support.release_support import Killed, crash_at

    cfg = txn
    assert registry.alias_version(cfg, "txn", "production") == 2
    with crash_at("after-fleet"), pytest.raises(Killed):
        do_publish(cfg, "txn", version=3)
    assert _serves(fleet, cfg, 3)
    res = rollback(cfg, "txn")  # undoes the half-done publish of v3, then 2 -> 1
    assert res[:2] == (2, 1) and "undone" in res.notes[0]
    assert _serves(fleet, cfg, 1) and resolve_served_name(cfg, "txn") == "txn-v1"
    assert all("txn-v3" not in roots(s) for s in fleet.servers.values())  # the undone version is unloaded
    assert registry.alias_version(cfg, "txn", "production") == load_state(cfg.volume.path).version("txn") == 1


def test_txn_tampered_version_is_never_loaded_by_sync(fleet, txn):
    """Issue 16: after an instance restart, `fleet sync` loaded a version with a byte flipped."""
    from pipeline.fleet.state import load_state

    cfg = txn
    assert load_state(cfg.volume.path).version("txn") == 1
    f = cfg.volume.path / "txn-v1" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.chmod(0o644)
    f.write_bytes(bytes(data))
    for inst in cfg.fleet.instances:  # as after a restart: the instances lost txn's versions
        with InstanceClient(inst, 60) as c:
            for n in [n for n in c.adapters() if n.startswith("txn")]:
                c.unload(n)
    r = _txn_cli(cfg, "fleet", "sync")
    assert r.exit_code == 4 and "fails its manifest" in r.output, r.output
    assert all("txn-v1" not in roots(s) for s in fleet.servers.values())  # never told to load it
    st = _txn_cli(cfg, "fleet", "status", "--json")
    rows = json.loads(st.stdout)
    assert st.exit_code == 4 and any(x["state"] == "corrupt" and x["adapter"] == "txn" for x in rows)


# -- the GPU benchmark's driver on these instances (issue 26: every benchmark's smoke mode runs here) ----------------
def test_vllm_h200_driver_smoke_on_the_cpu_fleet(fleet, tmp_path):
    """benchmarks/vllm_h200.py plan `smoke` attached to the module's two instances (no engine started, no
    training): the stages the H200 call runs, through the same `pipeline` CLI calls (validate --served,
    register v1/v2, canary --no-record, publish to both, decode table, publish v2 + rollback, the
    stale-KV probe), each recorded; a typo in the driver fails here instead of on the GPU."""
    import subprocess
    import sys

    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.manifest import MANIFEST, file_hashes
    from tests.support.helpers import REPO

    ads = []
    for seed in (31, 32):
        d = peft_adapter(fleet.base, tmp_path / f"ad-{seed}", seed=seed, b_std=0.3)
        write_json_atomic(
            d / MANIFEST,
            {"schema": 1, "name": "agent", "files": file_hashes(d), "base_model": {"id": str(fleet.base)}},
        )
        ads.append(str(d))
    a, b = fleet.servers["a"], fleet.servers["b"]
    cmd = [sys.executable, str(REPO / "benchmarks" / "vllm_h200.py"), "run", "smoke", "--work", str(tmp_path / "w"),
           "--out", str(tmp_path / "o"), "--attach", f"fleet-a={a.url}", f"fleet-b={b.url}", "--adapters", *ads]  # fmt: skip
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO))
    )
    rec = json.loads((tmp_path / "o" / "vllm_h200.json").read_text())
    assert p.returncode == 0 and rec["failed"] == [], (rec["stages"], p.stdout[-3000:])
    assert sorted(rec["publish"]["confirmed_by"]) == ["fleet-a", "fleet-b"]
    assert all(rec["publish"]["instances_list_the_version"].values())
    assert rec["canary_bf16_base"]["token_agreement"] is not None and rec["decode_tok_s"]["adapter"]["1"] > 0
    rel = rec["release"]
    assert (
        rel["publish_v2"]["resolved"]["model"] == "agent-v2"
        and rel["rollback"]["resolved_after"]["model"] == "agent-v1"
    ), rel
    kv = rec["stale_kv"]
    assert kv["v1_differs_from_v2"] and kv["versioned_v2_equals_fresh_v2"] and kv["warm_hit_tokens"] > 0
    # 0.32 keys the prefix cache by (name, path): a re-point at a NEW path is not stale there (0.25 is)
    assert kv["repoint_answer_equals_fresh_v2"] and not kv["stale_kv_served"]
    for inst in (a, b):  # the probe names are gone; the published versions stay
        assert not [n for n in roots(inst) if n.startswith("stale-")]


# -- benchmarks/publish_latency.py's smoke: its measurement on these instances (no start of its own) -----------
def test_publish_latency_benchmark_measures_one_publish(fleet):
    """Issue 26: the benchmark patched `publish.rollout`, which had moved, and nobody noticed. Its
    `measure` runs here on the module's instances, so a refactor that breaks it fails the suite."""
    import sys

    from tests.support.helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import publish_latency

    res = publish_latency.measure(fleet.cfg, list(fleet.servers.values()), fleet.base, fleet.root, repeats=1)
    assert res.ok, (res.failures, res.requests_failed)
    assert len(res.serving) == len(res.total) == len(res.base_load) == 1 and res.requests_ok > 0
    assert 0 < res.before_rollout[0] < res.total[0] and 0 < res.in_rollout[0] < res.total[0]
    text = publish_latency.table(res, "smoke")
    assert "whole publish() call" in text and "failed publishes / loads: 0" in text


# -- benchmarks/mtp_acceptance.py's engine half on these instances (its distillation and graft: test_mtp_distill) --
def test_mtp_acceptance_measure_on_instances_that_draft_nothing(fleet):
    """Issue 26: every benchmark's smoke runs in the suite. mtp_acceptance's own smoke starts a CPU engine with
    qwen3_5_mtp (~85 s); its `measure` (greedy requests, /metrics deltas, token agreement) and `table` run
    here on an instance without a drafter: no drafts counted, no acceptance invented, and the tokens agree
    with the same engine's greedy continuations."""
    import sys

    from tests.support.helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import mtp_acceptance

    a = fleet.servers["a"]
    model = str(Path(fleet.base).resolve())
    prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]
    cont = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        toks = httpx.post(f"{a.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        cont.append([int(t.split(":", 1)[1]) for t in toks["tokens"]])
    m = mtp_acceptance.measure(a.url, model, prompts, cont, 4)
    assert m["drafts"] == 0 and m["accepted"] == 0 and m["acceptance_length"] is None, m
    assert m["target_token_agreement"] == 1.0, (m, cont)
    est = {"acceptance": [0.5, 0.25, 0.125], "acceptance_length": 1.875}
    text = mtp_acceptance.table({"distill": {"random": est, "ridge": est, "kept": "trained", "expected": est},
                                 "served": {"fleet-a": m}})  # fmt: skip
    assert "| vLLM: fleet-a | - | - | - | - |" in text and "| estimate: kept (trained) | 0.500" in text
