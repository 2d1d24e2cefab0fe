"""Tensor names of a distributed run's adapter, without the wrappers FSDP2/FSDP1/torch.compile insert."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import CheckFailed

# Module names that FSDP2's activation checkpointing (torch.distributed checkpoint_wrapper), FSDP1 and
# torch.compile insert between a module and its children: the PEFT state dict of an FSDP2 run with
# `fsdp_config.activation_checkpointing: true` has keys like
# `...layers.0._checkpoint_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.lora_A.weight`
# (measured on 2 H200s, benchmarks/RESULTS.md), which no server maps to the base's modules.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def normalise_adapter_keys(path: Path) -> int:
    """Rewrite `path` (adapter_model.safetensors) without WRAPPER_SEGMENTS in tensor names.

    Returns the number of renamed tensors (0: file untouched). Raises CheckFailed when two tensors
    would get the same name.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        metadata = f.metadata()
        renames = {}
        for k in keys:
            new = k
            for seg in WRAPPER_SEGMENTS:
                new = new.replace(seg, "")
            if new != k:
                renames[k] = new
        if not renames:
            return 0
        tensors = {renames.get(k, k): f.get_tensor(k) for k in keys}
    if len(tensors) != len(keys):
        raise CheckFailed(f"{path}: removing wrapper names from tensor names makes two tensors collide")
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return len(renames)
