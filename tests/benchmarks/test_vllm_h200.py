"""benchmarks/vllm_h200.py and benchmarks/mtp_distill.py without a GPU: engine command lines, the stage
runner, the "Done when" check, and the MTP self-distillation on the tiny VL base (CPU, seconds).

The whole driver runs against real vLLM CPU instances in tests/fleet/test_fleet_vllm.py (smoke plan).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import mtp_distill  # noqa: E402
import vllm_h200 as vb  # noqa: E402


def test_fleet_engines_get_the_fleets_flags(tmp_path):
    argvs = vb.engine_argvs("main", tmp_path)
    for name in ("fleet-a", "fleet-b", "merged"):
        a = argvs[name]
        flag = {a[i]: a[i + 1] for i in range(1, len(a) - 1) if a[i].startswith("--")}
        assert flag["--quantization"] == "modelopt" and "--language-model-only" in a and "--enable-lora" in a
        assert flag["--max-lora-rank"] == "16" and flag["--kv-cache-dtype"] == "fp8"
        assert json.loads(flag["--speculative-config"]) == {
            "method": "qwen3_5_mtp",
            "num_speculative_tokens": 3,
        }
        assert "--enable-prefix-caching" in a and "--enable-chunked-prefill" in a
        assert int(flag["--kv-cache-memory-bytes"]) > 0 and float(flag["--gpu-memory-utilization"]) <= 0.2
        assert "--enforce-eager" not in a  # CUDA graphs on, as the fleet serves
    assert argvs["fleet-a"][0].endswith("real8-nvfp4") and argvs["staging"][0].endswith("real8")
    st = argvs["staging"]
    # the parity engine: unquantized bf16 (vLLM 0.25.1's FLA GDN kernel refuses float32: measured on the H200)
    assert st[st.index("--dtype") + 1] == "bfloat16" and "--quantization" not in st
    bf = argvs["staging-bf16"]
    assert "--quantization" not in bf and "--kv-cache-dtype" in bf
    sweep = vb.engine_argvs("sweep", tmp_path)
    assert sweep["rank64"][sweep["rank64"].index("--max-lora-rank") + 1] == "64"
    assert json.loads(sweep["graphs-off"][sweep["graphs-off"].index("--compilation-config") + 1]) == {
        "cudagraph_mode": "NONE"
    }
    assert sweep["loras4"][sweep["loras4"].index("--max-loras") + 1] == "4"


@pytest.mark.skipif(
    not os.environ.get("VLLM025_PYTHON"), reason="set VLLM025_PYTHON to a Python with vllm 0.25.x"
)
def test_engine_argvs_parse_with_vllm_025(tmp_path):
    """Each command line through vLLM 0.25's own `vllm serve` parser (caught `--disable-log-requests`,
    which 0.25.1 no longer has)."""
    for plan in ("main", "sweep"):
        res = vb.check_argvs(os.environ["VLLM025_PYTHON"], vb.engine_argvs(plan, tmp_path))
        assert res.pop("vllm").startswith("0.25.") and set(res.values()) == {"ok"}, res


def test_runner_records_every_stage_skips_by_deadline_and_dependency(tmp_path):
    ctx = vb.Ctx("main", tmp_path / "w", tmp_path / "o", deadline_s=30, gpu=True)
    calls = []

    def ok(ctx):
        calls.append("host")
        return {"plan": "main"}

    def boom(ctx):
        raise RuntimeError("engine exited 1")

    plan = [("host", ok, 1), ("base", boom, 1), ("mtp", ok, 1), ("launch", ok, 3600)]
    rec = vb.run(ctx, plan)
    stages = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "o" / "stages").glob("*.json")}
    assert set(stages) == {"host", "base", "mtp", "launch"} and calls == ["host"]
    assert stages["host"]["ok"] and stages["base"]["error"] == "RuntimeError: engine exited 1"
    assert stages["mtp"]["skipped"] == "needs base" and stages["launch"]["skipped"].startswith("needs base")
    assert rec["failed"] == ["base", "launch", "mtp"] and rec["done_when"]["mtp_3"]
    assert json.loads((tmp_path / "o" / "vllm_h200.json").read_text())["stages"]["base"]["ok"] is False
    ctx2 = vb.Ctx("main", tmp_path / "w2", tmp_path / "o2", deadline_s=30, gpu=True)
    assert vb.run(ctx2, [("host", ok, 3600)])["stages"]["host"]["skipped"].startswith("deadline")


def test_done_when_reads_the_record():
    rec = {
        "vllm_version": "0.25.1",
        "quantization": {"method": "modelopt", "quant_algo": "NVFP4"},
        "speculative": {"method": "qwen3_5_mtp", "num_speculative_tokens": 3},
        "instances": 2,
        "publish": {"confirmed_by": ["fleet-b", "fleet-a"]},
        "canary_bf16_base": {"token_agreement": 0.995},
        "acceptance_length": {"base": {"1": 2.9}, "adapter": {"1": 1.7}},
        "decode_tok_s": {"base": {"1": 400.0}, "adapter": {"1": 250.0}},
    }
    assert all(vb.done_when(rec).values())
    rec["canary_bf16_base"]["token_agreement"] = 0.98
    rec["publish"]["confirmed_by"] = ["fleet-a"]
    rec["acceptance_length"] = {"base": {"1": None}, "adapter": {"1": None}}  # an engine without speculation
    bad = vb.done_when(rec)
    assert not bad["canary_agreement_0.99"] and not bad["publish_confirmed_by_both"]
    assert not bad["acceptance_base_and_adapter"] and bad["decode_base_and_adapter"]


def test_record_into_replaces_the_same_day_and_plan(tmp_path):
    (tmp_path / "vllm_h200.json").write_text(
        json.dumps({"date": "2026-12-01", "plan": "main", "done_when": {"x": True}})
    )
    into = tmp_path / "results.json"
    into.write_text(
        json.dumps(
            {
                "records": [
                    {"date": "2026-12-01", "plan": "main", "old": 1},
                    {"date": "2026-11-30", "plan": "main"},
                ]
            }
        )
    )
    assert vb.record_into(tmp_path, into) == {"x": True}
    recs = json.loads(into.read_text())["records"]
    assert [r["date"] for r in recs] == ["2026-11-30", "2026-12-01"] and "old" not in recs[1]


def test_stale_kv_probe_is_inconclusive_when_its_control_differs_in_tokens():
    """The 2026-12-02 H200 record: cold vs warm of the same adapter differed in tokens, the tolerance
    became infinite and every verdict came out as if measured."""
    inf = float("inf")
    gaps = {"v1_vs_v2": inf, "repoint_vs_fresh_v2": 0.03, "repoint_vs_v1": inf, "versioned_vs_fresh_v2": 0.03}
    rec = vb.stale_verdict(inf, gaps, 832.0, 832.0)
    assert rec["inconclusive"] and rec["tolerance"] is None
    assert rec["stale_kv_served"] is None and rec["repoint_answer_equals_fresh_v2"] is None
    gaps = {"v1_vs_v2": 0.5, "repoint_vs_fresh_v2": 0.4, "repoint_vs_v1": 0.0, "versioned_vs_fresh_v2": 0.0}
    rec = vb.stale_verdict(0.001, gaps, 832.0, 832.0)  # re-pointed, answered as v1 from the cache
    assert "inconclusive" not in rec and rec["stale_kv_served"] and not rec["repoint_answer_equals_fresh_v2"]
    assert rec["versioned_v2_equals_fresh_v2"] and rec["tolerance"] == 0.004
    # a NaN control became tolerance 1e-4 (max(1e-4, nan)); a NaN log-prob was dropped by _gap's max()
    assert vb.stale_verdict(float("nan"), gaps, 832.0, 832.0)["inconclusive"]
    assert vb._gap(([1, 2], [-0.1, float("nan")]), ([1, 2], [-0.1, -0.2])) == inf
    assert vb._gap(([1, 2], [-0.1, -0.3]), ([1, 2], [-0.1, -0.2])) == pytest.approx(0.1)


def test_record_into_a_file_holding_one_bare_record(tmp_path):
    """benchmarks/results/vllm_h200.json was committed as the first run's bare record: `record` raised
    KeyError 'records' on it."""
    (tmp_path / "vllm_h200.json").write_text(
        json.dumps({"date": "2026-12-02", "plan": "main2", "done_when": {}})
    )
    into = tmp_path / "results.json"
    into.write_text(json.dumps({"date": "2026-12-01", "plan": "main", "benchmark": "vllm_h200"}))
    vb.record_into(tmp_path, into)
    recs = json.loads(into.read_text())["records"]
    assert [(r["date"], r["plan"]) for r in recs] == [("2026-12-01", "main"), ("2026-12-02", "main2")]


def test_mtp_distillation_trains_and_writes_back_only_mtp(tiny_vl_base, tmp_path):
    """On the tiny VL base (CPU): drafts agree better with the target after the ridge fit and
    training; only `mtp.*` tensors change, names/shapes/dtypes and every other tensor stay."""
    from safetensors.torch import load_file

    base = shutil.copytree(tiny_vl_base, tmp_path / "base")
    before = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    rep = mtp_distill.distill(base, budget_s=12, device="cpu", n_prompts=8, prompt_len=16, new_tokens=12)
    after = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(after) == set(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape, k
        if k.startswith("mtp."):
            continue
        assert after[k].equal(v), k
    assert any(not after[k].equal(before[k]) for k in before if k.startswith("mtp."))
    assert len(rep["agreement_random"]) == len(rep["agreement_trained"]) == mtp_distill.STEPS
    assert rep["agreement_ridge"][0] > rep["agreement_random"][0]
    assert rep["continuations"]["sequences"] == 8 and rep["written"]
    # held out by prompt, the estimate on the test split, the prompts to replay on an engine
    assert (
        rep["split"] == {"test": 2, "val": 2, "train": 4} and rep["continuations"]["distinct_sequences"] == 8
    )
    assert len(rep["test_prompts"]) == 2 and all(len(p) == 16 for p in rep["test_prompts"])
    assert [len(c) for c in rep["test_continuations"]] == [12, 12]
    e = rep["expected"]
    assert rep["kept"] == "ridge" or rep["kept"].startswith("trained@")
    assert e["acceptance"][0] == e["agreement"][0] and e["acceptance"] == sorted(
        e["acceptance"], reverse=True
    )
    assert e["acceptance_length"] == pytest.approx(1 + sum(e["acceptance"]))
