"""The release path and checks on the fleet's engines: canary, publish, decode, rollback, stale KV, merged."""

from __future__ import annotations

import json
import math
import os
import time
from typing import TYPE_CHECKING

from pipeline.canary import prom

from . import REPO
from .engines import NAME, PORTS, gpu_engines
from .measure import _answer, _gap, decode, decode_table, lora, metrics, random_prompts, served_adapters
from .stages import _block_size

if TYPE_CHECKING:
    from .context import Ctx


def _canary(ctx: Ctx, staging: str, record: bool) -> dict:
    args = [
        "canary",
        NAME,
        "--version",
        ctx.facts["versions"][1],
        "--staging",
        staging,
        "--base",
        ctx.bf16,
        "--validation",
        REPO / "datasets" / "agent_chat_validation.jsonl",
        "--json",
    ]
    if not record:
        args.append("--no-record")
    r = ctx.cli(*args, timeout=420, check=False)
    j = r.get("json") or {}
    if not j or "parity" not in j:
        raise RuntimeError(f"canary gave no result (rc {r['rc']}): {j or r.get('stderr', '')[-1500:]}")
    return {"rc": r["rc"], "wall_s": r["wall_s"], **_canary_summary(j)}


def _canary_summary(j: dict) -> dict:
    par, sp = j.get("parity") or {}, j.get("speed") or {}

    def p(k):
        x = par.get(k) or {}
        return {f: x.get(f) for f in ("agreement", "exact", "tied", "positions", "first_divergence",
                                      "first_divergence_prompt", "max_logprob_diff", "max_logprob_diff_at")}  # fmt: skip

    def s(k):
        x = sp.get(k) or {}
        return {f: x.get(f) for f in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position", "tpot_s",
                                      "output_tokens", "other_traffic")}  # fmt: skip

    return {
        "verdict": j.get("verdict"),
        "problems": j.get("problems"),
        "served": j.get("served"),
        "tolerance": j.get("tolerance"),
        "parity": {"base": p("base"), "adapter": p("adapter")},
        "speed": {"base": s("base"), "adapter": s("adapter")},
        "speed_ratio": j.get("speed_ratio"),
        "acceptance_ratio": j.get("acceptance_ratio"),
        "effect": j.get("effect"),
        "notes": j.get("notes"),
        "prompts": len(j.get("prompts") or []),
    }


def st_canary_parity(ctx: Ctx) -> dict:
    staging = ctx.engines.get("staging") or ctx.engines["fleet-a"]
    return _canary(ctx, staging.url, record=False)


def _instances_serving(ctx: Ctx, version: int) -> dict:
    name = f"{NAME}-v{version}"
    want = f"{ctx.facts['mount'].rstrip('/')}/{name}"
    return {n: served_adapters(ctx.engines[n].url).get(name) == want for n in ("fleet-a", "fleet-b")}


def st_publish(ctx: Ctx) -> dict:
    v1 = ctx.facts["versions"][1]
    r = ctx.cli("publish", NAME, "--version", v1, "--json", timeout=400)
    pub = r["json"] or {}
    serving = _instances_serving(ctx, v1)
    synced = None
    if not all(serving.values()):  # a version already published: fresh engines need `fleet sync`
        synced = ctx.cli("fleet", "sync", "--json", timeout=300, check=False)
        serving = _instances_serving(ctx, v1)
    s = ctx.cli("fleet", "status", "--json", check=False)
    res = ctx.cli("fleet", "resolve", NAME, "--json", check=False)
    return {
        "version": v1,
        "wall_s": r["wall_s"],
        "confirmed_by": pub.get("instances"),
        "instances_list_the_version": serving,
        "warnings": pub.get("warnings"),
        "resolve": res.get("json"),
        "created": pub.get("created"),
        "sync": None if synced is None else {"rc": synced["rc"], "wall_s": synced["wall_s"]},
        "status_rc": s["rc"],
        "status": s.get("json"),
    }


def st_decode(ctx: Ctx) -> dict:
    """Decode rows on instance a, base vs adapter v1, with the GPU its alone (GPU: every other engine is
    stopped and the background jobs waited for first, so this stage comes after the ones needing them)."""
    a = ctx.engines["fleet-a"]
    v1 = ctx.facts["versions"][1]
    tokens = 256 if ctx.gpu else 8
    excl = ctx.exclusive("fleet-a") if ctx.gpu else {"cpu": "smoke: not a timing"}
    table = decode_table(
        a.url, a.model_id, f"{NAME}-v{v1}", (1, 8) if ctx.gpu else (1, 2), tokens, ids=ctx.ids
    )
    return table | {"exclusive": excl}


