"""Checks that need the base model's geometry and the GPU, before axolotl starts.

- Sample packing on Gated-DeltaNet models (Qwen3.5/3.6, Qwen3-Next): in a packed row the
  recurrent and causal-conv state of one sample flows into the next unless the kernels get the
  sample boundaries, silently (public reports: NVIDIA-NeMo/Automodel#2131,
  huggingface/transformers#46093, modelscope/ms-swift#9618; docs/training.md). The pipeline's
  axolotl plugin patches the Qwen3.5 family so that every boundary resets them
  (`pipeline.train.packing`): on a CUDA GPU through flash-linear-attention's varlen kernels, on
  CPU through its torch reference. `packing_problems` refuses packing where that patch cannot run:
  a family it does not cover (qwen3_next), or a GPU without fla's varlen kernels (or, on Hopper,
  without what fla's backward needs there: Triton >= 3.7.1 or tilelang).
- Materialised logits: a causal LM without a fused loss keeps the [batch, seq, vocab] logits
  (~10 bytes per element in training, pipeline.train.fused_loss.LOGIT_BYTES_PER_ELEMENT);
  `logits_memory_problem` estimates that plus the bf16 weights against the detected GPU.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.bounded import MIB, load_json_file
from pipeline.train.config import TrainingConfig
from pipeline.train.fused_loss import LOGIT_BYTES_PER_ELEMENT
from pipeline.train.packing import FAMILIES as PACKED_FAMILIES

# model_type values (config.json) of the Gated-DeltaNet hybrids
GDN_MODEL_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
HOPPER = ("H100", "H200", "H800", "H20", "GH200")
FUSED_LOSS_PLUGINS = {
    "axolotl.integrations.liger.LigerPlugin": "liger_fused_linear_cross_entropy",
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": "cut_cross_entropy",
}


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: name and total memory in bytes."""

    name: str
    total_bytes: int


def detect_gpus() -> list[Gpu]:
    """Visible NVIDIA GPUs from `nvidia-smi` (no CUDA context is created in this process), honouring
    a numeric CUDA_VISIBLE_DEVICES; [] when there is no nvidia-smi or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            gpus[parts[0]] = Gpu(parts[1], int(parts[2]) * 2**20)  # MiB
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        return [gpus[v.strip()] for v in visible.split(",") if v.strip() in gpus]
    return [gpus[k] for k in sorted(gpus, key=int)]


def base_config(tc: TrainingConfig) -> dict | None:
    """config.json of a local base_model directory, or None (hub id, or no config.json)."""
    p = Path(str(tc.data.get("base_model", ""))) / "config.json"
    if not p.is_file():
        return None
    try:
        return load_json_file(p, 64 * MIB)
    except (OSError, ValueError):  # unreadable, not JSON, over the bounds
        return None


def model_family(tc: TrainingConfig) -> str | None:
    """The base's model_type (`qwen3_5`, ...) from its config.json, else guessed from axolotl's
    `model_type` class name (Qwen3_5ForConditionalGeneration -> qwen3_5); None when unknown."""
    cfg = base_config(tc)
    if cfg and cfg.get("model_type"):
        return str(cfg["model_type"])
    cls = str(tc.data.get("model_type") or "")
    for prefix, family in (
        ("Qwen3_5Moe", "qwen3_5_moe"),
        ("Qwen3_5", "qwen3_5"),
        ("Qwen3Next", "qwen3_next"),
    ):
        if cls.startswith(prefix):
            return family
    return None


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def installed_version(dist: str) -> str | None:
    """Version of an installed distribution (importlib.metadata), or None."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fla_varlen_installed() -> bool:
    """flash-linear-attention's varlen chunked delta rule and causal conv are on disk (nothing imported):
    fla 0.6.0 `fla/modules/causal_conv1d/`, 0.4.1-0.5.x `fla/modules/convolution.py`, older `conv/`."""
    fla = _package_dir("fla")
    if fla is None or not (fla / "ops" / "gated_delta_rule").is_dir():
        return False
    mods = fla / "modules"
    return any(
        (mods / n).is_dir() or (mods / f"{n}.py").is_file() for n in ("causal_conv1d", "convolution", "conv")
    )


