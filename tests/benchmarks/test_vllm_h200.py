"""benchmarks/vllm_h200/ (the GPU driver, a package; benchmarks/vllm_h200.py is its command line) and
benchmarks/mtp_distill.py without a GPU: engine command lines, the stage
runner, the "Done when" check, and the MTP self-distillation on the tiny VL base (CPU, seconds).

The whole driver runs against real vLLM CPU instances in tests/fleet/test_fleet_vllm.py (smoke plan).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

from tests.support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import mtp_distill  # noqa: E402
from vllm_h200 import context, engines, fleet, measure, plans, record, speed, stages, trained  # noqa: E402


def test_fleet_engines_get_the_fleets_flags(tmp_path):
    argvs = plans.engine_argvs("main", tmp_path)
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
    sweep = plans.engine_argvs("sweep", tmp_path)
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
        res = plans.check_argvs(os.environ["VLLM025_PYTHON"], plans.engine_argvs(plan, tmp_path))
        assert res.pop("vllm").startswith("0.25.") and set(res.values()) == {"ok"}, res


def test_runner_records_every_stage_skips_by_deadline_and_dependency(tmp_path):
    ctx = context.Ctx("main", tmp_path / "w", tmp_path / "o", deadline_s=30, gpu=True)
    calls = []

    def ok(ctx):
        calls.append("host")
        return {"plan": "main"}

    def boom(ctx):
        raise RuntimeError("engine exited 1")

    plan = [("host", ok, 1), ("base", boom, 1), ("mtp", ok, 1), ("launch", ok, 3600)]
    rec = plans.run(ctx, plan)
    stages = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "o" / "stages").glob("*.json")}
    assert set(stages) == {"host", "base", "mtp", "launch"} and calls == ["host"]
    assert stages["host"]["ok"] and stages["base"]["error"] == "RuntimeError: engine exited 1"
    assert stages["mtp"]["skipped"] == "needs base" and stages["launch"]["skipped"].startswith("needs base")
    assert rec["failed"] == ["base", "launch", "mtp"] and rec["done_when"]["mtp_3"]
    assert json.loads((tmp_path / "o" / "vllm_h200.json").read_text())["stages"]["base"]["ok"] is False
    ctx2 = context.Ctx("main", tmp_path / "w2", tmp_path / "o2", deadline_s=30, gpu=True)
    assert plans.run(ctx2, [("host", ok, 3600)])["stages"]["host"]["skipped"].startswith("deadline")


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
    assert all(record.done_when(rec).values())
    rec["canary_bf16_base"]["token_agreement"] = 0.98
    rec["publish"]["confirmed_by"] = ["fleet-a"]
    rec["acceptance_length"] = {"base": {"1": None}, "adapter": {"1": None}}  # an engine without speculation
    bad = record.done_when(rec)
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
    assert record.record_into(tmp_path, into) == {"x": True}
    recs = json.loads(into.read_text())["records"]
    assert [r["date"] for r in recs] == ["2026-11-30", "2026-12-01"] and "old" not in recs[1]


def test_stale_kv_probe_is_inconclusive_when_its_control_differs_in_tokens():
    """The 2026-12-02 H200 record: cold vs warm of the same adapter differed in tokens, the tolerance
    became infinite and every verdict came out as if measured."""
    inf = float("inf")
    gaps = {"v1_vs_v2": inf, "repoint_vs_fresh_v2": 0.03, "repoint_vs_v1": inf, "versioned_vs_fresh_v2": 0.03}
    rec = fleet.stale_verdict(inf, gaps, 832.0, 832.0)
    assert rec["inconclusive"] and rec["tolerance"] is None
    assert rec["stale_kv_served"] is None and rec["repoint_answer_equals_fresh_v2"] is None
    gaps = {"v1_vs_v2": 0.5, "repoint_vs_fresh_v2": 0.4, "repoint_vs_v1": 0.0, "versioned_vs_fresh_v2": 0.0}
    rec = fleet.stale_verdict(0.001, gaps, 832.0, 832.0)  # re-pointed, answered as v1 from the cache
    assert "inconclusive" not in rec and rec["stale_kv_served"] and not rec["repoint_answer_equals_fresh_v2"]
    assert rec["versioned_v2_equals_fresh_v2"] and rec["tolerance"] == 0.004
    # a NaN control became tolerance 1e-4 (max(1e-4, nan)); a NaN log-prob was dropped by _gap's max()
    assert fleet.stale_verdict(float("nan"), gaps, 832.0, 832.0)["inconclusive"]
    assert measure._gap(([1, 2], [-0.1, float("nan")]), ([1, 2], [-0.1, -0.2])) == inf
    assert measure._gap(([1, 2], [-0.1, -0.3]), ([1, 2], [-0.1, -0.2])) == pytest.approx(0.1)


def test_record_into_a_file_holding_one_bare_record(tmp_path):
    """benchmarks/results/vllm_h200.json was committed as the first run's bare record: `record` raised
    KeyError 'records' on it."""
    (tmp_path / "vllm_h200.json").write_text(
        json.dumps({"date": "2026-12-02", "plan": "main2", "done_when": {}})
    )
    into = tmp_path / "results.json"
    into.write_text(json.dumps({"date": "2026-12-01", "plan": "main", "benchmark": "vllm_h200"}))
    record.record_into(tmp_path, into)
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


def _trained_base(src, dst):
    """A `--base` like `pipeline dev trained-base` writes: the tiny VL base's files + trained_base.json."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "trained_base.json").write_text(
        json.dumps({"heldout_ppl": 9.5, "mtp_greedy": {"acceptance_length": 2.4}})
    )
    return dst


