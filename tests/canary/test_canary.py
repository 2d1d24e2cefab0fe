"""`pipeline canary` against ONE real vLLM CPU staging instance (started once for the module).

Base: a tiny random-weight **Qwen3** (not the project's Qwen3.5), served in **float32** with
ngram speculative decoding, because on this vLLM CPU build
- Qwen3.5's Gated DeltaNet kernel refuses float32 ("CPU GDN attention requires BF16"), and
- in bf16, Qwen3.5 + ngram + LoRA drifts from PEFT (measured: a good adapter agreed on 99/128
  tokens with max logprob diff 0.92 nats, the base on 111/128 with 0.17), which would make this
  test about bf16 kernels, not about the canary. Qwen3 in float32 matches PEFT exactly (base and
  adapter: 128/128 tokens, logprob diff 0.0), with speculative decoding on.
The instance runs with `--lora-target-modules q_proj k_proj v_proj o_proj` and `--max-num-seqs 1`.
Adapters: `tests.support.helpers.peft_adapter` with lora_B ~ N(0, 0.3), so the adapter clearly changes output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.support import prestart
from tests.support.fleet_server import VllmServer, fleet_env_available, fleet_vllm_version
from tests.support.helpers import REPO, peft_adapter, write_project_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.skipif(not fleet_env_available(), reason=".fleet-venv missing: run `make fleet-env`"),
]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the staging instance's --lora-target-modules
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
VALIDATION = REPO / "datasets" / "agent_chat_validation.jsonl"


def tiny_qwen3(out: Path) -> Path:
    """A tiny random Qwen3 (hidden 128, 4 layers, vocab 1,024) with the project's tokenizer and template, bf16."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.dev.tinybase import build_tokenizer

    out.mkdir(parents=True)
    tok = build_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def with_manifest(d: Path, base: Path) -> Path:
    from pipeline.artifacts.manifest import AdapterManifest, BaseModelRef, file_hashes, write_manifest

    write_manifest(
        d, AdapterManifest(name=d.name, files=file_hashes(d), base_model=BaseModelRef(id=str(base)))
    )
    return d


def _staging_instance(root: Path, factory) -> list[VllmServer]:
    """The staging instance on a tiny Qwen3 built under `root` (started early: tests/support/prestart.py)."""
    extra = ["--dtype", "float32", "--max-model-len", "2048", "--speculative-config", json.dumps(SPEC)]
    return [
        VllmServer(
            tiny_qwen3(root / "base"), root, "staging", extra_args=[*extra, "--lora-target-modules", *TARGETS]
        )
    ]


prestart.plan("canary", __file__, _staging_instance)


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
    """The staging instance, three adapters (good, r mismatch, outside the targets) and a project."""
    from pipeline.config import load_config

    root, (server,) = prestart.take("canary", tmp_path_factory)
    base = Path(server.model)
    try:
        ns = type("Staging", (), {})()
        ns.server, ns.base, ns.root = server, base, root
        ns.good = peft_adapter(base, root / "good", targets=TARGETS, seed=1, b_std=0.3)
        ns.rank = Path(shutil.copytree(ns.good, root / "rank-mismatch"))
        acfg = json.loads((ns.rank / "adapter_config.json").read_text())
        (ns.rank / "adapter_config.json").write_text(json.dumps({**acfg, "r": 16}))  # tensors keep rank 8
        ns.outside = peft_adapter(
            base, root / "outside", targets=["gate_proj", "up_proj", "down_proj"], seed=2, b_std=0.3
        )
        cfg_path = write_project_config(
            root,
            served={"model": str(base), "checkpoint": "tiny-qwen3", "revision": "r1"},
            # the staging engine's own version: its --lora-target-modules rule (PEFT names, 0.20+) is the one applied
            fleet={"lora_target_modules": TARGETS, "vllm_version": fleet_vllm_version()},
            canary={"staging_url": server.url, "prompts": 5, "max_tokens": 12},
        )
        ns.cfg_path, ns.cfg = cfg_path, load_config(cfg_path)
        server.wait_ready()
        yield ns
    finally:
        server.stop()


def served_adapters(server) -> list[str]:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return [c["id"] for c in data if c.get("parent")]


def canary(staging, adapter: Path):
    from pipeline.canary import run_canary

    return run_canary(staging.cfg, adapter, staging.base, validation_files=[VALIDATION])


def test_good_adapter_passes_parity_and_reads_spec_decode(staging):
    res = canary(staging, staging.good)
    assert res.verdict == "pass", res.problems
    for k in ("base", "adapter"):
        p, s = res.parity[k], res.speed[k]
        assert p.agreement == 1.0 and p.first_divergence is None and p.max_logprob_diff < 1e-3, (k, p)
        assert p.positions == 12 * len(res.prompts)
        assert s.drafts > 0 and s.draft_tokens >= s.drafts and 0 <= s.accepted_tokens <= s.draft_tokens, (
            k,
            s,
        )
        assert 1.0 <= s.mean_acceptance_length <= 1 + SPEC["num_speculative_tokens"]
        assert s.tpot_s > 0 and s.output_tokens == 12 * len(res.prompts) and not s.other_traffic
    assert res.speed_ratio > 0 and res.acceptance_ratio > 0
    for k in ("base", "adapter"):  # ngram k=3: three draft positions, acceptance falling with depth
        per_pos = res.speed[k].acceptance_per_position
        assert len(per_pos) == 3 and all(0 <= x <= 1 for x in per_pos), per_pos
        assert sum(per_pos) == pytest.approx(res.speed[k].accepted_tokens / res.speed[k].drafts)
    # the adapter's teacher-forced shift is the same on the exact (float32) engine as with PEFT
    e = res.effect
    assert e.positions == 12 * len(res.prompts) and e.reference_nats > 0.5
    assert e.retention == pytest.approx(1.0, abs=0.01) and e.correlation > 0.99 and e.base_gap_nats < 1e-3
    assert not res.engine_adapter_equals_base
    assert {"tool:ask", "tool:sql", "tool:result"} <= set(res.prompts)
    assert any(p.startswith("agent_chat_validation.jsonl:") for p in res.prompts)
    assert res.served["engine_model"] == str(staging.base) and res.served["vllm_version"] == "0.32.0"
    assert res.served["checkpoint"] == "tiny-qwen3" and res.served["quantized"] is False
    assert res.unloaded and served_adapters(staging.server) == []