def varlen_gdn_missing(
    family: str, gpus: list[Gpu], triton: str | None = "detect", tilelang: bool | None = None
) -> list[str]:
    """What keeps exact packing (pipeline.train.packing) from running here ([] = it runs).

    Looks at installed files only (nothing is imported): the family must be one the pipeline's
    patch covers (`pipeline.train.packing.FAMILIES`); with a CUDA GPU, flash-linear-attention's
    varlen kernels must be installed (without them every packed sample would run the torch
    reference loop: exact but ~3x slower than fla, benchmarks/RESULTS.md), and on Hopper
    (H100/H200/H800/H20) Triton >= 3.7.1 or `tilelang` (fla refuses its Triton backward there
    otherwise: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"). Without a
    GPU the torch reference runs (CPU tests and small runs). `triton`: the Triton version to judge
    ("detect": installed); `tilelang`: whether tilelang is installed (None: detect).
    """
    if family.removesuffix("_text") not in {f.removesuffix("_text") for f in PACKED_FAMILIES}:
        return [
            f"exact packing for {family} (the pipeline's packing patch, pipeline/train/packing.py, covers "
            f"{', '.join(sorted({f.removesuffix('_text') for f in PACKED_FAMILIES}))})"
        ]
    if not gpus:
        return []
    missing = []
    if not _fla_varlen_installed():
        missing.append(
            "flash-linear-attention (fla) with its varlen causal_conv1d and chunk_gated_delta_rule on this GPU host"
        )
    triton = installed_version("triton") if triton == "detect" else triton
    tilelang = installed_version("tilelang") is not None if tilelang is None else tilelang
    hopper = [g.name for g in gpus if any(h in g.name for h in HOPPER)]
    if hopper and triton and _version_tuple(triton) < (3, 7, 1) and not tilelang:
        missing.append(
            f"Triton >= 3.7.1 or tilelang on {hopper[0]} (Triton {triton} here: fla refuses its Gated-DeltaNet "
            "backward on Hopper with Triton < 3.7.1 unless tilelang is installed)"
        )
    return missing


def packing_problems(tc: TrainingConfig, gpus: list[Gpu]) -> list[str]:
    """Messages refusing sample packing that would leak state across samples ([] = fine)."""
    d = tc.data
    family = model_family(tc)
    if family not in GDN_MODEL_TYPES or not (d.get("sample_packing") or d.get("eval_sample_packing")):
        return []
    missing = varlen_gdn_missing(family, gpus)
    if not missing:
        return []
    which = "sample_packing" if d.get("sample_packing") else "eval_sample_packing"
    return [
        f"{tc.path}: {which} on a Gated-DeltaNet model ({family}) needs the kernels' sample boundaries, "
        f"else recurrent and conv state leaks from one packed sample into the next without an error; "
        f"missing here: {'; '.join(missing)}. Set sample_packing: false and eval_sample_packing: false, "
        "or install what is missing"
    ]


def fused_loss_active(tc: TrainingConfig) -> bool:
    """Whether the config computes the loss without logits (Liger FLCE or Cut Cross Entropy plugin)."""
    plugins = set(tc.data.get("plugins") or [])
    return any(p in plugins and tc.data.get(flag) for p, flag in FUSED_LOSS_PLUGINS.items())


def _weights_bytes(base: Path, cfg: dict) -> int | None:
    idx = base / "model.safetensors.index.json"
    if idx.is_file():
        try:
            return int(load_json_file(idx, 64 * MIB)["metadata"]["total_size"])
        except (OSError, KeyError, TypeError, ValueError):
            pass
    files = list(base.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) or None


def weights_bytes(tc: TrainingConfig) -> int | None:
    """Bytes of the local base's weights (its index's total_size, else its safetensors files), or None."""
    base = Path(str(tc.data.get("base_model", "")))
    return _weights_bytes(base, base_config(tc) or {}) if base.is_dir() else None


def logits_memory_problem(tc: TrainingConfig, gpus: list[Gpu], world: int = 1) -> str | None:
    """A message when materialised logits + weights are estimated not to fit the smallest GPU, else None.

    Estimate (bytes) = weights (the base's safetensors size, split over `world` GPUs when the config
    shards with FSDP) + micro_batch_size x sequence_len x vocab_size x LOGIT_BYTES_PER_ELEMENT.
    Activations are left out, so a refusal is certain, not borderline. Returns None when no GPU is
    detected, the base is not a local directory, or the loss is fused.
    """
    if not gpus or fused_loss_active(tc):
        return None
    cfg = base_config(tc)
    if cfg is None:
        return None
    text = cfg.get("text_config") or cfg
    vocab = text.get("vocab_size") or cfg.get("vocab_size")
    seq = tc.data.get("sequence_len")
    mbs = tc.data.get("micro_batch_size") or 1
    if not (isinstance(vocab, int) and isinstance(seq, int) and isinstance(mbs, int)):
        return None
    weights = _weights_bytes(Path(str(tc.data["base_model"])), cfg) or 0
    if tc.data.get("fsdp_version") or tc.data.get("fsdp_config"):
        weights //= max(1, world)
    logits = mbs * seq * vocab * LOGIT_BYTES_PER_ELEMENT
    gpu = min(gpus, key=lambda g: g.total_bytes)
    if weights + logits <= gpu.total_bytes:
        return None
    fit = max(0, (gpu.total_bytes - weights) // (mbs * vocab * LOGIT_BYTES_PER_ELEMENT))
    return (
        f"{tc.path}: this config materialises the {vocab:,}-wide logits: at sequence_len {seq} x micro_batch_size "
        f"{mbs} they need ~{logits / 1e9:.0f} GB (bf16 logits, fp32 upcast and log-softmax), plus "
        f"{weights / 1e9:.0f} GB of weights per GPU > {gpu.total_bytes / 1e9:.0f} GB on {gpu.name}. "
        "Fix: compute the loss without logits (plugins: [axolotl.integrations.liger.LigerPlugin] with "
        f"liger_fused_linear_cross_entropy: true), or lower sequence_len to <= {fit}"
    )