def test_trained_plan_stages_and_command_lines(tiny_vl_base, tmp_path):
    """Plan `trained` on `--base DIR`: one engine at a time (bf16, the NVFP4 build, NVFP4), each with the
    fleet's flags and MTP x3 on the given base; no MTP distillation on a trained base; prompts from the
    base's own tokenizer without its special tokens."""
    base = _trained_base(tiny_vl_base, tmp_path / "tb")
    assert [s[0] for s in plans.PLANS["trained"]] == [
        "host",
        "base",
        "mtp",
        "tb_bf16",
        "tb_build",
        "tb_nvfp4",
        "tb_drafter",
    ]
    argvs = plans.engine_argvs("trained", tmp_path / "w", base)
    bf, nv = argvs["tb-bf16"], argvs["tb-nvfp4"]
    assert bf[0] == str(base) and nv[0] == str(tmp_path / "w" / "tb-nvfp4")
    assert "--quantization" not in bf and nv[nv.index("--quantization") + 1] == "modelopt"
    for a in (bf, nv):
        assert json.loads(a[a.index("--speculative-config") + 1]) == engines.SPEC_MTP
        assert a[a.index("--kv-cache-dtype") + 1] == "fp8" and "--enable-lora" in a
        assert int(a[a.index("--kv-cache-memory-bytes") + 1]) == 16 * engines.GIB  # the same fixed KV cache
    assert bf[-1] == "tb" and nv[-1] == "tb-nvfp4"  # --served-model-name
    ctx = context.Ctx("trained", tmp_path / "w", tmp_path / "o", 1e9, gpu=True, base_given=base)
    assert stages.served_base_cmd(ctx)[-6:] == ["dev", "served-base", base, ctx.nvfp4, "--device", "cuda"]
    got = stages.st_base(ctx)
    assert got["given"] and got["trained_base"]["heldout_ppl"] == 9.5 and got["prompt_ids"]["count"] > 900
    special = {t["id"] for t in json.loads((base / "tokenizer.json").read_text())["added_tokens"]}
    assert not special & set(ctx.ids) and len(special) > 3  # random_prompts drew ids from 3: specials too
    assert stages.st_mtp(ctx)["trained"] is True
    # an NVFP4 build counts for this base only once marked, and not after the base changes
    (tmp_path / "w").mkdir()
    ctx.nvfp4.mkdir()
    (ctx.nvfp4 / "hf_quant_config.json").write_text("{}")
    assert not stages.nvfp4_current(ctx)
    stages.mark_built(ctx)
    assert stages.nvfp4_current(ctx)
    os.utime(base / "trained_base.json", (1, 1))
    assert not stages.nvfp4_current(ctx)


