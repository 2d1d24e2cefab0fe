"""The served checkpoint (e.g. NVFP4 ModelOpt): does the fleet's vLLM serve it, and does it have every module
the adapter adapts, with the same logical shape? Headers and config only.
"""

from __future__ import annotations

from pipeline.artifacts.checkpoint import logical_linear_shape, quant_algo
from pipeline.artifacts.hashing import sha256_file
from pipeline.serving.vllm import KNOWN_QUANT
from pipeline.validate.facts import AdapterFacts
from pipeline.validate.keys import ranges
from pipeline.validate.rules import Issue, Unavailable, check


@check("served.unchecked", "warning", "no served checkpoint given (`served.path` / `--served`)")
def unchecked(ctx: AdapterFacts):
    if ctx.served_dir is None:
        yield Issue(
            "no served checkpoint given: module names and shapes were not checked against what the fleet serves; "
            "set served.path in pipeline.yaml or pass --served",
            "",
        )


@check("served.unreadable", "error", "the served checkpoint cannot be read")
def unreadable(ctx: AdapterFacts):
    err = ctx.served_fact.missing
    if err:
        yield Issue(
            f"{err}: set served.path to a local copy of the served checkpoint (config, index, headers)",
            str(ctx.served_dir),
        )


def _stats(ctx: AdapterFacts):
    served = ctx.served
    qfile = served.path / "hf_quant_config.json"
    ctx.stats["served"] = {
        "path": str(served.path),
        "checkpoint": ctx.rules.served_checkpoint,
        "revision": ctx.rules.served_revision,
        "quant_algo": quant_algo(served),
        "layout": served.layout,
        "architecture": ctx.served_architecture,
        "quant_config_sha256": sha256_file(qfile) if qfile.is_file() else None,
    }


@check(
    "served.architecture",
    "error",
    "the served checkpoint's `architectures` is not a class the fleet's vLLM "
    "version registers for Qwen3.5 (e.g. `Qwen3_5ForCausalLM` before 0.32)",
)
def architecture(ctx: AdapterFacts):
    _stats(ctx)
    rng, arch = ctx.vllm, ctx.served_architecture
    mt = ctx.served.config.get("model_type", "")
    if not str(mt).startswith("qwen3_5"):
        return
    if arch not in rng.qwen35_classes:
        yield Issue(
            f"architectures {arch!r}: vLLM {ctx.rules.vllm_version} ({rng.name}) registers only "
            f"{sorted(rng.qwen35_classes)} for qwen3_5 and would not start on this checkpoint: point served.path at "
            "the fleet's real checkpoint, or set fleet.vllm_version to what the instances run",
            str(ctx.served.path / "config.json"),
        )


@check("served.not_quantized", "info", "the served checkpoint has no quantization config")
def not_quantized(ctx: AdapterFacts):
    if quant_algo(ctx.served) is None:
        yield Issue(
            "served checkpoint has no hf_quant_config.json or quantization_config: treated as unquantized",
            str(ctx.served.path),
        )


@check("served.quant_unknown", "warning", "unknown `quant_algo` (module shapes read as stored)")
def quant_unknown(ctx: AdapterFacts):
    algo = quant_algo(ctx.served)
    if algo is not None and algo not in KNOWN_QUANT:
        yield Issue(
            f"quantization {algo!r} is not one the pipeline knows ({sorted(KNOWN_QUANT)}): module shapes are read "
            "as stored",
            str(ctx.served.path / "hf_quant_config.json"),
        )


@check("served.geometry", "error", "text geometry (hidden size, layers, heads...) differs from the base")
def geometry(ctx: AdapterFacts):
    served, diffs = ctx.served, ctx.served_geometry_diffs
    if diffs:
        yield Issue(
            "the served checkpoint is not a quantization of this base ("
            + "; ".join(diffs)
            + "): point served.path at the fleet's checkpoint or retrain on its bf16 base",
            str(served.path / "config.json"),
        )


def _comparable(ctx: AdapterFacts):
    try:
        if ctx.served_geometry_diffs:
            return []
    except Unavailable:  # no base to compare with
        pass
    return [m for m in ctx.live() if m.layer is not None]


