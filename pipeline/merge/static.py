"""`pipeline merge` runs validate's static checks first (issue 25.9): merge and validate must not disagree.

Merge pairs LoRA tensors by canonical module, so on its own it would fold one of two conflicting
layout copies of a module (`keys.mixed_layout`), NaN weights (`values.nonfinite`) or a never-trained
adapter (`values.untrained`) into a checkpoint and exit 0 while `pipeline validate` refuses them.
The checks are validate's own (`pipeline.validate.validate_adapter`, headers and adapter tensors
only, no model loaded), not a copy. Refused here: every error finding except those about *serving
the adapter as a LoRA* (what vLLM's LoRA loader accepts, the fleet's rank limit, the served
checkpoint, templates, training provenance): a merged model is served without LoRA, and merge
itself handles rsLoRA, rank/alpha patterns, embedding and lm_head LoRA exactly (peft's rules).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.validate import validate_adapter

# Findings about serving an adapter as a hot-loaded LoRA, not about the adapter's weights.
LORA_SERVING_PREFIXES = ("fleet.", "served.", "serving.", "template.", "tokenizer.", "train.", "behaviour.")
LORA_SERVING_IDS = frozenset(
    {
        "config.rank",  # vLLM's --max-lora-rank set and the fleet's limit
        "config.rslora",  # the fleet's vLLM scaling; merge applies alpha/sqrt(r) as peft does
        "config.rslora_parity",
        "config.rslora_folded",
        "config.patterns_ignored",  # vLLM 0.19-0.25 ignore rank/alpha patterns; merge honours them
        "config.embedding_targets",
        "keys.embedding",  # embedding / lm_head LoRA: not served as LoRA by the fleet, merged exactly
        "keys.mtp",  # the MTP drafter has no LoRA; a merge folds it into the mtp.* weights
        "keys.visual",
        "keys.served_layout",  # key layout vs the served class: merge maps both layouts
        "keys.fleet_targets",
        "values.size_band",  # a size heuristic; merge checks every tensor exactly (plan.lora_pairs)
    }
)
SAVED_BASE = ".base_layer.weight"  # peft's embed_tokens/lm_head copies: merge requires them equal to the base


def merge_refusals(adapter_dir: Path, base_dir: Path) -> tuple[list, dict]:
    """validate's error findings that also make a merge wrong; returns (findings, validate's stats)."""
    rep = validate_adapter(Path(adapter_dir), Path(base_dir))
    refused = [
        f
        for f in rep.findings
        if f.severity == "error"
        and f.id not in LORA_SERVING_IDS
        and not f.id.startswith(LORA_SERVING_PREFIXES)
        and not (f.id == "keys.unknown" and f.where.endswith(SAVED_BASE))
    ]
    return refused, {"checked": len(rep.findings), "rules_version": (rep.bound or {}).get("rules_version")}