def test_base_option_changes_the_paths_of_every_plan(tmp_path):
    base = tmp_path / "my-base"
    ctx = context.Ctx("main", tmp_path / "w", tmp_path / "o", 1e9, gpu=True, base_given=base)
    assert ctx.bf16 == base and ctx.nvfp4 == tmp_path / "w" / "my-base-nvfp4"
    assert ctx.mtp_json == tmp_path / "w" / "my-base-mtp.json"
    default = context.Ctx("main", tmp_path / "w", tmp_path / "o", 1e9, gpu=True)
    assert default.bf16 == tmp_path / "w" / "real8" and default.nvfp4.name == "real8-nvfp4"
    argvs = plans.engine_argvs("main", tmp_path / "w", base)
    assert argvs["fleet-a"][0] == str(ctx.nvfp4) and argvs["staging"][0] == str(base)
    assert argvs["fleet-a"][-1] == "my-base-nvfp4"
    assert any(f"base_model={base}" == x for x in stages._train_cmd(ctx, 1))


def test_run_refuses_plan_trained_without_a_base(tmp_path):
    import subprocess

    cmd = [sys.executable, str(REPO / "benchmarks" / "vllm_h200.py"), "run", "trained", "--work", str(tmp_path / "w"),
           "--out", str(tmp_path / "o")]  # fmt: skip
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO))
    )
    assert p.returncode == 2 and "plan trained needs --base DIR" in p.stderr
    assert not (tmp_path / "o").exists()
    p = subprocess.run([*cmd[:3], "main", *cmd[4:], "--base", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert p.returncode == 2 and "no config.json there" in p.stderr


def test_prompt_ids_leave_out_special_tokens(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        json.dumps(
            {
                "added_tokens": [{"id": 0}, {"id": 5}],
                "model": {"vocab": {c: i for i, c in enumerate("abcdef")}},
            }
        )
    )
    assert stages.prompt_ids(tmp_path) == [1, 2, 3, 4]
    assert stages.prompt_ids(tmp_path / "none") == list(range(16, 1024))
    assert all(
        t in (1, 2, 3, 4) for p in measure.random_prompts(3, 20, stages.prompt_ids(tmp_path)) for t in p
    )


def test_agreement_counts_positions_and_first_divergences():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8], [9]]
    a = measure.agreement(ref, got)
    assert a["first_divergence"] == [None, 1, 1] and a["identical_sequences"] == 1
    assert a["token_agreement"] == 0.8 and a["prefix_agreement"] == 0.6 and a["positions"] == 10
    with pytest.raises(ValueError):
        measure.agreement(ref, got[:2])


def test_decode_warms_up_then_times_three_passes_on_prompts_of_their_own(monkeypatch):
    """Every timed row: one untimed warm-up pass of the same shape, then REPEATS timed passes; the record
    keeps the median and the min-max (issue 37: single passes gave 166.6 then 90.1 tok/s)."""
    import time as _time

    sent, gen = [], {"n": 0.0}
    waits = iter([0.0] * 2 + [0.02] * 2 + [0.01] * 2 + [0.04] * 2)  # warm-up, then three passes of batch 2

    def complete(url, model, prompt, max_tokens, **extra):
        sent.append(tuple(prompt))
        _time.sleep(next(waits))
        gen["n"] += max_tokens
        return {"usage": {"completion_tokens": max_tokens}}

    monkeypatch.setattr(measure, "complete", complete)
    monkeypatch.setattr(measure, "_scrape", lambda url: ({measure.prom.GENERATION_TOKENS: gen["n"]}, {}))
    monkeypatch.setattr(measure, "gpu_apps", lambda: [{"pid": 1, "used_mib": 100}])
    row = measure.decode("http://x", "m", 2, 10, prompt_len=4)
    assert len(sent) == 8 and len(set(sent)) == 8  # no pass reuses a prompt (no prefix-cache hit)
    assert row["repeats"] == 3 and len(row["tok_s_runs"]) == 3 and row["tokens"] == 60
    assert row["tok_s_min"] < row["tok_s"] < row["tok_s_max"] and row["tok_s"] == sorted(row["tok_s_runs"])[1]
    assert row["gpu_apps"] == [{"pid": 1, "used_mib": 100}]


