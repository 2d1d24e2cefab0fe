"""How a new adapter version may replace the old one on a live vLLM instance, by vLLM version.

Two engine behaviours decide it (docs/fleet.md "Swap strategy by vLLM version", docs/vllm.md); both are
fields of the one version table (`pipeline.serving.versions.RANGES`: `inplace_sticky`, `prefix_key`,
`reset_endpoint`):

- **sticky `load_inplace`**: `POST /v1/load_lora_adapter {"load_inplace": true}` stores the request
  with the flag set, and every generation request through that name hands it to the worker, whose
  `add_adapter` re-reads the adapter from disk while the flag is set: on every scheduler step
  (upstream issue vllm-project/vllm#33791; fix proposed in PR #36373).
- **prefix-cache key**: the block hash of a LoRA request holds the adapter name only (0.19-0.27) or
  name and path (0.32, 0.33) (`vllm/v1/core/kv_cache_utils.py` `_gen_lora_extra_hash_keys`). Where it
  is the name only, a name that serves new weights can reuse KV computed with the old ones.

Strategies (`fleet.swap_strategy`):

- `versioned`: a version is only ever served under its own name `<NAME>-v<N>` from its own
  immutable directory, loaded without `load_inplace`. No name ever changes weights, so neither
  behaviour can matter, on any version. Clients reach the current version through the pipeline's
  resolver (the desired state: `pipeline fleet resolve NAME`, or `resolve_served_name`).
- `repoint`: the stable name `<NAME>` is re-pointed in place at the new version's (new) path. Only
  correct where the prefix-cache key holds the path; only free of per-step reloads where
  `load_inplace` is one-shot.
- `auto` (default): `repoint` where both hold (0.33), else `versioned`.

`POST /reset_prefix_cache` is no way out on any version read: it is mounted only with
`VLLM_SERVER_DEV_MODE=1` (which also exposes `/sleep`, `/collective_rpc` ...), and without
`reset_running_requests=true` (0.14+) it does nothing while requests run, still answering 200 on
the versions that do not check the result (`vllm/entrypoints/serve/cache/api_router.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline.errors import UsageError
from pipeline.serving.versions import RANGES, VllmRange, find_range

Strategy = Literal["versioned", "repoint"]


@dataclass
class SwapPlan:
    """The strategy a rollout uses, why, and what the operator should know."""

    strategy: Strategy
    reason: str
    facts: VllmRange | None = None
    warnings: list[str] = field(default_factory=list)


def swap_facts(version: str) -> VllmRange | None:
    """The version-table range holding for `version` (its `inplace_sticky`, `prefix_key`, `reset_endpoint`),
    or None where the pipeline has not read that version's sources."""
    return find_range(version)


def swap_plan(version: str, configured: str = "auto") -> SwapPlan:
    """The swap strategy for a fleet running vLLM `version` (`fleet.vllm_version`).

    `configured` is `fleet.swap_strategy`: `auto` picks `repoint` only where the prefix-cache key
    holds the path and `load_inplace` is one-shot, else `versioned` (always correct).

    Raises UsageError: `repoint` asked for where it would serve stale KV (key = name only) or where
    the pipeline has not read the version's sources.
    """
    facts = swap_facts(version)
    if configured == "versioned":
        return SwapPlan("versioned", "fleet.swap_strategy is 'versioned'", facts)
    if configured == "repoint":
        if facts is None:
            raise UsageError(
                f"fleet.swap_strategy 'repoint' on vLLM {version}: the pipeline has not read this version's "
                f"prefix-cache key and load_inplace behaviour (known: "
                f"{', '.join(f.versions for f in RANGES)}); use 'versioned' or 'auto'"
            )
        if facts.prefix_key == "name":
            raise UsageError(
                f"fleet.swap_strategy 'repoint' on vLLM {version} ({facts.versions}): the prefix cache is keyed "
                f"by adapter name only, so a re-pointed name can serve KV computed with the old weights "
                f"({facts.source}; {facts.reset_endpoint}, so cached KV cannot be dropped safely); use 'versioned' or "
                "'auto'"
            )
        plan = SwapPlan("repoint", "fleet.swap_strategy is 'repoint'", facts)
        if facts.inplace_sticky:
            plan.warnings.append(
                f"vLLM {version}: load_inplace is sticky (vllm-project/vllm#33791): after a re-point the adapter "
                f"is re-read from disk on every scheduler step while it serves; fleet.swap_strategy "
                f"'versioned' avoids it"
            )
        return plan
    if facts is None:
        return SwapPlan(
            "versioned",
            f"vLLM {version}: swap behaviour not read for this version; 'versioned' is correct on every version",
        )
    hazards = []
    if facts.prefix_key == "name":
        hazards.append("prefix cache keyed by adapter name only (stale KV after a re-point)")
    if facts.inplace_sticky:
        hazards.append("load_inplace sticky (adapter re-read from disk every scheduler step)")
    if hazards:
        return SwapPlan("versioned", f"vLLM {version} ({facts.versions}): " + "; ".join(hazards), facts)
    return SwapPlan(
        "repoint",
        f"vLLM {version} ({facts.versions}): prefix cache keyed by name and path, load_inplace one-shot",
        facts,
    )