def st_mtp_check(ctx: Ctx) -> dict:
    """vLLM's MTP acceptance on the distillation's held-out test prompts (fleet-a: the NVFP4 base with the
    distilled bf16 `mtp.*`), next to the distillation's estimate on the same prompts (bf16 target):
    benchmarks/mtp_acceptance.py's measurement. A gap with `target_token_agreement` well below 1 is the
    NVFP4 target's argmax moving away from the bf16 one the layer learnt; a gap without it is a drafter
    that does not compute what the distillation trained."""
    import mtp_acceptance

    if not ctx.mtp_json.exists():
        return {"skipped": "no distillation report (the base's MTP layer was not distilled here)"}
    rep = json.loads(ctx.mtp_json.read_text())
    a = ctx.engines["fleet-a"]
    m = mtp_acceptance.measure(
        a.url, a.model_id, rep["test_prompts"], rep["test_continuations"], len(rep["test_continuations"][0])
    )
    return {"engine": "fleet-a", "measured": m, "expected": rep.get("expected"), "kept": rep.get("kept")}


def st_publish2(ctx: Ctx) -> dict:
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    t = time.time()
    p2 = ctx.cli("publish", NAME, "--version", v2, "--json", timeout=400)
    serving_v2 = _instances_serving(ctx, v2)
    resolved = ctx.cli("fleet", "resolve", NAME, "--json", check=False).get("json")
    publish_to_serving = round(time.time() - t, 2)
    rb = ctx.cli("rollback", NAME, "--to", v1, "--json", timeout=400)
    after = ctx.cli("fleet", "resolve", NAME, "--json", check=False).get("json")
    st = ctx.cli("fleet", "status", "--json", check=False)
    return {
        "publish_v2": {
            "wall_s": p2["wall_s"],
            "confirmed_by": (p2["json"] or {}).get("instances"),
            "instances_list_the_version": serving_v2,
            "resolved": resolved,
            "publish_call_to_resolved_s": publish_to_serving,
        },  # fmt: skip
        "rollback": {"wall_s": rb["wall_s"], "result": rb["json"], "resolved_after": after},
        "status_rc": st["rc"],
        "status": st.get("json"),
    }


def st_stale_kv(ctx: Ctx) -> dict:
    """Re-pointing a live name in place (load_inplace, NEW path) vs the versioned swap, on instance a.

    On 0.18-0.25 the prefix-cache block hash of a LoRA request holds the adapter name only
    (vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`), so after the re-point a prompt whose
    blocks were cached with the old weights is answered from the old KV (0.32 adds the path: fresh).
    The prompt is longer than one KV block (hybrid models cache whole blocks only). Answers are
    compared by greedy tokens AND their log-probs (two adapters trained on the same data can agree
    on tokens): `tolerance` is what the same adapter shows between a cold and a warm (prefix-cache)
    run of the same prompt, so a larger gap after the re-point is stale KV, not numerics.
    """
    a = ctx.engines["fleet-a"]
    mount = ctx.facts["mount"].rstrip("/")
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    p1, p2 = f"{mount}/{NAME}-v{v1}", f"{mount}/{NAME}-v{v2}"
    block = _block_size(a.url) or 1024
    limit = 16384 if ctx.gpu else 2048
    n = min(2 * block + 37, limit - 64)
    prompt = random_prompts(1, n, ctx.ids, seed=7)[0]
    k = 24 if ctx.gpu else 6

    def hits():
        return prom.counters(metrics(a.url)).get(prom.PREFIX_HITS, 0.0)

    probe, ref = f"stale-probe-{os.getpid()}", f"stale-ref-{os.getpid()}"
    lora(a.url, "load", lora_name=probe, lora_path=p1)
    try:
        cold1 = _answer(a.url, probe, prompt, k)
        h0 = hits()
        warm1 = _answer(a.url, probe, prompt, k)
        h1 = hits()
        lora(a.url, "load", lora_name=probe, lora_path=p2, load_inplace=True)
        after = _answer(a.url, probe, prompt, k)
        h2 = hits()
        lora(a.url, "load", lora_name=ref, lora_path=p2)
        fresh2 = _answer(a.url, ref, prompt, k)
        # the pipeline's way: the version names, each with its own prefix-cache key
        _answer(a.url, f"{NAME}-v{v1}", prompt, k)
        _answer(a.url, f"{NAME}-v{v1}", prompt, k)
        versioned2 = _answer(a.url, f"{NAME}-v{v2}", prompt, k)
    finally:
        for x in (probe, ref):
            try:
                lora(a.url, "unload", lora_name=x)
            except RuntimeError:
                pass
    gaps = {
        "v1_vs_v2": _gap(cold1, fresh2),
        "repoint_vs_fresh_v2": _gap(after, fresh2),
        "repoint_vs_v1": _gap(after, cold1),
        "versioned_vs_fresh_v2": _gap(versioned2, fresh2),
    }
    rec = stale_verdict(_gap(cold1, warm1), gaps, h1 - h0, h2 - h1)
    return {"block_size": block, "prompt_tokens": n, "generated": k, **rec}