def test_heldout_prompts_come_from_the_bases_tokenizer(tiny_vl_base, monkeypatch):
    """Plan trained's prompts: held-out corpus text in the base's own token ids."""
    from tokenizers import Tokenizer

    corpus = pytest.importorskip("pipeline.dev.corpus")
    text = "def parse(value):\n    return int(value) + 1  # a held-out file\n" * 200
    monkeypatch.setattr(corpus, "collect", lambda roots, cap: corpus.Corpus(train=["x"], heldout=[text]))
    got = trained.heldout_prompts(tiny_vl_base, n=4, length=16)
    tok = Tokenizer.from_file(str(tiny_vl_base / "tokenizer.json"))
    stream = tok.encode(text, add_special_tokens=False).ids
    assert got["prompts"] == [stream[i * 64 : i * 64 + 16] for i in range(4)] and got["source"].startswith(
        "pipeline"
    )


def test_heldout_prompts_without_a_corpus_use_the_validation_set(tiny_vl_base, monkeypatch):
    import pipeline.dev

    monkeypatch.setitem(sys.modules, "pipeline.dev.corpus", None)  # import fails: a checkout without it
    monkeypatch.delattr(pipeline.dev, "corpus", raising=False)
    got = trained.heldout_prompts(tiny_vl_base, n=4, length=16)
    assert got["source"].startswith("datasets/") and all(len(p) == 16 for p in got["prompts"])
    with pytest.raises(RuntimeError, match="not 100000"):
        trained.heldout_prompts(tiny_vl_base, n=100000, length=16)


def test_timed_rows_come_after_the_stages_that_need_other_engines():
    """Issue 37: `sweep` started five engines beside the fleet's two and timed each while the others
    compiled; `main` timed decode while fleet-b served and the merge build ran. Now the stages that stop
    the other engines (decode, merged, staging_bf16, sweep, decode64) come after every stage needing them."""
    names = {p: [s[0] for s in st] for p, st in plans.PLANS.items()}
    assert names["main"][-2:] == ["decode", "merged"]
    assert names["main2"][-1] == "staging_bf16" and "merged" not in names["main2"]
    assert names["sweep"][-2:] == ["publish_latency", "sweep"] and "sweep_start" not in names["sweep"]
    assert names["fleet64"] == ["host", "base64", "build64", "adapter64", "decode64"]
    assert names["trained"][-4:] == ["tb_bf16", "tb_build", "tb_nvfp4", "tb_drafter"]


def test_sweep_engines_one_setting_each_sized_to_the_adapter(tmp_path):
    ctx = context.Ctx("sweep", tmp_path, tmp_path, 1e9, gpu=True)
    eng = engines.sweep_engines(ctx, adapter_rank=8)
    flag = {n: {e.args[i]: e.args[i + 1] for i in range(len(e.args) - 1)} for n, e in eng.items()}
    assert flag["rank-adapter"]["--max-lora-rank"] == "8" and flag["rank64"]["--max-lora-rank"] == "64"
    assert flag["loras1"]["--max-loras"] == "1" and flag["loras4"]["--max-loras"] == "4"
    assert flag["rank-adapter"]["--max-loras"] == "2" and "--compilation-config" in flag["graphs-off"]
    assert {f["--kv-cache-memory-bytes"] for f in flag.values()} == {
        str(16 * engines.GIB)
    }  # all alike, alone
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    assert speed.adapter_rank(tmp_path / "ad") == 8
    got = speed.sweep_ratios(
        {"rank-adapter": {"ratio_adapter_over_base": {"1": 0.9}}, "loras4": {"not_measured": "x"}}
    )
    assert got["max_lora_rank"] == {"adapter": {"1": 0.9}, "64": None} and got["max_loras"]["4"] is None