@check("served.module_missing", "error", "an adapted module is absent from the served checkpoint")
def module_missing(ctx: AdapterFacts):
    served = ctx.served
    missing: dict[str, list[int]] = {}
    for m in _comparable(ctx):
        if logical_linear_shape(served, m.module) is None:
            missing.setdefault(m.sub, []).append(m.layer)
    for sub, layers in sorted(missing.items()):
        yield Issue(
            f"{sub} on layers {ranges(layers)} does not exist in the served checkpoint ({served.layout} layout, "
            "names mapped from tensor names): vLLM cannot apply it there; retrain without it or fix served.path",
            str(served.path),
        )


@check("served.shape", "error", "an adapted module's unpacked `[out, in]` differs in the served checkpoint")
def shape(ctx: AdapterFacts):
    served = ctx.served
    for m in _comparable(ctx):
        shape = logical_linear_shape(served, m.module)
        two_d = m.a is not None and m.b is not None and len(m.a.shape) == 2 and len(m.b.shape) == 2
        want = (m.b.shape[0], m.a.shape[1]) if two_d else None
        if shape is not None and want is not None and shape != want:
            t = served.modules[m.module]
            yield Issue(
                f"served {m.module} is [out, in] = {list(shape)} (unpacked from {t.dtype} {list(t.shape)}) but the "
                f"adapter is for [{want[0]}, {want[1]}]: the served checkpoint is another model",
                str(served.path),
            )


# Per-tensor scales that vLLM 0.19's NVFP4 linear methods create with `torch.empty`, one slot per output shard
# (PerTensorScaleParameter): ModelOpt NVFP4 (`weight_scale_2`, `input_scale`; also the NVFP4 layers of a
# MIXED_PRECISION export: quantization/modelopt.py) and compressed-tensors NVFP4 (`weight_global_scale`,
# `input_global_scale`: compressed_tensors_w4a4_nvfp4.py, _w4a16_nvfp4.py). FP8 per-tensor scales are filled with
# finfo.min and a fused module is requantized with the one loaded scale (requantize_with_max_scale): not affected.
NVFP4_GLOBAL_SCALES = (".weight_scale_2", ".weight_global_scale")


def _nvfp4_in_proj_qkv(served) -> list[str]:
    """The served tensors that make a linear_attn.in_proj_qkv an NVFP4 layer with a per-tensor global scale."""
    out = []
    for m, t in served.modules.items():
        if not m.endswith("linear_attn.in_proj_qkv") or t.dtype not in ("U8", "I8"):
            continue
        stem = t.name.rsplit(".", 1)[0]
        out += [stem + s for s in NVFP4_GLOBAL_SCALES if stem + s in served.tensors]
    return out


@check(
    "served.nvfp4_gdn_scales",
    "error",
    "vLLM 0.19.x with LoRA enabled and an NVFP4 checkpoint (ModelOpt NVFP4 or MIXED_PRECISION, compressed-tensors "
    "NVFP4) whose `linear_attn.in_proj_qkv` is quantized: its per-tensor scales fill one slot, every request is "
    "served wrong (PR #38517, fixed in 0.20.0)",
)
def nvfp4_gdn_scales(ctx: AdapterFacts):
    """With --enable-lora, 0.19.x builds in_proj_qkv as its own 3-slice layer (qwen3_5.py
    create_in_proj_qkvz=False) and loads its one fused per-tensor global scale into slot 0 of a 3-slot
    PerTensorScaleParameter created with torch.empty (model_executor/layers/linear.py weight_loader_v2):
    the NVFP4 kernels take the max over the slots, so the base weights of every Gated-DeltaNet layer are wrong
    for every request on the instance, the base's and every adapter's alike, whatever modules this adapter
    adapts. No adapter can fix it: the fleet must. Read from the tensors (a packed U8 weight with its global
    scale), not from the quantization config's name: the same layer is NVFP4 in a ModelOpt MIXED_PRECISION
    export and in compressed-tensors' nvfp4-pack-quantized format."""
    rng, served = ctx.vllm, ctx.served
    if not rng.nvfp4_gdn_scale_bug:
        return
    # Whether in_proj_qkv is quantized is read from its tensors, not guessed from the exclude patterns:
    # modelopt's own export lists `...linear_attn.conv1d` / `in_proj_a` there while in_proj_qkv is NVFP4.
    scales = _nvfp4_in_proj_qkv(served)
    if scales:
        yield Issue(
            f"vLLM {ctx.rules.vllm_version} ({rng.name}) with --enable-lora loads this checkpoint's NVFP4 "
            f"linear_attn.in_proj_qkv (quantization {quant_algo(served)}; e.g. {scales[0]}) with one per-tensor "
            "scale slot filled and the others uninitialised (upstream PR #38517, fixed in 0.20.0): every request on "
            "these instances is served with wrong Gated-DeltaNet weights, the base model's included, and no adapter "
            "change can fix it. Upgrade the fleet to vLLM 0.20.0 or later (then set fleet.vllm_version), or serve a "
            "checkpoint that keeps linear_attn unquantized (hf_quant_config.json exclude_modules); --allow "
            "served.nvfp4_gdn_scales only where you have measured the fleet's outputs",
            str(
                served.path
                / (
                    "hf_quant_config.json"
                    if (served.path / "hf_quant_config.json").is_file()
                    else "config.json"
                )
            ),
        )