def test_config_rank_disagreeing_with_tensors_fails_parity(staging):
    res = canary(staging, staging.rank)
    assert res.verdict == "fail"
    assert res.parity["base"].agreement == 1.0  # the engine is fine: the adapter is the problem
    assert res.parity["adapter"].agreement < 0.95
    msg = res.problems[0]
    assert "adapter parity failed" in msg and "declares r=16 but the tensors have rank 8" in msg
    assert "fix r in adapter_config.json" in msg


def test_modules_outside_lora_target_modules_are_served_as_base(staging):
    res = canary(staging, staging.outside)
    assert res.verdict == "fail" and res.engine_adapter_equals_base
    # the adapter's own continuation gains with PEFT, and nothing on the engine that serves it as the base
    assert res.effect.reference_nats > 0.5 and res.effect.engine_nats == 0.0 and res.effect.retention == 0.0
    msg = res.problems[0]
    assert (
        "serves the adapter as the base" in msg
        and "--lora-target-modules (down_proj, gate_proj, up_proj)" in msg
    )


def test_adapter_is_unloaded_when_the_canary_breaks(staging, monkeypatch):
    from pipeline.canary import engine

    real, seen = engine._pass, {}

    def failing(client, model, *a, **kw):
        if model.startswith("canary-"):  # fault injection: the adapter pass dies mid-canary
            seen["loaded"] = served_adapters(staging.server)
            raise RuntimeError("injected failure")
        return real(client, model, *a, **kw)

    monkeypatch.setattr(engine, "_pass", failing)
    with pytest.raises(RuntimeError, match="injected"):
        canary(staging, staging.good)
    assert len(seen["loaded"]) == 1 and seen["loaded"][0].startswith("canary-")
    assert served_adapters(staging.server) == []


def cli(*args):
    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def register(staging, d: Path, name: str, i: int) -> int:
    from pipeline.registry import register_adapter
    from pipeline.validate import FleetRules, validate_adapter

    d = with_manifest(Path(shutil.copytree(d, staging.root / f"reg-{name}-{i}")), staging.base)
    # no fleet profile: `outside` is registered although validate against the fleet refuses it
    # (keys.fleet_targets), so that the canary's own detection of it is what is tested
    rep = validate_adapter(d, staging.base, FleetRules())
    assert rep.passed, rep.to_dict()
    return register_adapter(staging.cfg, d, name, rep.to_dict()).version


def test_cli_records_on_the_version_status_shows_it_and_publish_gates(staging, monkeypatch):
    from pipeline import registry

    monkeypatch.setenv("PIPELINE_CONFIG", str(staging.cfg_path))
    adapters = (staging.good, staging.outside, staging.good)
    good, outside, untested = (register(staging, d, "agent", i) for i, d in enumerate(adapters))

    r = cli("canary", "agent", "--version", str(good), "--validation", str(VALIDATION), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{") :])
    assert out["verdict"] == "pass" and out["served"]["checkpoint"] == "tiny-qwen3"
    tags = registry.resolve_version(staging.cfg, "agent", good).tags
    assert tags["canary.verdict"] == "pass" and tags["canary.checkpoint"] == "tiny-qwen3@r1"
    assert tags["canary.token_agreement"] == "1.0" and float(tags["canary.acceptance_length"]) >= 1
    assert float(tags["canary.speed_ratio"]) > 0 and tags["canary.engine_model"] == str(staging.base)
    assert tags["canary.weights_sha256"] == tags["validation.weights_sha256"]
    assert json.loads(tags["canary.report"])["verdict"] == "pass"

    r = cli("canary", "agent", "--version", str(outside), "--validation", str(VALIDATION))
    assert r.exit_code == 1 and "serves the adapter as the base" in " ".join(r.output.split()), r.output

    r = cli("status", "agent", "--json")
    rows = {v["version"]: v for v in json.loads(r.output)["models"][0]["versions"]}
    assert rows[good]["canary"]["verdict"] == "pass" and rows[outside]["canary"]["verdict"] == "fail"
    assert rows[untested]["canary"] is None
    assert "CANARY" in cli("status", "agent").output.splitlines()[0]  # the column (cli/render.py headers)

    # the gate: a failed canary always blocks; a missing one blocks when required
    r = cli("publish", "agent", "--version", str(outside))
    assert r.exit_code == 1 and "canary failed" in r.output
    monkeypatch.setenv("PIPELINE_CANARY__REQUIRED", "true")
    r = cli("publish", "agent", "--version", str(untested))
    assert r.exit_code == 1 and "no canary recorded" in r.output
    monkeypatch.setenv("PIPELINE_SERVED__REVISION", "r2")  # the fleet profile moved on since the canary
    r = cli("publish", "agent", "--version", str(good))
    assert r.exit_code == 0, r.output
    assert "measured served checkpoint tiny-qwen3@r1" in r.output and "tiny-qwen3@r2" in r.output
    assert not (staging.cfg.volume.path / f"agent-v{outside}").exists()