def test_fleet64_paths_and_engine(tmp_path, monkeypatch):
    """The 64-layer plan: bf16 base in /dev/shm, NVFP4 build in WORK, no MTP, 32 sequences; the build
    still counts once the bf16 copy is deleted (the disk cannot hold both)."""
    monkeypatch.setattr(context, "SHM", tmp_path / "shm")
    ctx = context.Ctx("fleet64", tmp_path / "w", tmp_path / "o", 1e9, gpu=True)
    assert ctx.bf16 == tmp_path / "shm" / "real64" and ctx.nvfp4 == tmp_path / "w" / "real64-nvfp4"
    a = plans.engine_argvs("fleet64", tmp_path / "w")["fleet64"]
    assert "--speculative-config" not in a and a[a.index("--quantization") + 1] == "modelopt"
    assert a[len(a) - 1 - a[::-1].index("--max-num-seqs") + 1] == "32"  # the last one wins
    assert stages.served_base_cmd(ctx)[-4:] == [ctx.bf16, ctx.nvfp4, "--device", "cuda"]
    ctx.bf16.mkdir(parents=True)
    (ctx.bf16 / "config.json").write_text("{}")
    ctx.nvfp4.mkdir(parents=True)
    (ctx.nvfp4 / "hf_quant_config.json").write_text("{}")
    assert not stages.nvfp4_current(ctx)  # no marker: not known to be this base's
    stages.mark_built(ctx)
    shutil.rmtree(ctx.bf16)
    assert stages.nvfp4_current(ctx) and speed.st_base64(ctx)["skipped"]


def test_exclusive_stops_the_other_engines_and_waits_for_jobs(tmp_path):
    import subprocess

    ctx = context.Ctx("main", tmp_path, tmp_path, 1e9, gpu=True)
    procs = {}
    for n in ("fleet-a", "fleet-b", "merged"):
        e = engines.Engine(n, tmp_path, [])
        e.proc = procs[n] = subprocess.Popen(["sleep", "60"], start_new_session=True)
        ctx.engines[n] = e
    job = subprocess.Popen(["sleep", "1"], start_new_session=True)
    ctx.bg["merge"] = (job, tmp_path / "merge.log", 0.0)
    try:
        got = context.Ctx.exclusive(ctx, "fleet-a")
        assert sorted(got["stopped"]) == ["fleet-b", "merged"] and got["waited_for"] == ["merge"]
        assert procs["fleet-a"].poll() is None and procs["fleet-b"].poll() is not None and job.poll() == 0
        slow = subprocess.Popen(["sleep", "60"], start_new_session=True)
        ctx.bg["build"] = (slow, tmp_path / "b.log", 0.0)
        with pytest.raises(RuntimeError, match="build still runs"):
            ctx.exclusive("fleet-a", wait_s=1)
    finally:
        ctx.stop_all()


def test_random_adapter_covers_the_shipped_targets_in_the_language_model_only(tmp_path):
    """fleet64's adapter: r16 on every target of the shipped config, language-model layers only (the
    engine serves --language-model-only), random non-zero B."""
    from safetensors.torch import load_file

    got = speed.random_adapter(tmp_path / "ad", 4)
    t = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    assert got["r"] == 16 and got["tensors"] == len(t) == 2 * (3 * 6 + 7)  # 3 linear-attention + 1 full layer
    assert all(".language_model.layers." in k for k in t) and not any("visual" in k for k in t)
    assert {k.split(".")[-3] for k in t} == set(got["targets"])
    assert all(v.abs().sum() > 0 for v in t.values())
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["lora_alpha"] == 32


def test_driver_package_modules_stay_small():
    """Issue 37 item 4: the driver was one file of 1,600 lines; its modules stay under ~600, as pipeline/'s."""
    pkg = REPO / "benchmarks" / "vllm_h200"
    sizes = {p.name: len(p.read_text().splitlines()) for p in pkg.glob("*.py")}
    assert {"plans.py", "engines.py", "stages.py", "record.py"} <= set(sizes)
    assert max(sizes.values()) <= 600, sizes
    assert len((REPO / "benchmarks" / "vllm_h200.py").read_text().splitlines()) < 40  # the command line only


def test_markdown_shows_medians_with_their_spread_and_says_what_was_not_measured():
    table = {
        "tok_s": {"base": {"1": 100.0}, "adapter": {"1": 60.0}},
        "tok_s_range": {"base": {"1": [98.0, 101.0]}, "adapter": {"1": [59.0, 61.5]}},
        "ratio_adapter_over_base": {"1": 0.6},
    }
    rec = {
        "sweep": {"settings": {"rank64": table, "loras4": {"not_measured": "deadline: 90 s left"}}},
        "fleet64": {"decode": table},
    }
    md = record.markdown(rec)
    assert "- batch 1: base 100.0 [98.0-101.0], adapter 60.0 [59.0-61.5], ratio 0.6" in md
    assert "sweep loras4: not measured (deadline: 90 s left)" in md and "64-layer NVFP4, no MTP" in md


