"""Plan trained: a prebuilt trained base, its bf16 then its NVFP4 engine, one at a time on the GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import REPO
from .engines import TRAINED_PORTS, _du, trained_engines
from .measure import agreement, decode, greedy
from .stages import _built_from, mark_built, nvfp4_current, served_base_cmd

if TYPE_CHECKING:
    from .context import Ctx


TRAINED_PROMPTS = 56  # held-out prompts: the first GREEDY_PROMPTS for agreement, the rest for the decode rows


GREEDY_PROMPTS, PROMPT_LEN, GREEDY_TOKENS = 16, 64, 128


def heldout_prompts(base: Path, n: int = TRAINED_PROMPTS, length: int = PROMPT_LEN) -> dict:
    """`n` prompts of `length` token ids of the base's own tokenizer, cut from text the trained base never
    saw: the held-out files of `pipeline.dev.corpus` (split by path hash, so held out on any host), read
    from this interpreter's site-packages, windows spaced 4x`length` apart as `pipeline dev trained-base`
    cuts its own greedy prompts. Falls back to the user turns of datasets/agent_chat_validation.jsonl
    when the corpus is missing here or too small for `n` prompts (or pipeline.dev.corpus is missing).
    Returns {prompts, source, length}. Raises RuntimeError when neither gives `n` prompts."""
    from tokenizers import Tokenizer

    from pipeline.errors import UsageError

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    rows = (REPO / "datasets" / "agent_chat_validation.jsonl").read_text().splitlines()
    validation = [
        m["content"] for x in rows if x for m in json.loads(x)["messages"] if m.get("role") == "user"
    ]
    tried = []
    try:
        from pipeline.dev import corpus

        sources = [("pipeline.dev.corpus held-out files", corpus.collect(None, 40_000_000).heldout)]
    except (ImportError, UsageError) as e:  # a checkout without pipeline/dev/corpus.py, or no corpus here
        sources, tried = [], [f"pipeline.dev.corpus: {e}"]
    sources.append(("datasets/agent_chat_validation.jsonl user turns", validation))
    for source, docs in sources:
        stream: list[int] = []
        for d in docs:
            stream.extend(tok.encode(d, add_special_tokens=False).ids)
            if len(stream) >= n * length * 4:
                break
        step = length * 4 if len(stream) >= n * length * 4 else length
        prompts = [stream[i * step : i * step + length] for i in range(n) if len(stream) >= i * step + length]
        if len(prompts) == n:
            return {"prompts": prompts, "source": source, "length": length, "not_used": tried}
        tried.append(f"{source}: {len(stream)} tokens give {len(prompts)} prompts of {length}, not {n}")
    raise RuntimeError("; ".join(tried))


def _trained_engine(ctx: Ctx, name: str) -> dict:
    """Start engine `name` of `trained_engines` alone on the GPU, measure, stop it: ready time, greedy
    tokens + acceptance on the held-out prompts, decode rows at batch 1 and 8 (warm-up + REPEATS)."""
    if "prompts" not in ctx.facts:  # one set per base (a base of the same name rebuilt gets new ones)
        p = ctx.work / f"{ctx.bf16.name}-prompts.json"
        got = json.loads(p.read_text()) if p.exists() else {}
        if got.get("built_from") != _built_from(ctx):
            got = heldout_prompts(ctx.bf16) | {"built_from": _built_from(ctx)}
            p.write_text(json.dumps(got))
        ctx.facts["prompts"] = got
    prompts = ctx.facts["prompts"]["prompts"]
    e = ctx.start_engine(trained_engines(ctx)[name], TRAINED_PORTS[name])
    try:
        ctx.wait_engine(name, 600)
        res = {"ready_s": e.ready_s, "model": str(e.model), "prompt_source": ctx.facts["prompts"]["source"]}
        res["greedy"] = greedy(e.url, e.model_id, prompts[:GREEDY_PROMPTS], GREEDY_TOKENS)
        res["decode"] = {
            str(b): decode(e.url, e.model_id, b, 256, pool=prompts[GREEDY_PROMPTS:]) for b in (1, 8)
        }
    finally:
        res_stop = ctx.stop_engine(name)
    return res | {"stop": res_stop}


def st_tb_bf16(ctx: Ctx) -> dict:
    """The bf16 base with the fleet's flags (no quantization) and MTP x3, alone on the GPU."""
    res = _trained_engine(ctx, "tb-bf16")
    (ctx.work / f"{ctx.bf16.name}-bf16-engine.json").write_text(
        json.dumps(res | {"built_from": _built_from(ctx)})
    )
    return res


