"""Rules about the fleet the adapter goes to: its vLLM version, loading mode and sizing.

Sources: docs/vllm.md (filesystem resolver, version table), `pipeline.serving.versions`,
upstream vLLM PR #22782 (LoRA buffers are sized by `--max-lora-rank`).
"""

from __future__ import annotations

from pipeline.validate.facts import AdapterFacts, Facts
from pipeline.validate.rules import Issue, Unavailable, check

BOTH = ("adapter", "train")
OVERSIZE = 4  # warn when max_lora_rank > OVERSIZE x the largest rank the adapter uses


@check(
    "serving.version_unknown",
    "error",
    "`fleet.vllm_version` parses to no known version range (never treated "
    "as the newest); `--allow serving.version_unknown` overrides",
    scopes=BOTH,
    severity_doc="error (info when allowed)",
)
def version_unknown(ctx: Facts):
    fact = ctx.vllm_fact
    if fact.known:
        return
    msg = fact.missing
    allowed = "serving.version_unknown" in ctx.options.allow
    yield Issue(
        msg + (" (allowed: version-specific key, scale and layout checks were skipped)" if allowed else ""),
        "pipeline.yaml: fleet.vllm_version",
        "info" if allowed else None,
    )


@check(
    "fleet.resolver_base",
    "error",
    "resolver mode and `base_model_name_or_path` != `served.model` (info before publish, which rewrites it)",
    severity_doc="error (info before publish)",
)
def resolver_base(ctx: AdapterFacts):
    """vLLM's filesystem resolver loads a directory only if base_model_name_or_path == the `vllm serve` model."""
    rules = ctx.rules
    if rules.loading_mode != "resolver":
        return
    cfg = ctx.cfg
    have, want = cfg.raw.get("base_model_name_or_path"), rules.served_model
    if not want:
        yield Issue(
            "fleet.loading_mode is resolver but served.model is empty: set it to the exact model string given to "
            "`vllm serve`",
            "pipeline.yaml: served.model",
        )
        return
    if have == want:
        return
    if ctx.manifest is not None and not ctx.published:
        yield Issue(
            f"base_model_name_or_path {have!r} will be rewritten to {want!r} by `pipeline publish` (the resolver "
            "needs the exact `vllm serve` model string)",
            str(cfg.path),
            "info",
        )
    else:
        yield Issue(
            f"base_model_name_or_path is {have!r} but the fleet's resolver only loads adapters whose base is exactly "
            f"{want!r} (served.model): it would answer 404. Publish it with `pipeline publish` (which rewrites it) or "
            "fix adapter_config.json",
            str(cfg.path),
        )


def _ranks(ctx) -> list[int]:
    lv = ctx.lora
    ranks = [lv.get("r")] + list((lv.get("rank_pattern") or {}).values())
    return [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]


@check(
    "fleet.rank_oversized",
    "warning",
    "`fleet.max_lora_rank` is more than 4x the adapter's largest rank "
    "(vLLM sizes LoRA buffers by it: throughput lost, PR #22782)",
    scopes=BOTH,
)
def rank_oversized(ctx: Facts):
    try:
        ranks = _ranks(ctx)
    except Unavailable:
        return
    if ranks and ctx.rules.max_lora_rank > OVERSIZE * max(ranks):
        yield Issue(
            f"the fleet's --max-lora-rank {ctx.rules.max_lora_rank} is {ctx.rules.max_lora_rank // max(ranks)}x this "
            f"adapter's largest rank {max(ranks)}: vLLM allocates every LoRA slot at max_lora_rank (upstream PR "
            "#22782), costing memory and throughput for nothing; lower fleet.max_lora_rank to the largest rank the "
            "fleet's adapters use",
            "pipeline.yaml: fleet.max_lora_rank",
        )
