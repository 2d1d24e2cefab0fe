"""Measurements over HTTP: completions, /metrics, decode rows (warm-up + repeats), greedy agreement."""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pipeline.canary import prom

from .engines import gpu_apps

FIELD_REPORT = {"base_tok_s": 161.4, "adapter_tok_s": 90.0, "ratio": round(90.0 / 161.4, 3)}


def complete(url: str, model: str, prompt, max_tokens: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code >= 400:
        raise RuntimeError(f"{url} {model}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def lora(url: str, action: str, **body) -> None:
    r = httpx.post(f"{url}/v1/{action}_lora_adapter", json=body, timeout=300)
    if r.status_code >= 400:
        raise RuntimeError(f"{url} {action} {body}: HTTP {r.status_code}: {r.text[:500]}")


def served_adapters(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c.get("root") for c in data if c.get("parent")}


DEFAULT_IDS = range(16, 1024)  # the tiny tokenizer's ordinary ids (prompt_ids says why); bases set their own


def random_prompts(n: int, length: int, ids=DEFAULT_IDS, seed: int = 0) -> list[list[int]]:
    """`n` distinct prompts of random token ids drawn from `ids` (no shared prefix: the prefix cache does not help)."""
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def _spec(before: dict, after: dict, pos_before: dict, pos_after: dict) -> dict:
    d = prom.delta(before, after)
    drafts, dt_, acc = d.get(prom.SPEC_DRAFTS), d.get(prom.SPEC_DRAFT_TOKENS), d.get(prom.SPEC_ACCEPTED)
    tpot_n = d.get(prom.TPOT_COUNT)
    return {
        "acceptance_length": round(1 + acc / drafts, 4) if drafts else None,
        "acceptance_rate": round(acc / dt_, 4) if dt_ else None,
        "acceptance_per_position": [
            round((pos_after[k] - pos_before.get(k, 0.0)) / drafts, 4) for k in sorted(pos_after, key=int)
        ]
        if drafts and pos_after
        else None,
        "tpot_ms": round(1000 * d[prom.TPOT_SUM] / tpot_n, 3) if tpot_n else None,
        "generation_tokens": d.get(prom.GENERATION_TOKENS),
    }


def _scrape(url: str) -> tuple[dict, dict]:
    text = metrics(url)
    return prom.counters(text), prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position")


REPEATS = 3  # timed passes of every decode row, after one untimed warm-up pass of the same shape


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _pass(url: str, model: str, prompts: list, max_tokens: int, ignore_eos: bool = True) -> dict:
    """One timed pass: `prompts` sent at once, greedy, `max_tokens` each (EOS ignored unless `ignore_eos` is
    False); /metrics around it."""
    before, pb = _scrape(url)
    t = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(
            pool.map(lambda p: complete(url, model, p, max_tokens, ignore_eos=ignore_eos), prompts)
        )
    wall = time.perf_counter() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    deadline = time.monotonic() + 3
    while True:  # the last step's stats reach /metrics as its outputs are handed out
        after, pa = _scrape(url)
        if (
            after.get(prom.GENERATION_TOKENS, 0) - before.get(prom.GENERATION_TOKENS, 0) >= tokens
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    return {"tokens": tokens, "wall_s": wall, "before": (before, pb), "after": (after, pa)}


def decode(url: str, model: str, batch: int, max_tokens: int, prompt_len: int = 48, seed: int = 1, *, ids=DEFAULT_IDS,
           repeats: int = REPEATS, pool: list | None = None, ignore_eos: bool = True) -> dict:  # fmt: skip
    """Decode speed of `model` with `batch` concurrent greedy requests of `max_tokens` (EOS ignored; with
    `ignore_eos=False` each answer ends at its EOS, as real traffic does, and tok_s counts what came):
    one untimed warm-up pass of the same shape (CUDA graphs, Triton kernels, the LoRA slot), then
    `repeats` timed passes, each on prompts of its own (no prefix-cache hit between passes).

    Prompts: `batch` random ones of `prompt_len` ids from `ids` per pass, or taken in turn from `pool`.
    tok_s: the median over the repeats of generated tokens / client wall time of the batch (prefill
    included), with `tok_s_min`/`tok_s_max`/`tok_s_runs`; per_request_tok_s: 1 / the engine's mean time
    per output token (decode only, all repeats); MTP figures from the /metrics difference over all
    repeats (the engine serves nothing else meanwhile). `gpu_apps`: the GPU's processes as timing began.
    """

    def prompts(r: int) -> list:
        if pool:
            return [pool[(r * batch + j) % len(pool)] for j in range(batch)]
        return random_prompts(batch, prompt_len, ids, seed=seed + 1000 * r)

    _pass(url, model, prompts(0), max_tokens, ignore_eos)  # warm-up
    apps = gpu_apps()
    runs = [_pass(url, model, prompts(r), max_tokens, ignore_eos) for r in range(1, repeats + 1)]
    tok_s = [x["tokens"] / x["wall_s"] for x in runs]
    s = _spec(runs[0]["before"][0], runs[-1]["after"][0], runs[0]["before"][1], runs[-1]["after"][1])
    return {
        "model": model,
        "batch": batch,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "repeats": repeats,
        "tokens": sum(x["tokens"] for x in runs),
        "wall_s": round(sum(x["wall_s"] for x in runs), 3),
        "tok_s": round(_median(tok_s), 1),
        "tok_s_min": round(min(tok_s), 1),
        "tok_s_max": round(max(tok_s), 1),
        "tok_s_runs": [round(x, 1) for x in tok_s],
        "per_request_tok_s": round(1000 / s["tpot_ms"], 1) if s["tpot_ms"] else None,
        "gpu_apps": apps,
        **s,
    }


def decode_table(url: str, base: str, adapter: str, batches=(1, 8), max_tokens: int = 256, *, ids=DEFAULT_IDS,
                 repeats: int = REPEATS, pool: list | None = None) -> dict:  # fmt: skip
    """`decode` of the base and of the adapter at each batch size (each row warmed up, then `repeats`
    timed passes: the first H200 run timed the base while vLLM's Triton kernels were still being
    compiled at first use, and reported base < adapter); ratios of the medians."""
    rows = [
        decode(url, m, b, max_tokens, ids=ids, repeats=repeats, pool=pool)
        for m in (base, adapter)
        for b in batches
    ]
    by = {(r["model"], r["batch"]): r for r in rows}
    b1 = batches[0]
    ratio = by[(adapter, b1)]["tok_s"] / by[(base, b1)]["tok_s"]

    def per(key):
        return {
            k: {str(b): by[(m, b)][key] for b in batches} for k, m in (("base", base), ("adapter", adapter))
        }

    return {
        "rows": rows,
        "tok_s": per("tok_s"),
        "tok_s_range": {
            k: {str(b): [by[(m, b)]["tok_s_min"], by[(m, b)]["tok_s_max"]] for b in batches}
            for k, m in (("base", base), ("adapter", adapter))
        },
        "acceptance_length": per("acceptance_length"),
        "ratio_adapter_over_base": {
            str(b): round(by[(adapter, b)]["tok_s"] / by[(base, b)]["tok_s"], 3) for b in batches
        },
        "field_report": FIELD_REPORT | {"ratio_here_batch1": round(ratio, 3)},
    }


def _answer(url: str, model: str, prompt, k: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probs (nats)."""
    ch = complete(url, model, prompt, k, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
    lp = ch["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]


def _gap(x, y) -> float:
    """inf when the greedy tokens differ or a log-prob is not finite (max() would drop a NaN), else the
    largest log-prob difference of the same tokens."""
    if x[0] != y[0]:
        return float("inf")
    diffs = [abs(p - q) for p, q in zip(x[1], y[1], strict=True)]
    if any(not math.isfinite(d) for d in diffs):
        return float("inf")
    return max(diffs, default=0.0)


def greedy(url: str, model: str, prompts: list, k: int) -> dict:
    """Each prompt's `k` greedy token ids (EOS ignored, one request at a time: no batch effects on the
    numerics), with MTP acceptance from the /metrics difference over the whole pass."""
    before, pb = _scrape(url)
    tokens = [
        complete(url, model, p, k, ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True)
        for p in prompts
    ]
    ids = [[int(t.split(":", 1)[1]) for t in r["choices"][0]["logprobs"]["tokens"]] for r in tokens]
    time.sleep(0.5)
    after, pa = _scrape(url)
    return {"tokens": ids, **_spec(before, after, pb, pa)}


def answers(url: str, model: str, prompts: list, k: int, stop_ids=()) -> dict:
    """Each prompt's greedy answer (token ids, at most `k`, ending at EOS as served traffic does; trailing
    `stop_ids` dropped so that engine and reference compare the same tokens), one request at a time, with MTP
    acceptance from the /metrics difference over the pass."""
    before, pb = _scrape(url)
    out = []
    for p in prompts:
        r = complete(url, model, p, k, logprobs=1, return_tokens_as_token_ids=True)
        ids = [int(t.split(":", 1)[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
        while ids and ids[-1] in stop_ids:
            ids.pop()
        out.append(ids)
    time.sleep(0.5)
    after, pa = _scrape(url)
    return {"tokens": out, **_spec(before, after, pb, pa)}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy agreement of `got` with `ref` (same prompts): the share of positions with the same token,
    the share before each prompt's first divergence (after it the texts differ, so later positions
    compare different contexts), identical sequences, and each prompt's first divergence (None: none)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference sequences vs {len(got)}")
    positions = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=False))
    first = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), None)
        for r, g in zip(ref, got, strict=True)
    ]
    first = [
        f if f is not None or len(r) == len(g) else min(len(r), len(g))
        for f, r, g in zip(first, ref, got, strict=True)
    ]
    before = sum(len(r) if f is None else f for r, f in zip(ref, first, strict=True))
    return {
        "token_agreement": round(same / positions, 4) if positions else None,
        "prefix_agreement": round(before / positions, 4) if positions else None,
        "identical_sequences": sum(f is None for f in first),
        "sequences": len(ref),
        "positions": positions,
        "first_divergence": first,
    }