def test_the_canarys_tpot_beside_another_engine_carries_no_number(tmp_path):
    """Issue 37: a timed row not measured with the GPU the engine's alone says why and has no number."""
    ctx = context.Ctx("main", tmp_path, tmp_path, 1e9, gpu=True)
    done = {"canary_served": {"ok": True, "result": {"speed": {"base": {"tpot_s": 0.0073}}}}}
    cn = record.assemble(ctx, done)["canary_nvfp4"]
    assert cn["tpot_ms"] is None and "beside instance b" in cn["tpot_not_measured"]
    assert record.assemble(ctx, {})["canary_nvfp4"]["tpot_not_measured"] is None


def test_trained_plan_stops_each_engine_before_the_next_and_compares_greedy_tokens(
    tiny_vl_base, tmp_path, monkeypatch
):
    """tb_bf16 then tb_nvfp4, each engine stopped before the next starts; the NVFP4 greedy tokens are
    compared with the bf16 engine's on the same prompts, and a bf16 result of another base is refused."""
    base = _trained_base(tiny_vl_base, tmp_path / "tb")
    ctx = context.Ctx("trained", tmp_path / "w", tmp_path / "o", 1e9, gpu=True, base_given=base)
    (tmp_path / "w").mkdir()
    events, running = [], set()
    tokens = {"tb-bf16": [[1, 2, 3], [4, 5, 6]], "tb-nvfp4": [[1, 2, 3], [4, 0, 6]]}

    def start(e, port):
        assert not running, f"{e.name} started while {running} runs"
        running.add(e.name)
        events.append(("start", e.name))
        e.port, e.ready_s = port, 1.0
        ctx.engines[e.name] = e
        return e

    def stop(name, settle_s=60.0):
        running.discard(name)
        events.append(("stop", name))
        return {"stopped": True}

    monkeypatch.setattr(
        trained, "heldout_prompts", lambda b: {"prompts": [[7] * 4] * 56, "source": "test", "length": 4}
    )
    monkeypatch.setattr(ctx, "start_engine", start)
    monkeypatch.setattr(ctx, "wait_engine", lambda name, timeout: ctx.engines[name])
    monkeypatch.setattr(ctx, "stop_engine", stop)
    monkeypatch.setattr(
        trained,
        "greedy",
        lambda url, m, p, k: {"tokens": tokens[next(iter(running))], "acceptance_length": 2.0},
    )
    monkeypatch.setattr(trained, "decode", lambda url, m, b, k, pool: {"tok_s": 100.0 * b, "pool": len(pool)})
    bf = trained.st_tb_bf16(ctx)
    assert bf["decode"]["8"]["pool"] == 40 and bf["greedy"]["acceptance_length"] == 2.0
    nv = trained.st_tb_nvfp4(ctx)
    assert events == [("start", "tb-bf16"), ("stop", "tb-bf16"), ("start", "tb-nvfp4"), ("stop", "tb-nvfp4")]
    assert nv["vs_bf16"]["agreement"]["first_divergence"] == [None, 1]
    assert nv["vs_bf16"]["decode_ratio_nvfp4_over_bf16"] == {"1": 1.0, "8": 1.0}
    summary = trained.trained_summary(None, bf, None, nv)
    assert summary["nvfp4_vs_bf16"]["agreement"]["token_agreement"] == round(5 / 6, 4)
    os.utime(base / "trained_base.json", (1, 1))  # the base changed: the bf16 result is not its
    with pytest.raises(RuntimeError, match="another base"):
        trained.st_tb_nvfp4(ctx)


def _task_adapters(tmp_path, drafter: bool = True) -> dict:
    ck = tmp_path / "served-drafter-toolcall"
    ck.mkdir(parents=True, exist_ok=True)
    return {
        "snake": {"adapter": str(tmp_path / "a-snake"), "drafter": {"checked": False}},
        "toolcall": {
            "adapter": str(tmp_path / "a-tool"),
            "drafter": {"checked": True, **({"checkpoint": str(ck)} if drafter else {})},
        },
    }