def st_tb_build(ctx: Ctx) -> dict:
    """`pipeline dev served-base` of the base unless WORK already holds this base's NVFP4 build (nothing
    else on the GPU meanwhile: stage tb_bf16 stopped its engine)."""
    if nvfp4_current(ctx):
        return {"nvfp4": str(ctx.nvfp4), "reused": True}
    ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
    res = ctx.wait_bg("served-base", 900)
    mark_built(ctx)
    q = json.loads((ctx.nvfp4 / "hf_quant_config.json").read_text())
    return {"nvfp4": str(ctx.nvfp4), "wall_s": res["wall_s"], "quantization": q.get("quantization", q),
            "size_gb": round(_du(ctx.nvfp4) / 1e9, 2)}  # fmt: skip


def st_tb_nvfp4(ctx: Ctx) -> dict:
    """The NVFP4 build with the fleet's flags and MTP x3, alone on the GPU; its greedy tokens against the
    bf16 engine's on the same prompts (stage tb_bf16, this call or an earlier one on this machine)."""
    ref_p = ctx.work / f"{ctx.bf16.name}-bf16-engine.json"
    if not ref_p.exists():
        raise RuntimeError(f"no bf16 engine result ({ref_p}): stage tb_bf16 did not run on this machine")
    ref = json.loads(ref_p.read_text())
    if ref.get("built_from") != _built_from(ctx):
        raise RuntimeError(
            f"{ref_p} was measured on another base ({ref.get('built_from')}): run stage tb_bf16 again"
        )
    res = _trained_engine(ctx, "tb-nvfp4")
    res["vs_bf16"] = {
        "agreement": agreement(ref["greedy"]["tokens"], res["greedy"]["tokens"]),
        "decode_ratio_nvfp4_over_bf16": {
            b: round(res["decode"][b]["tok_s"] / ref["decode"][b]["tok_s"], 3) for b in res["decode"]
        },
    }
    return res


def trained_summary(
    base: dict | None, bf16: dict | None, build: dict | None, nvfp4: dict | None
) -> dict | None:
    """The record's `trained` block: per engine acceptance, decode medians with their spread, and the
    NVFP4 engine's greedy agreement with the bf16 one (token lists stay in OUT/stages)."""
    if not (bf16 or nvfp4):
        return None

    def eng(r):
        if not r:
            return None
        g = r.get("greedy") or {}
        return {
            "ready_s": r.get("ready_s"),
            "greedy_acceptance_length": g.get("acceptance_length"),
            "greedy_acceptance_per_position": g.get("acceptance_per_position"),
            "decode": {
                b: {
                    k: d.get(k)
                    for k in (
                        "tok_s",
                        "tok_s_min",
                        "tok_s_max",
                        "repeats",
                        "acceptance_length",
                        "tpot_ms",
                        "gpu_apps",
                    )
                }
                for b, d in (r.get("decode") or {}).items()
            },  # fmt: skip
        }

    return {
        "base": base,
        "prompts": {
            "source": (bf16 or nvfp4 or {}).get("prompt_source"),
            "greedy": GREEDY_PROMPTS,
            "length": PROMPT_LEN,
            "greedy_tokens": GREEDY_TOKENS,
        },  # fmt: skip
        "bf16": eng(bf16),
        "nvfp4_build": build,
        "nvfp4": eng(nvfp4),
        "nvfp4_vs_bf16": (nvfp4 or {}).get("vs_bf16"),
    }
