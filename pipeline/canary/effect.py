"""Does the adapter's effect survive the served base (e.g. NVFP4)? Teacher-forced shifts, engine vs reference.

Token agreement with a bf16 reference cannot answer it on a quantized base: the quantized base itself
disagrees with the bf16 base (that is the base's gap), so the adapter's agreement mixes its own
effect with the base's quantization error. The measure here compares what the adapter *changes*:

For each canary prompt, take the engine's greedy continuation through the adapter, y (tokens
y_1..y_n). Score y teacher-forced four ways (log-probability of y_t given the prompt and y_<t):
the engine with and without the adapter (`prompt_logprobs` of a completion request, vLLM's
sampling_params.py: such requests skip reading the prefix cache), and the PEFT reference (the bf16
base the adapter was trained on) with and without it. Per token, the adapter's shift is

    d_ref(t) = lp_ref_adapter(y_t) - lp_ref_base(y_t),   d_eng(t) = lp_eng_adapter(y_t) - lp_eng_base(y_t)

(nats). Figures over all positions of all prompts:
- `reference_nats` = mean d_ref: how much the adapter, as trained, prefers its continuation;
- `engine_nats` = mean d_eng: the same on the served engine;
- `retention` = engine_nats / reference_nats: 1.0 when the served adapter moves the served base as
  far as training's adapter moves the bf16 base; 0 when the engine's adapter does nothing; None when
  the reference shift is below `MIN_REFERENCE_NATS` (an adapter without effect has nothing to keep);
- `correlation`: Pearson correlation of d_eng and d_ref over positions (whether the same tokens move);
- `base_gap_nats` = mean |lp_eng_base - lp_ref_base|: how far the served base is from the bf16 base on
  these tokens, the scale against which `engine_nats` should be read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.serving.vllm import usable_logprob

MIN_REFERENCE_NATS = 0.05


@dataclass
class Effect:
    positions: int
    reference_nats: (
        float  # mean teacher-forced log-prob gain of the adapter's continuation, PEFT on the bf16 base
    )
    engine_nats: float  # the same on the engine (served base + hot-loaded adapter)
    retention: float | None  # engine_nats / reference_nats
    correlation: float | None  # Pearson r of the per-token shifts
    base_gap_nats: float  # mean |engine base - reference base| log-prob of the same tokens
    adapter_gap_nats: float  # mean |engine adapter - reference adapter|
    # positions left out because the ENGINE gave no finite log-probability (NaN, inf, vLLM's -9999 clamp of
    # -inf) where the reference's were finite: an engine that puts no mass on a real token is broken there
    engine_unusable: int = 0


def _pearson(a: list[float], b: list[float]) -> float | None:
    n = len(a)
    if n < 2:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va <= 0 or vb <= 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / math.sqrt(va * vb)


def measure(
    eng_adapter: list[list[float]],
    eng_base: list[list[float]],
    ref_adapter: list[list[float]],
    ref_base: list[list[float]],
) -> Effect | None:
    """Effect figures from per-prompt lists of teacher-forced log-probs of the same tokens (nats).

    The four arguments hold, per prompt, one value per continuation token; prompts must line up and
    each prompt's four lists have one length. Non-finite values (vLLM clamps -inf to -9999) drop that
    position; those where only the engine's are non-finite are counted in `engine_unusable`. Returns
    None when no position is left. Raises ValueError when the lists do not line up.
    """
    d_eng, d_ref, gap_b, gap_a = [], [], [], []
    engine_unusable = 0
    for i, rows in enumerate(zip(eng_adapter, eng_base, ref_adapter, ref_base, strict=True)):
        if len({len(r) for r in rows}) != 1:
            raise ValueError(
                f"prompt {i}: teacher-forced scores of different lengths {[len(r) for r in rows]}"
            )
        for ea, eb, ra, rb in zip(*rows, strict=True):
            if not (usable_logprob(ra) and usable_logprob(rb)):
                continue
            if not (usable_logprob(ea) and usable_logprob(eb)):
                engine_unusable += 1
                continue
            d_eng.append(ea - eb)
            d_ref.append(ra - rb)
            gap_b.append(abs(eb - rb))
            gap_a.append(abs(ea - ra))
    if not d_eng:
        return None
    n = len(d_eng)
    ref, eng = sum(d_ref) / n, sum(d_eng) / n
    return Effect(
        positions=n,
        reference_nats=ref,
        engine_nats=eng,
        retention=eng / ref if abs(ref) >= MIN_REFERENCE_NATS else None,
        correlation=_pearson(d_eng, d_ref),
        base_gap_nats=sum(gap_b) / n,
        adapter_gap_nats=sum(gap_a) / n,
        engine_unusable=engine_unusable,
    )
