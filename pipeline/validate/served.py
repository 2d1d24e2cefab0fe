"""The served checkpoint (e.g. NVFP4 ModelOpt): does the fleet's vLLM serve it, and does it have every module
the adapter adapts, with the same logical shape? Headers and config only.
"""

from __future__ import annotations

from pipeline.artifacts.checkpoint import GEOMETRY_KEYS, logical_linear_shape, quant_algo
from pipeline.artifacts.hashing import sha256_file
from pipeline.serving.vllm import KNOWN_QUANT
from pipeline.validate.keys import ranges
from pipeline.validate.rules import Issue, check


@check("served.unchecked", "warning", "no served checkpoint given (`served.path` / `--served`)")
def unchecked(ctx):
    if ctx.served_dir is None:
        yield Issue(
            "no served checkpoint given: module names and shapes were not checked against what the fleet serves; "
            "set served.path in pipeline.yaml or pass --served",
            "",
        )


@check("served.unreadable", "error", "the served checkpoint cannot be read")
def unreadable(ctx):
    _, err = ctx._served
    if err:
        yield Issue(
            f"{err}: set served.path to a local copy of the served checkpoint (config, index, headers)",
            str(ctx.served_dir),
        )


def _stats(ctx):
    served = ctx.served
    qfile = served.path / "hf_quant_config.json"
    ctx.report.stats["served"] = {
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
def architecture(ctx):
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
def not_quantized(ctx):
    if quant_algo(ctx.served) is None:
        yield Issue(
            "served checkpoint has no hf_quant_config.json or quantization_config: treated as unquantized",
            str(ctx.served.path),
        )


@check("served.quant_unknown", "warning", "unknown `quant_algo` (module shapes read as stored)")
def quant_unknown(ctx):
    algo = quant_algo(ctx.served)
    if algo is not None and algo not in KNOWN_QUANT:
        yield Issue(
            f"quantization {algo!r} is not one the pipeline knows ({sorted(KNOWN_QUANT)}): module shapes are read "
            "as stored",
            str(ctx.served.path / "hf_quant_config.json"),
        )


@check("served.geometry", "error", "text geometry (hidden size, layers, heads...) differs from the base")
def geometry(ctx):
    base, served = ctx.base, ctx.served
    diffs = [
        f"{k}: base {base.text_config.get(k)!r} vs served {served.text_config.get(k)!r}"
        for k in GEOMETRY_KEYS
        if k in base.text_config and k in served.text_config and base.text_config[k] != served.text_config[k]
    ]
    if diffs:
        ctx.served_geometry_differs = True
        yield Issue(
            "the served checkpoint is not a quantization of this base ("
            + "; ".join(diffs)
            + "): point served.path at the fleet's checkpoint or retrain on its bf16 base",
            str(served.path / "config.json"),
        )


def _comparable(ctx):
    if getattr(ctx, "served_geometry_differs", False):
        return []
    return [m for m in ctx.live() if m.layer is not None]


@check("served.module_missing", "error", "an adapted module is absent from the served checkpoint")
def module_missing(ctx):
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
def shape(ctx):
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


@check(
    "served.nvfp4_gdn_scales",
    "warning",
    "vLLM 0.19.x with a ModelOpt NVFP4 checkpoint whose `linear_attn` "
    "is quantized: `in_proj_qkv` per-tensor scales fill one slot (upstream PR #38517, fixed in 0.20.0)",
)
def nvfp4_gdn_scales(ctx):
    rng, served = ctx.vllm, ctx.served
    if not rng.nvfp4_gdn_scale_bug or quant_algo(served) != "NVFP4":
        return
    # Whether in_proj_qkv is quantized is read from its tensors (packed U8 weight), not guessed from the
    # exclude patterns: modelopt's own export lists `...linear_attn.conv1d` / `in_proj_a` there while
    # in_proj_qkv is NVFP4, which a "pattern mentions linear_attn" test took for an excluded linear_attn.
    quantized = any(
        t.dtype in ("U8", "I8") for m, t in served.modules.items() if m.endswith("linear_attn.in_proj_qkv")
    )
    adapts = any(m.sub and m.sub.endswith("in_proj_qkv") for m in ctx.live())
    if quantized and adapts:
        yield Issue(
            f"vLLM {ctx.rules.vllm_version} ({rng.name}) loads ModelOpt NVFP4 linear_attn with one in_proj_qkv "
            "per-tensor scale slot filled and the others uninitialised (upstream PR #38517, fixed in 0.20.0): the "
            "base and this adapter's in_proj_qkv are served wrong; upgrade the fleet to 0.20+ or serve a checkpoint "
            "that excludes linear_attn from quantization",
            str(served.path / "hf_quant_config.json"),
        )