def stale_verdict(control: float, gaps: dict[str, float], warm_hits: float, repoint_hits: float) -> dict:
    """The stale-KV probe's findings from its gaps (`_gap`, nats; inf: the greedy tokens differ).

    `control` is the same adapter's cold vs warm (prefix-cache) gap: the tolerance is 4x it. When the
    control's own tokens differ (inf: near-ties, or a cache that changes numerics) no gap can be told
    from numerics, and every verdict is None with `inconclusive` saying why (the 2026-12-02 H200 run
    reported True for such a probe: every gap is <= an infinite tolerance)."""
    control = control if math.isfinite(control) else float("inf")  # NaN: max(1e-4, nan) was 1e-4
    tol = max(1e-4, 4 * control) if control != float("inf") else float("inf")
    rec = {
        "control_cold_vs_warm_gap": None if control == float("inf") else control,
        "tolerance": None if tol == float("inf") else tol,
        "gaps_nats": {key: (None if v == float("inf") else round(v, 6)) for key, v in gaps.items()},
        "tokens_differ": {key: v == float("inf") for key, v in gaps.items()},
        "warm_hit_tokens": warm_hits,
        "repoint_hit_tokens": repoint_hits,
    }
    if tol == float("inf"):
        verdicts = dict.fromkeys(
            (
                "v1_differs_from_v2",
                "repoint_answer_equals_fresh_v2",
                "stale_kv_served",
                "versioned_v2_equals_fresh_v2",
            )
        )
        rec["inconclusive"] = "the same adapter's cold and warm answers differ in tokens: no tolerance"
        return rec | verdicts
    return rec | {
        "v1_differs_from_v2": gaps["v1_vs_v2"] > tol,
        "repoint_answer_equals_fresh_v2": gaps["repoint_vs_fresh_v2"] <= tol,
        "stale_kv_served": gaps["repoint_vs_fresh_v2"] > tol and repoint_hits > 0 and gaps["v1_vs_v2"] > tol,
        "versioned_v2_equals_fresh_v2": gaps["versioned_vs_fresh_v2"] <= tol,
    }


def st_canary_served(ctx: Ctx) -> dict:
    """The canary on the fleet's kind of engine (NVFP4 + MTP, instance a as staging), recorded on v1."""
    return _canary(ctx, ctx.engines["fleet-a"].url, record=True)


def st_merged(ctx: Ctx) -> dict:
    if "merge" in ctx.bg:
        res = {"build": ctx.wait_bg("merge", 300)}
    else:  # built by plan prep on this machine
        res = {"build": {"reused": (ctx.work / "merged-v1" / "hf_quant_config.json").exists()}}
    e = ctx.start_engine(gpu_engines(ctx)["merged"], PORTS["merged"])
    ctx.wait_engine(e.name, 300)
    a = ctx.engines["fleet-a"]
    v1 = ctx.facts["versions"][1]
    r = ctx.cli("merge-parity", ctx.work / "merged-v1", "--merged", e.url, "--hot", a.url, "--name", NAME,
                "--version", v1, "--json", timeout=300, check=False)  # fmt: skip
    res["merge_parity"] = {"rc": r["rc"], "wall_s": r["wall_s"], "result": r.get("json") or r.get("stdout")}
    res["exclusive"] = ctx.exclusive("merged")  # the fleet engines were needed for parity only
    res["decode_merged"] = {str(b): decode(e.url, e.model_id, b, 256, ids=ctx.ids) for b in (1, 8)}
    return res


def st_staging_bf16(ctx: Ctx) -> dict:
    e = ctx.wait_engine("staging-bf16", 300)
    res = {"canary": _canary(ctx, e.url, record=False)}
    v1 = ctx.facts["versions"][1]
    lora(e.url, "load", lora_name=f"{NAME}-v{v1}", lora_path=str(ctx.facts["adapters"][1]))
    res["exclusive"] = ctx.exclusive("staging-bf16")  # main2's last stage: the others are done
    res["decode"] = decode_table(e.url, e.model_id, f"{NAME}-v{v1}", (1, 8), 256, ids=ctx.ids)
    return res
