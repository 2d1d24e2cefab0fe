"""Plan trained: a prebuilt trained base, its bf16 then its NVFP4 engine, one at a time on the GPU."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import REPO
from .engines import TRAINED_PORTS, _du, drafter_checkpoint_of, trained_engines
from .measure import agreement, answers, decode, greedy, lora
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


def _prompts(ctx: Ctx) -> list:
    if "prompts" not in ctx.facts:  # one set per base (a base of the same name rebuilt gets new ones)
        p = ctx.work / f"{ctx.bf16.name}-prompts.json"
        got = json.loads(p.read_text()) if p.exists() else {}
        if got.get("built_from") != _built_from(ctx):
            got = heldout_prompts(ctx.bf16) | {"built_from": _built_from(ctx)}
            p.write_text(json.dumps(got))
        ctx.facts["prompts"] = got
    return ctx.facts["prompts"]["prompts"]


TASK_NEW = 64  # greedy tokens at most per task answer (benchmarks/trained_adapters.py --max-new)


def _stop_ids(base: Path) -> set[int]:
    """EOS ids of the base (generation_config.json, else config.json), dropped from answers before comparing."""
    for f in ("generation_config.json", "config.json"):
        p = base / f
        if p.is_file():
            c = json.loads(p.read_text())
            e = c.get("eos_token_id", (c.get("text_config") or {}).get("eos_token_id"))
            if e is not None:
                return set(e) if isinstance(e, list) else {e}
    return set()


def task_pass(ctx: Ctx, url: str, task: str, a: dict) -> dict:
    """Task adapter `task` served by the engine at `url`: its greedy answers to the held-out prompts (EOS
    ends them), their agreement with the PEFT reference in bf16 and float32, the task metric, MTP acceptance."""
    from tokenizers import Tokenizer

    from pipeline.canary.task import score, summarise

    stop = _stop_ids(ctx.bf16)
    got = answers(url, task, a["prompts"], TASK_NEW, stop)
    tok = Tokenizer.from_file(str(ctx.bf16 / "tokenizer.json"))
    texts = [tok.decode(t, skip_special_tokens=True) for t in got["tokens"]]
    metric = summarise(
        a["metric"], [score(a["metric"], e, x) for e, x in zip(a["expected"], texts, strict=True)]
    )

    def ref(dtype):
        r = [[t for t in x if t not in stop] for x in a["reference"][dtype]["tokens"]]
        return agreement(r, got["tokens"])

    return {"metric": metric, "examples": texts[:3], "vs_peft_bf16": ref("bfloat16"), "vs_peft_fp32": ref("float32"),
            "peft_metric": {d: a["reference"][d]["metric"] for d in ("bfloat16", "float32")},
            **{k: got[k] for k in ("acceptance_length", "acceptance_rate", "acceptance_per_position")}}  # fmt: skip


def task_adapters(ctx: Ctx, wait_s: float = 0.0) -> dict:
    """The task adapters of `--task-adapters FILE` (benchmarks/trained_adapters.py, possibly still running in
    the background on this machine): waits up to `wait_s` for its `FILE.done` marker; {} without the option,
    or when the file is not done in time (the base's figures are measured anyway)."""
    if "task_adapters" in ctx.facts or "task_adapters_path" not in ctx.facts:
        return ctx.facts.get("task_adapters") or {}
    p: Path = ctx.facts["task_adapters_path"]
    done = p.with_name(p.name + ".done")
    limit = time.time() + max(0.0, min(wait_s, ctx.left()))
    while not done.exists() and time.time() < limit:
        time.sleep(2.0)
    if not done.exists():
        ctx.log(f"task adapters: {done} not there after {wait_s:.0f} s: measuring the base only")
        return {}
    ctx.facts["task_adapters"] = json.loads(p.read_text())
    return ctx.facts["task_adapters"]


def _adapter_rows(ctx: Ctx, e, prompts: list, res: dict, base_rows: bool = True) -> None:
    """The task adapters on engine `e`: each one's task pass, then the decode rows of the first (toolcall when
    it trained): on the held-out corpus prompts (the base rows' prompts: the LoRA kernels' cost and the drafts'
    acceptance on the same text) and on its own task prompts, EOS ending each answer (its real traffic)."""
    ads = {t: a for t, a in task_adapters(ctx, wait_s=ctx.left() - 150).items() if a.get("adapter")}
    if not ads:
        return
    for t, a in ads.items():
        lora(e.url, "load", lora_name=t, lora_path=a["adapter"])
    res["adapters"] = {t: task_pass(ctx, e.url, t, a) for t, a in ads.items()}
    first = "toolcall" if "toolcall" in ads else next(iter(ads))
    pool = prompts[GREEDY_PROMPTS:]
    task_pool = ads[first]["prompts"]
    res["decode_adapter"] = {
        "adapter": first,
        **{str(b): decode(e.url, first, b, 256, pool=pool) for b in (1, 8)},
    }
    res["decode_task"] = {"adapter": first, **{
        f"{who}-{b}": decode(e.url, m, b, TASK_NEW, pool=task_pool, ignore_eos=False)
        for who, m in (("adapter", first), ("base", e.model_id)) for b in (1, 8) if base_rows or who == "adapter"
    }}  # fmt: skip


def _trained_engine(ctx: Ctx, name: str) -> dict:
    """Start engine `name` of `trained_engines` alone on the GPU, measure, stop it: ready time, greedy
    tokens + acceptance on the held-out prompts, decode rows at batch 1 and 8 (warm-up + REPEATS), then the
    task adapters (`_adapter_rows`) when benchmarks/trained_adapters.py trained them."""
    prompts = _prompts(ctx)
    e = ctx.start_engine(trained_engines(ctx)[name], TRAINED_PORTS[name])
    try:
        ctx.wait_engine(name, 600)
        res = {"ready_s": e.ready_s, "model": str(e.model), "prompt_source": ctx.facts["prompts"]["source"]}
        res["greedy"] = greedy(e.url, e.model_id, prompts[:GREEDY_PROMPTS], GREEDY_TOKENS)
        res["decode"] = {
            str(b): decode(e.url, e.model_id, b, 256, pool=prompts[GREEDY_PROMPTS:]) for b in (1, 8)
        }
        try:
            _adapter_rows(ctx, e, prompts, res)
        except Exception as x:  # the base's figures stand without the adapters'
            res["adapters_error"] = f"{type(x).__name__}: {x}"[:2000]
    finally:
        res_stop = ctx.stop_engine(name)
    return res | {"stop": res_stop}


def st_tb_bf16(ctx: Ctx) -> dict:
    """The bf16 base with the fleet's flags (no quantization) and MTP x3, alone on the GPU (reused when an
    earlier call on this machine measured this very base with the same adapters)."""
    p = ctx.work / f"{ctx.bf16.name}-bf16-engine.json"
    key = {"built_from": _built_from(ctx), "adapters": sorted(task_adapters(ctx))}
    if p.exists() and {k: json.loads(p.read_text()).get(k) for k in key} == key:
        return json.loads(p.read_text()) | {"reused": True}
    res = _trained_engine(ctx, "tb-bf16")
    # what it measured (maybe more than at start)
    key["adapters"] = sorted(ctx.facts.get("task_adapters") or {})
    p.write_text(json.dumps(res | key))
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


def _vs(ref: dict, res: dict) -> dict:
    """An engine's greedy tokens and decode medians against the bf16 engine's (same prompts)."""
    out = {
        "agreement": agreement(ref["greedy"]["tokens"], res["greedy"]["tokens"]),
        "decode_ratio_nvfp4_over_bf16": {
            b: round(res["decode"][b]["tok_s"] / ref["decode"][b]["tok_s"], 3) for b in res["decode"]
        },
    }
    if ref.get("adapters") and res.get("adapters"):
        out["adapters_task_metric_bf16_engine"] = {t: a["metric"] for t, a in ref["adapters"].items()}
    return out


def _bf16_result(ctx: Ctx) -> dict:
    ref_p = ctx.work / f"{ctx.bf16.name}-bf16-engine.json"
    if not ref_p.exists():
        raise RuntimeError(f"no bf16 engine result ({ref_p}): stage tb_bf16 did not run on this machine")
    ref = json.loads(ref_p.read_text())
    if ref.get("built_from") != _built_from(ctx):
        raise RuntimeError(
            f"{ref_p} was measured on another base ({ref.get('built_from')}): run stage tb_bf16 again"
        )
    return ref


def st_tb_nvfp4(ctx: Ctx) -> dict:
    """The NVFP4 build with the fleet's flags and MTP x3, alone on the GPU; its greedy tokens against the
    bf16 engine's on the same prompts (stage tb_bf16, this call or an earlier one on this machine). Reused
    when an earlier call on this machine measured it after that bf16 result."""
    ref = _bf16_result(ctx)
    p = ctx.work / f"{ctx.bf16.name}-nvfp4-engine.json"
    if p.exists() and json.loads(p.read_text()).get("bf16_ready_s") == ref.get("ready_s"):
        return json.loads(p.read_text()) | {"reused": True}
    res = _trained_engine(ctx, "tb-nvfp4")
    res["vs_bf16"] = _vs(ref, res)
    p.write_text(json.dumps(res | {"bf16_ready_s": ref.get("ready_s")}))
    return res


DRAFTER_WAIT_S = 420.0  # the drafters train after the adapters: how long stage tb_drafter waits for them


def st_tb_drafter(ctx: Ctx) -> dict:
    """The NVFP4 engine drafting with a task adapter's own drafter (its served checkpoint with the drafter's
    `mtp.*`, `speculative_config.model`), alone on the GPU: the same base and adapter rows as stage tb_nvfp4."""
    task_adapters(ctx, wait_s=DRAFTER_WAIT_S)
    if "tb-nvfp4-drafter" not in trained_engines(ctx):
        raise RuntimeError(
            "no task adapter has a drafter checkpoint (benchmarks/trained_adapters.py --served)"
        )
    res = _trained_engine(ctx, "tb-nvfp4-drafter")
    res["drafter_of"] = drafter_checkpoint_of(ctx)
    try:
        res["vs_bf16"] = _vs(_bf16_result(ctx), res)
    except RuntimeError as e:
        res["vs_bf16"] = {"unavailable": str(e)}
    return res


_ROW_KEYS = ("tok_s", "tok_s_min", "tok_s_max", "repeats", "acceptance_length", "tpot_ms", "per_request_tok_s",
             "ignore_eos", "max_tokens", "gpu_apps")  # fmt: skip


def _rows(d: dict | None) -> dict | None:
    return (
        None
        if not d
        else {b: ({k: r.get(k) for k in _ROW_KEYS} if isinstance(r, dict) else r) for b, r in d.items()}
    )


def _adapters(r: dict) -> dict | None:
    """Per task adapter on one engine: the task metric, token agreement with PEFT bf16 / float32, acceptance."""
    if not r.get("adapters"):
        return {"error": r["adapters_error"]} if r.get("adapters_error") else None
    out = {}
    for t, a in r["adapters"].items():
        out[t] = {
            "task_metric": a["metric"],
            "peft_task_metric": a.get("peft_metric"),
            "token_agreement_vs_peft_bf16": a["vs_peft_bf16"]["token_agreement"],
            "token_agreement_vs_peft_fp32": a["vs_peft_fp32"]["token_agreement"],
            "prefix_agreement_vs_peft_fp32": a["vs_peft_fp32"]["prefix_agreement"],
            "acceptance_length": a.get("acceptance_length"),
            "acceptance_per_position": a.get("acceptance_per_position"),
        }
    return out


def trained_summary(
    base: dict | None, bf16: dict | None, build: dict | None, nvfp4: dict | None, drafter: dict | None = None
) -> dict | None:
    """The record's `trained` block: per engine acceptance, decode medians with their spread, the task
    adapters' metric / parity / acceptance, and the NVFP4 engines' greedy agreement with the bf16 one (token
    lists stay in OUT/stages)."""
    if not (bf16 or nvfp4 or drafter):
        return None

    def eng(r):
        if not r:
            return None
        g = r.get("greedy") or {}
        return {
            "ready_s": r.get("ready_s"),
            "greedy_acceptance_length": g.get("acceptance_length"),
            "greedy_acceptance_per_position": g.get("acceptance_per_position"),
            "decode": _rows(r.get("decode")),
            "decode_adapter": _rows(r.get("decode_adapter")),
            "decode_task": _rows(r.get("decode_task")),
            "adapters": _adapters(r),
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
        "nvfp4_drafter": eng(drafter),
        "drafter_of": (drafter or {}).get("drafter_of"),
        "nvfp4_drafter_vs_bf16": (drafter or {}).get("vs_bf16"),
    }
