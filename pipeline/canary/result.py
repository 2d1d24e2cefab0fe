"""Canary results and their verdict: parity with the PEFT reference, speed, the thresholds that judge them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from pipeline.canary.effect import MIN_REFERENCE_NATS, Effect
from pipeline.canary.prompts import Prompt
from pipeline.config import CanarySection
from pipeline.errors import CheckFailed
from pipeline.figures import figures
from pipeline.findings import Finding
from pipeline.serving.vllm import usable_logprob


class CanaryError(CheckFailed):
    """The canary could not run (staging unreachable, adapter refused, reference unloadable)."""


@dataclass
class EngineOutput:
    tokens: list[int]
    top: list[dict[int, float]]  # per generated position: {token id: logprob}


@dataclass
class Parity:
    """Engine vs reference for one model (base or adapter) over the canary set."""

    positions: int
    agreement: float  # (exact + tied) / positions
    exact: int
    tied: int  # engine token != reference argmax, but within tie_margin nats of it
    first_divergence: int | None  # earliest position (over prompts) where the reference's argmax differs
    first_divergence_prompt: str | None
    diverged_prompts: int
    max_logprob_diff: float
    max_logprob_diff_at: str | None  # "label@position"
    per_prompt: list[dict] = field(default_factory=list)


@dataclass
class Speed:
    """Figures of one pass from the /metrics difference; None where the engine does not report them."""

    requests: int
    output_tokens: int
    drafts: float | None
    draft_tokens: float | None
    accepted_tokens: float | None
    acceptance_rate: float | None  # accepted / draft tokens
    mean_acceptance_length: float | None  # 1 + accepted / drafts (tokens per engine step)
    tpot_s: float | None  # mean per-request time per output token, seconds (engine histogram)
    wall_s_per_token: float  # client wall time / output tokens, seconds (includes prefill and HTTP)
    other_traffic: bool  # the engine generated more tokens than these requests did
    # per draft position k: accepted at k / drafts (k = 0 .. num_speculative_tokens - 1)
    acceptance_per_position: list[float] | None = None


@dataclass
class CanaryResult:
    adapter: str
    staging: str
    engine_name: str
    served: dict
    prompts: list[str]
    max_tokens: int
    parity: dict[str, Parity]  # "base", "adapter"
    speed: dict[str, Speed]
    speed_ratio: float | None  # base TPOT / adapter TPOT (adapter speed relative to base)
    acceptance_ratio: float | None  # adapter / base mean acceptance length
    tolerance: dict
    engine_adapter_equals_base: bool
    findings: list[Finding]  # canary.* errors: what failed, where, how to fix
    notes: list[str]
    weights_sha256: str | None
    time: str
    seconds: float
    unloaded: bool = True
    effect: Effect | None = None  # the adapter's teacher-forced shift, engine vs reference (canary.effect)

    @property
    def problems(self) -> list[str]:
        """The messages of the failed checks (empty: pass)."""
        return [f.message for f in self.findings if f.severity == "error"]

    @property
    def verdict(self) -> Literal["pass", "fail"]:
        return "fail" if self.problems else "pass"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["problems"] = self.problems
        d["verdict"] = self.verdict
        return d


# -- comparison -----------------------------------------------------------------------------------------------------
def compare(prompts: list[Prompt], outs: list[EngineOutput], scores, tie_margin: float) -> Parity:
    """Parity figures from engine outputs and the reference's `PositionScore`s (same order)."""
    positions = exact = tied = diverged = 0
    first, first_at, max_diff, max_at, per = None, None, 0.0, None, []
    for p, o, sc in zip(prompts, outs, scores, strict=True):
        div = None
        p_max = 0.0
        for j, (tok, s) in enumerate(zip(o.tokens, sc, strict=True)):
            positions += 1
            if s.argmax == tok:
                exact += 1
            else:
                div = j if div is None else div
                if s.argmax_logprob - s.logprobs.get(tok, -math.inf) <= tie_margin:
                    tied += 1
            for t, lp in (o.top[j] if j < len(o.top) else {}).items():
                if t in s.logprobs:
                    # a NaN or inf (or vLLM's -9999 clamp of -inf) on either side is no agreement: skipping
                    # it let an engine returning NaN for every log-probability pass max_logprob_diff with 0.0
                    diff = (
                        abs(lp - s.logprobs[t])
                        if usable_logprob(lp) and usable_logprob(s.logprobs[t])
                        else math.inf
                    )
                    p_max = max(p_max, diff)
                    if diff > max_diff:
                        max_diff, max_at = diff, f"{p.label}@{j}"
        if div is not None:
            diverged += 1
            if first is None or div < first:
                first, first_at = div, p.label
        per.append(
            {
                "prompt": p.label,
                "tokens": len(o.tokens),
                "first_divergence": div,
                "max_logprob_diff": round(p_max, 6),
            }
        )
    return Parity(
        positions=positions,
        agreement=(exact + tied) / positions if positions else 0.0,  # no token compared: nothing agreed
        exact=exact,
        tied=tied,
        first_divergence=first,
        first_divergence_prompt=first_at,
        diverged_prompts=diverged,
        max_logprob_diff=max_diff,
        max_logprob_diff_at=max_at,
        per_prompt=per,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def judge(c: CanarySection, res: CanaryResult, rank_notes: list[str], outside: list[str]) -> None:
    """Fill `res.tolerance` and `res.findings` (ids `canary.*`, each message: what, where, how to fix)
    from the thresholds of `c` (`canary` in pipeline.yaml)."""
    base, ad = res.parity["base"], res.parity["adapter"]
    quantized = bool(res.served.get("quantized"))
    min_agree, max_diff = c.min_token_agreement, c.max_logprob_diff
    base_ok = base.agreement >= min_agree and base.max_logprob_diff <= max_diff
    if quantized:  # the engine's own gap on the base is the floor of what the adapter can reach
        min_agree = min(min_agree, base.agreement - (1 - c.min_token_agreement))
        max_diff = max(max_diff, c.base_gap_factor * base.max_logprob_diff)
    res.tolerance = {
        "min_token_agreement": round(min_agree, 6),
        "max_logprob_diff": round(max_diff, 6),
        "quantized": quantized,
        "from_base_gap": quantized,
    }
    where = f"staging {res.staging} ({res.served.get('engine_model')})"
    if not _finite(base.max_logprob_diff):
        # an unbounded base gap would widen a quantized tolerance to infinity (any adapter passes)
        res.findings.append(
            Finding(
                "canary.base_gap",
                "error",
                f"a NaN, infinite or -inf-clamped (-9999) log-probability on the BASE alone at "
                f"{base.max_logprob_diff_at} on {where} (engine or PEFT reference): the base gap is unbounded "
                f"and no tolerance can be set from it; check the served checkpoint, the engine's dtype and --base",
                where,
            )
        )
    for key, check in (("base", "canary.base_gap"), ("adapter", "canary.adapter_parity")):
        if res.parity[key].positions == 0:
            res.findings.append(
                Finding(
                    check,
                    "error",
                    f"the {key} pass generated no token to compare on {where} ({len(res.prompts)} prompts): "
                    f"parity is not measured; check the engine's replies carry logprobs (--max-logprobs >= "
                    f"canary.top_logprobs) and that the prompts fit its max_model_len",
                    where,
                )
            )
    if quantized and base.agreement < c.min_quantized_base_agreement:
        # A tolerance widened to a base that hardly agrees is no test: measured on the H200 (2026-12-02,
        # benchmarks/RESULTS.md), an NVFP4 base agreeing on 0.023 made the floor -0.027 and the max diff 9.6 nats.
        res.findings.append(
            Finding(
                "canary.base_gap",
                "error",
                f"the quantized base alone agrees with the reference on {base.agreement:.3f} of tokens (floor "
                f"canary.min_quantized_base_agreement {c.min_quantized_base_agreement}; max logprob diff "
                f"{base.max_logprob_diff:.4f} nats at {base.max_logprob_diff_at}) on {where}: a tolerance widened to "
                f"that gap (min agreement {min_agree:.3f}, max diff {max_diff:.4f}) cannot tell a misapplied adapter "
                f"from quantization; check that the served checkpoint is a quantization of this base, or run the "
                f"canary on a staging instance serving the unquantized base",
                where,
            )
        )
    if not base_ok and not quantized and _finite(base.max_logprob_diff) and base.positions:
        res.findings.append(
            Finding(
                "canary.base_gap",
                "error",
                f"engine/precision gap on the BASE alone: token agreement {base.agreement:.3f} (min {c.min_token_agreement}), "
                f"max logprob diff {base.max_logprob_diff:.4f} nats (max {c.max_logprob_diff}) at {base.max_logprob_diff_at} "
                f"on {where}: the engine and the reference disagree before any adapter; check the checkpoint it serves, "
                f"--dtype, and the vLLM version (set canary.quantized: true if the served base is quantized)",
                where,
            )
        )
    bad_agree, bad_diff = ad.agreement < min_agree, ad.max_logprob_diff > max_diff
    if not (bad_agree or bad_diff) or not ad.positions:
        pass  # nothing compared is reported above, not as a parity or adapter-is-base failure
    elif res.engine_adapter_equals_base:
        hint = (
            f"modules outside the instance's --lora-target-modules ({', '.join(outside)})"
            if outside
            else "modules outside the instance's --lora-target-modules, or tensors the engine ignores"
        )
        res.findings.append(
            Finding(
                "canary.adapter_is_base",
                "error",
                f"the engine serves the adapter as the base: its greedy output equals the base's on all "
                f"{len(res.prompts)} canary prompts, but PEFT's differs (token agreement {ad.agreement:.3f}, first "
                f"divergence at token {ad.first_divergence} of {ad.first_divergence_prompt}): {hint}; "
                f"retrain with target modules the fleet applies, or change the fleet's --lora-target-modules",
                where,
            )
        )
    else:
        if rank_notes:
            why = " ".join(rank_notes) + (
                "; vLLM scales by lora_alpha / r from the config, so it serves another "
                "scale: fix r in adapter_config.json"
            )
        else:
            why = "the engine applies the adapter differently from PEFT (wrong scale, modules missing, another base)"
        res.findings.append(
            Finding(
                "canary.adapter_parity",
                "error",
                f"adapter parity failed on {where}: token agreement {ad.agreement:.3f} (min {min_agree:.3f}), max logprob "
                f"diff {ad.max_logprob_diff:.4f} nats (max {max_diff:.4f}) at {ad.max_logprob_diff_at}, first divergence at "
                f"token {ad.first_divergence} of {ad.first_divergence_prompt}; the base alone agrees {base.agreement:.3f} "
                f"(max diff {base.max_logprob_diff:.4f}): {why}",
                where,
            )
        )
    # A floor the user set is met only by a measurement: a figure the engine did not give fails it
    # (before, a missing figure skipped the floor and the canary passed on no evidence).
    for floor, value, check, what in (
        (
            c.min_speed_ratio,
            res.speed_ratio,
            "canary.speed",
            "the speed ratio (the engine reported no vllm:time_per_output_token_seconds)",
        ),
        (
            c.min_acceptance_ratio,
            res.acceptance_ratio,
            "canary.acceptance",
            "the acceptance ratio (the staging "
            "engine drafted nothing: run it with the fleet's --speculative-config)",
        ),
    ):
        if floor is not None and not _finite(value):
            res.findings.append(Finding(check, "error", _unmeasured(what, check, floor, where), where))
    if c.min_speed_ratio is not None and _finite(res.speed_ratio) and res.speed_ratio < c.min_speed_ratio:
        res.findings.append(
            Finding(
                "canary.speed",
                "error",
                f"decode speed with the adapter is {figures(res.speed_ratio, c.min_speed_ratio)[0]}x the base's (time "
                f"per output token {_ms(res.speed['adapter'].tpot_s)} vs {_ms(res.speed['base'].tpot_s)}), below "
                f"canary.min_speed_ratio {c.min_speed_ratio}",
                where,
            )
        )
    if (
        c.min_acceptance_ratio is not None
        and _finite(res.acceptance_ratio)
        and res.acceptance_ratio < c.min_acceptance_ratio
    ):
        res.findings.append(
            Finding(
                "canary.acceptance",
                "error",
                f"mean acceptance length with the adapter {res.speed['adapter'].mean_acceptance_length:.2f} is "
                f"{figures(res.acceptance_ratio, c.min_acceptance_ratio)[0]}x the base's "
                f"{res.speed['base'].mean_acceptance_length:.2f}, below "
                f"canary.min_acceptance_ratio {c.min_acceptance_ratio}: the drafter (no LoRA) no longer predicts it",
                where,
            )
        )

    eff = res.effect
    if c.min_effect_retention is not None:
        if eff is None:
            why = "the effect (teacher-forced scoring failed or gave no usable position: see the notes)"
        elif eff.engine_unusable:
            why = (
                f"the effect at {eff.engine_unusable} position(s), where the engine gave no finite log-probability "
                f"and the reference did (NaN, inf or -9999 on a real token)"
            )
        else:
            why = None
        if why is not None:
            res.findings.append(
                Finding(
                    "canary.effect",
                    "error",
                    _unmeasured(why, "canary.effect", c.min_effect_retention, where),
                    where,
                )
            )
        elif not _finite(eff.retention):  # the engine is fine: the adapter itself moves too little to measure
            res.findings.append(
                Finding(
                    "canary.effect",
                    "error",
                    f"canary.min_effect_retention is {c.min_effect_retention} but the adapter's own effect on "
                    f"its continuation is {eff.reference_nats:.3f} nats/token with PEFT on the bf16 base (below "
                    f"{MIN_REFERENCE_NATS}): too small for a retention to be measured on {where}; check that the "
                    f"adapter was trained (pipeline validate --behaviour), or unset canary.min_effect_retention",
                    where,
                )
            )
    if (
        c.min_effect_retention is not None
        and eff is not None
        and _finite(eff.retention)
        and not eff.engine_unusable
    ):
        if eff.retention < c.min_effect_retention:
            res.findings.append(
                Finding(
                    "canary.effect",
                    "error",
                    f"the adapter's effect does not survive the served base: its continuation gains "
                    f"{eff.engine_nats:.3f} nats/token on the engine against {eff.reference_nats:.3f} with PEFT on "
                    f"the bf16 base (retention {eff.retention:.2f}, below canary.min_effect_retention "
                    f"{c.min_effect_retention}; the base alone differs by {eff.base_gap_nats:.3f} nats/token): "
                    f"the quantized base or the engine's LoRA path loses the adapter; compare with a bf16 staging "
                    f"engine, or merge and quantize the adapter (pipeline merge)",
                    where,
                )
            )


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _unmeasured(what: str, check: str, floor: float, where: str) -> str:
    setting = {"canary.speed": "min_speed_ratio", "canary.acceptance": "min_acceptance_ratio"}.get(
        check, "min_effect_retention"
    )
    return (
        f"canary.{setting} is {floor} but {what} was not measured on {where}: a floor is met only by a "
        f"measurement; fix the staging engine, or unset canary.{setting} if this engine cannot measure it"
    )


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.1f} ms"