def test_trained_plan_waits_for_the_task_adapters_and_drafts_with_their_drafter(
    tiny_vl_base, tmp_path, monkeypatch
):
    """benchmarks/trained_adapters.py runs in the background while the engine starts: the stages wait for its
    `.done` marker (measuring the base alone when it does not come); a task adapter's drafter checkpoint adds
    the engine that drafts with it (`speculative_config.model`), the fleet's flags otherwise."""
    base = _trained_base(tiny_vl_base, tmp_path / "tb")
    ctx = context.Ctx("trained", tmp_path / "w", tmp_path / "o", 1e9, gpu=True, base_given=base)
    p = tmp_path / "ta" / "adapters.json"
    p.parent.mkdir()
    ctx.facts["task_adapters_path"] = p
    p.write_text(json.dumps(_task_adapters(tmp_path)))
    assert trained.task_adapters(ctx, wait_s=0) == {}  # not done yet: the base only
    assert "tb-nvfp4-drafter" not in engines.trained_engines(ctx)
    monkeypatch.setattr(trained, "DRAFTER_WAIT_S", 2.5)  # 420 s on the GPU host: this test waited them out
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="no task adapter has a drafter checkpoint"):
        trained.st_tb_drafter(ctx)
    assert 2.0 <= time.monotonic() - t < 30  # it waited for the marker, as long as it was told
    (p.parent / "adapters.json.done").write_text("{}")
    assert set(trained.task_adapters(ctx, wait_s=0)) == {"snake", "toolcall"}
    e = engines.trained_engines(ctx)["tb-nvfp4-drafter"]
    spec = json.loads(e.args[e.args.index("--speculative-config") + 1])
    assert spec == engines.SPEC_MTP | {"model": str(tmp_path / "served-drafter-toolcall")}
    assert e.model == ctx.nvfp4 and e.args[e.args.index("--quantization") + 1] == "modelopt"
    assert engines.drafter_checkpoint_of(ctx)[0] == "toolcall"
    ctx.facts["task_adapters"] = _task_adapters(tmp_path, drafter=False)
    assert engines.drafter_checkpoint_of(ctx) is None


def test_task_pass_scores_the_engines_answers_against_peft(tiny_vl_base, tmp_path, monkeypatch):
    """An adapter's answers on an engine: the task metric from the base's tokenizer, token agreement with the
    PEFT reference in bf16 and float32 (EOS dropped on both sides), acceptance from the pass."""
    from tokenizers import Tokenizer

    from pipeline.canary.task import expected_text

    base = _trained_base(tiny_vl_base, tmp_path / "tb")
    ctx = context.Ctx("trained", tmp_path / "w", tmp_path / "o", 1e9, gpu=True, base_given=base)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    want = expected_text({"content": "max_retry_count"})
    ids = tok.encode(want, add_special_tokens=False).ids
    eos = sorted(trained._stop_ids(base))[0]
    engine_answers = [ids, ids[:-1] + [ids[0]]]  # the second answer's last token differs

    def fake_answers(url, model, prompts, k, stop_ids=()):
        assert model == "snake" and eos in stop_ids
        return {"tokens": engine_answers, "acceptance_length": 2.5, "acceptance_rate": 0.5,
                "acceptance_per_position": [0.7, 0.5, 0.3]}  # fmt: skip

    monkeypatch.setattr(trained, "answers", fake_answers)
    a = {"metric": "exact_match", "prompts": [[1, 2], [3, 4]], "expected": [want, want],
         "reference": {d: {"tokens": [ids + [eos], ids + [eos]], "metric": {"exact_match": 1.0}}
                       for d in ("bfloat16", "float32")}}  # fmt: skip
    got = trained.task_pass(ctx, "http://x", "snake", a)
    assert got["metric"]["exact_match"] == 0.5 and got["metric"]["n"] == 2
    n = 2 * len(ids)
    assert got["vs_peft_fp32"]["token_agreement"] == round((n - 1) / n, 4)
    assert got["vs_peft_bf16"]["identical_sequences"] == 1 and got["acceptance_length"] == 2.5
    summary = trained.trained_summary(None, {"greedy": {}, "adapters": {"snake": got}}, None, None)
    row = summary["bf16"]["adapters"]["snake"]
    assert row["task_metric"]["exact_match"] == 0.5 and row["token_agreement_vs_peft_fp32"] < 1.0
