"""Import what `vllm serve` (ModelOpt NVFP4 Qwen3.5, LoRA, MTP, OpenAI server + /metrics) and the
nvidia-modelopt quantizer import, with the bundle on PYTHONPATH; print one JSON line; exit 1 if any fails.

Run by `scripts/gpu/vllm_bundle.sh --check` against a Python 3.12 virtualenv that mirrors the GPU image
(no driver there: the CUDA-only checks are reported as skipped) and at the start of a device call (with
the driver: FA3, Marlin FP4 and the platform are checked too).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

MODULES = [
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.serve.instrumentator.metrics",  # /metrics (the canary reads it)
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.sampler",
    "vllm.v1.structured_output",
    "vllm.v1.metrics.loggers",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.model_executor.models.qwen3_5",
    "vllm.model_executor.models.qwen3_5_mtp",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.fla.ops",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "vllm.model_executor.model_loader",
    "vllm.lora.layers",
    "vllm.lora.model_manager",
    "vllm.lora.worker_manager",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "modelopt.torch.quantization",
    "modelopt.torch.export",
]


def _cuda_checks() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
    }
    from vllm.platforms import current_platform

    out["platform"] = type(current_platform).__name__
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported

    out["fp4_marlin"] = bool(is_fp4_marlin_supported())
    try:
        from vllm.vllm_flash_attn import _vllm_fa3_C  # noqa: F401

        out["fa3"] = True
    except ImportError as e:
        out["fa3"] = f"ImportError: {e}"
    return out


def main() -> int:
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - report every kind, SystemExit included
            msg = f"{type(e).__name__}: {e}"
            # without a driver (the CPU mirror), only the driver's own library may be missing
            if "libcuda.so" in msg and not os.path.exists("/dev/nvidiactl"):
                continue
            failed[name] = msg[:300]
    try:
        cuda = _cuda_checks()
    except BaseException as e:  # noqa: BLE001
        cuda = {"error": f"{type(e).__name__}: {e}"[:300]}
        failed["cuda_checks"] = cuda["error"]
    import vllm

    print(
        json.dumps(
            {"vllm": vllm.__version__, "python": sys.version.split()[0], "failed": failed, "cuda": cuda}
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
