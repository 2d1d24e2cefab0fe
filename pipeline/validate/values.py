"""Tensor values: finite, and every module's effective update `scale x ||B @ A||` non-zero and in family.

Read through a read-only memory map with numpy (no torch): non-finite tests work on raw bits
(bf16/fp16 exponent all ones = Inf/NaN), ~50x faster than torch.isfinite on bf16. The norm of a
module's update `scale * B @ A` ([out, in]) is computed without forming it:
||BA||_F^2 = sum((B^T B) * (A A^T)), two r x r Gram matrices.
"""

from __future__ import annotations

import statistics

from pipeline.validate.base_facts import EFFECT_EPS
from pipeline.validate.facts import AdapterFacts, Unavailable
from pipeline.validate.keys import ranges
from pipeline.validate.rules import Issue, check

NORM_OUTLIER = 10.0  # x the median update norm of the same module type
SIZE_BAND = (0.5, 2.0)  # weights file / expected bytes
# What an adapter's other files (config, tokenizer, template, manifest, model card) may add to its weights in
# all: a Qwen3.6 tokenizer.json is ~12 MB, its tokenizer_config.json with the chat template ~20 KB.
OTHER_FILES_BYTES = 256 << 20
NO_EFFECT = 1e-12  # an update norm below this is zero
# Relative to the base weight (||scale·B·A||_F / ||W||_F), in units of the serving dtype's machine epsilon
# (docs/validation.md "No effect"): below ERROR_BAND x eps almost no output element changes by one ulp,
# below WARN_BAND x eps most of the update is rounded away.
ERROR_BAND = 2.0**-10
WARN_BAND = 2.0**-6


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@check(
    "values.nonfinite", "error", "NaN/Inf in a tensor (vLLM loads it and corrupts other tenants' requests)"
)
def nonfinite(ctx: AdapterFacts):
    for name, n in ctx.nonfinite.items():
        yield Issue(
            f"{n} NaN/Inf values of {_numel(ctx.header[name].shape)}: vLLM loads it and corrupts other tenants' "
            "requests; retrain (lower the learning rate, check for fp16 overflow)",
            f"{ctx.wfile}:{name}",
        )


# The largest finite value of each dtype vLLM may hold LoRA weights in (--lora-dtype auto: the model's dtype).
DTYPE_MAX = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0, "float32": 3.4028234663852886e38}


@check(
    "values.overflow",
    "error",
    "`scale x lora_B` (or `lora_A`) exceeds the largest value of the serving dtype: vLLM folds the scale into "
    "lora_B in that dtype at load (lora/lora_weights.py optimize), so the module holds Inf like a NaN/Inf weight",
)
def overflow(ctx: AdapterFacts):
    limit = DTYPE_MAX[ctx.serving_dtype]
    over = {m: v for m, v in ctx.value_peaks.items() if not v < limit}
    if over:
        worst = max(over, key=over.get)
        yield Issue(
            f"{len(over)} module(s) (e.g. {worst}: {over[worst]:.3g}) hold a value above {ctx.serving_dtype}'s "
            f"largest {limit:.4g} once vLLM folds the scale alpha/r into lora_B in the serving dtype: they load as "
            "Inf and corrupt other tenants' requests like a NaN weight; lora_alpha (or an alpha_pattern value) is "
            "wrong for these weights: set the value the adapter was trained with",
            str(ctx.wfile),
        )


def _bands(ctx: AdapterFacts) -> tuple[float, float, float]:
    """(machine epsilon, error band, warning band) of the serving dtype (docs/validation.md "No effect")."""
    eps = EFFECT_EPS[ctx.serving_dtype]
    return eps, eps * ERROR_BAND, eps * WARN_BAND


def _dead(ctx: AdapterFacts) -> tuple[dict[str, float], dict[str, float]]:
    """({module: relative effect} below the error band (0 for an exact zero), {module: effect} in the warning band)."""
    norms = ctx.update_norms
    try:
        rel = ctx.relative_effect
    except Unavailable:  # no base: only an exact zero is known to change nothing
        rel = {}
    _, err, warn = _bands(ctx)
    dead = {m: rel.get(m, 0.0) for m, n in norms.items() if n < NO_EFFECT or rel.get(m, 1.0) < err}
    weak = {m: r for m, r in rel.items() if m not in dead and r < warn}
    return dead, weak