MTP_PREFIX = (
    "mtp."  # vllm/model_executor/models/qwen3_5_mtp.py load_weights: `name.startswith("mtp.")`, every range
)


@check(
    "served.mtp",
    "error",
    "the fleet drafts with MTP (`fleet.speculative_mtp`) but the served checkpoint's MTP layer is not where "
    "vLLM's drafter reads it (`mtp.*` at the top level: none at all, under a prefix such as "
    "`model.language_model.mtp.`, or layers/`mtp.fc` missing)",
)
def mtp(ctx: AdapterFacts):
    """vLLM's Qwen3.5 MTP drafter loads only tensors whose name starts with `mtp.` (renamed to `model.`) and
    skips the rest; its `num_mtp_layers` is `mtp_num_hidden_layers` (default 1). A drafter whose weights
    were never loaded proposes garbage: output stays exact (verification) but speculative decoding buys
    nothing, or the loader refuses uninitialised weights."""
    served = ctx.served
    if not ctx.rules.speculative_mtp or not str(served.config.get("model_type", "")).startswith("qwen3_5"):
        return
    names = list(served.tensors)
    top = [n for n in names if n.startswith(MTP_PREFIX)]
    under = [n for n in names if ".mtp." in n and not n.startswith(MTP_PREFIX)]
    misplaced = sorted({n[: n.index(".mtp.") + 1] for n in under})
    where = str(served.path)
    fix = "fleet.speculative_mtp: false if the instances run without --speculative-config method mtp"
    if misplaced:
        yield Issue(
            f"the MTP layer is stored under {misplaced[0]}mtp.* ({len(under)} tensors): vLLM's MTP drafter reads only tensors named mtp.* (qwen3_5_mtp.py load_weights) and would "
            f"draft with uninitialised weights; re-export the checkpoint with the MTP layer at the top level (mtp.*), "
            f"or set {fix}",
            where,
        )
        return
    if not top:
        yield Issue(
            "the served checkpoint has no mtp.* tensors, but the fleet drafts with its MTP layer "
            "(fleet.speculative_mtp; vLLM's drafter loads mtp.* only): serve the checkpoint with its MTP layer "
            f"(the NVFP4 export keeps mtp.* unquantized), or set {fix}",
            where,
        )
        return
    want = served.text_config.get("mtp_num_hidden_layers", 1)
    if not isinstance(want, int) or isinstance(want, bool) or want < 1:
        yield Issue(
            f"the served checkpoint's config.json has mtp_num_hidden_layers = {want!r}, but the fleet drafts with its "
            "MTP layer: vLLM's Qwen3.5 drafter runs that many layers (qwen3_5_mtp.py num_mtp_layers, speculative "
            "config n_predict) and has none to run (a positive integer is needed); fix config.json to the "
            f"checkpoint's MTP layer count (1 for Qwen3.6-27B), or set {fix}",
            str(served.path / "config.json"),
        )
        return
    have = {int(n.split(".")[2]) for n in top if n.startswith("mtp.layers.") and n.split(".")[2].isdigit()}
    missing = [f"mtp.layers.{i}" for i in range(want) if i not in have]
    if not any(n.startswith("mtp.fc.") for n in top):
        missing.append("mtp.fc")
    if missing:
        yield Issue(
            f"the served checkpoint declares {want} MTP layer(s) (mtp_num_hidden_layers) but has no tensors for "
            f"{missing}: vLLM's drafter would run those with uninitialised weights; re-export the checkpoint with "
            f"its whole MTP layer, or set {fix}",
            where,
        )