@check(
    "values.untrained",
    "error",
    "no module changes what the engine computes: every `scale x ||B·A||` is 0 (all lora_B or lora_A zero, "
    "`lora_alpha` 0), or below the serving dtype's resolution relative to the base weights",
)
def untrained(ctx: AdapterFacts):
    norms = ctx.update_norms
    if not norms:
        return
    dead, _ = _dead(ctx)
    if len(dead) < len(norms):
        return
    if all(n < NO_EFFECT for n in norms.values()):
        fact = ctx.config_fact
        alpha = fact.value.lora_alpha if fact.known and not fact.value.problems else None
        why = "lora_alpha is 0" if alpha == 0 else "every lora_B (or lora_A) is zero"
        yield Issue(
            f"the adapter changes nothing: {why}, so scale x ||B·A|| is 0 on all {len(norms)} modules; check that "
            "training ran steps and saved the final adapter",
            str(ctx.wfile),
        )
        return
    eps, err, _ = _bands(ctx)
    top = max(dead.values())
    yield Issue(
        f"the adapter changes nothing the engine can represent: on all {len(norms)} modules ||scale·B·A|| / ||W|| "
        f"is at most {top:.2g}, below {err:.2g} ({ERROR_BAND:g} x {ctx.serving_dtype}'s epsilon {eps:.3g}): the "
        "update is rounded away when vLLM adds it to the base output; lora_B was scaled down or barely trained: "
        "re-save from the final checkpoint or retrain",
        str(ctx.wfile),
    )


@check(
    "values.no_effect",
    "error",
    "some modules change nothing (`scale x ||B·A||` = 0, or below the serving dtype's resolution relative "
    "to the base weight) while others do; a module in the band above it is a warning",
    severity_doc="error (warning in the weak band: docs/validation.md 'No effect')",
)
def no_effect(ctx: AdapterFacts):
    norms = ctx.update_norms
    dead, weak = _dead(ctx)
    eps, err, warn = _bands(ctx)

    def listed(ms):
        by_sub: dict[str, list[int]] = {}
        for m in ctx.live():
            if m.peft_module in ms and m.layer is not None:
                by_sub.setdefault(m.sub, []).append(m.layer)
        return (
            "; ".join(f"{sub} on layers {ranges(ls)}" for sub, ls in sorted(by_sub.items())) or sorted(ms)[:5]
        )

    if dead and len(dead) < len(norms):
        zero = all(norms[m] < NO_EFFECT for m in dead)
        what = (
            "a zero update (lora_A or lora_B all zero)"
            if zero
            else f"an update below {err:.2g} of the base weight's norm ({ctx.serving_dtype} rounds it away)"
        )
        yield Issue(
            f"{len(dead)} of {len(norms)} modules have {what}: {listed(dead)}; those modules were never trained: "
            "re-save from the final checkpoint or retrain",
            str(ctx.wfile),
        )
    if weak:
        yield Issue(
            f"{len(weak)} of {len(norms)} modules change the output by less than {warn:.2g} of the base weight's "
            f"norm ({WARN_BAND:g} x {ctx.serving_dtype}'s epsilon {eps:.3g}): {listed(weak)}; most of their effect "
            "is rounded away in serving (median ||ΔW||/||W|| "
            f"{statistics.median(weak.values()):.2g}); check the learning rate and steps",
            str(ctx.wfile),
            "warning",
        )


@check("values.norm_outlier", "warning", "a module's `‖scale·B·A‖` > 10x the median of its module type")
def norm_outlier(ctx: AdapterFacts):
    groups: dict[str, list[tuple[str, float]]] = {}
    for m in ctx.live():
        n = ctx.update_norms.get(m.peft_module)
        if n is not None and m.sub:
            groups.setdefault(m.sub, []).append((m.module, n))
    medians = {}
    for sub, items in sorted(groups.items()):
        med = statistics.median(n for _, n in items)
        medians[sub] = med
        if len(items) < 3 or med <= 0:
            continue
        for module, n in items:
            if n > NORM_OUTLIER * med:
                yield Issue(
                    f"update norm ||scale*B@A|| = {n:.4g} is {n / med:.0f}x the median {med:.4g} of {sub} over "
                    f"{len(items)} layers: check for a diverged layer (lower the learning rate, clip gradients)",
                    f"{ctx.wfile}:{module}",
                )
    ctx.stats["update_norm_median"] = {k: round(v, 6) for k, v in medians.items()}
    ctx.stats["max_update_norm"] = max(ctx.update_norms.values(), default=0.0)


@check(
    "values.size_band",
    "error",
    "file size outside 0.5-2x of the bytes implied by r (+rank_pattern), target_modules and base shapes",
)
def size_band(ctx: AdapterFacts):
    expected, params = ctx.expected_weights
    if expected is None:
        return
    # peft's copies of the base embedding are not LoRA weights (vLLM skips them; keys.base_copy checks them)
    actual = ctx.wfile.stat().st_size - sum(i.nbytes for i in ctx.base_copies.values())
    ctx.stats["expected_weights_bytes"] = expected
    if params == 0:
        return
    ratio = actual / expected
    if not SIZE_BAND[0] <= ratio <= SIZE_BAND[1]:
        yield Issue(
            f"{actual:,} bytes is {ratio:.2f}x the {expected:,} bytes implied by r, target_modules and the base's "
            f"shapes (band {SIZE_BAND[0]}-{SIZE_BAND[1]}x): tensors missing or extra data; re-save the adapter or fix "
            "adapter_config.json",
            str(ctx.wfile),
        )
