"""Load a base checkpoint and a PEFT adapter with transformers + peft so that every adapter tensor applies.

`AutoModelForCausalLM` maps a Qwen3.5 vision-language config (`Qwen3_5ForConditionalGeneration`, the
real checkpoint layout) to the text-only `Qwen3_5ForCausalLM`, whose modules are `model.layers.N...`
(transformers 5.16/5.17 `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["qwen3_5"]`; the VL checkpoint's weights are
renamed on load). An adapter trained on the VL class (axolotl with `model_type:
Qwen3_5ForConditionalGeneration`) names `base_model.model.model.language_model.layers.N...`: peft then
finds none of its keys, warns ("Found missing adapter keys"), keeps lora_B at zero and the "adapter"
computes the base. Measured on the tiny VL base: adapter effect 0.0 instead of 1.2 in the logits.

`load_peft` picks the class whose module names the adapter's tensors use (the checkpoint's own
`architectures[0]` for VL-layout keys, `AutoModelForCausalLM` otherwise) and refuses a load that left
any adapter tensor unapplied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.artifacts.adapter import adapter_tensors
from pipeline.errors import CheckFailed

_LOADED = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.weight)?$")


class AdapterNotApplied(CheckFailed, ValueError):
    """peft loaded the adapter but some of its tensors name no module of the base model (exit 1, as a mismatch)."""


def _model_class(base_dir: Path, tensor_names: list[str]):
    """The transformers class to load `base_dir` with so that modules match `tensor_names`."""
    import transformers

    if any(".language_model." in n for n in tensor_names):
        try:
            arch = (json.loads((Path(base_dir) / "config.json").read_text()).get("architectures") or [""])[0]
        except (OSError, json.JSONDecodeError):
            arch = ""
        cls = getattr(transformers, arch, None) if arch else None
        return cls if cls is not None else transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_peft(base_dir: Path, adapter_dir: Path, dtype: str = "float32", device: str | None = None):
    """Base + adapter as a `peft.PeftModel` in eval mode.

    Args:
        base_dir: transformers-loadable checkpoint the adapter was trained on.
        adapter_dir: PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`).
        dtype: torch dtype name of the weights ("float32", "bfloat16").
        device: "cuda" loads the weights straight onto the GPU (no CPU copy at `dtype`); None or "cpu": CPU.

    Raises AdapterNotApplied naming the first unapplied tensors, and whatever transformers/peft raise
    for an unloadable checkpoint.
    """
    import torch
    from peft import PeftModel

    names = sorted(adapter_tensors(adapter_dir))
    cls = _model_class(base_dir, names)
    kw = {"device_map": device} if device and device != "cpu" else {}
    base = cls.from_pretrained(str(base_dir), dtype=getattr(torch, dtype), **kw)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    params = {n for n, _ in model.named_parameters()}
    # a saved `X.lora_A.weight` lives at `X.lora_A.default.weight` once loaded (peft's adapter name)
    missing = [n for n in names if _LOADED.sub(r".\1.default\2", n) not in params]
    if missing:
        raise AdapterNotApplied(
            f"{len(missing)} of {len(names)} adapter tensors name no module of {type(base).__name__} loaded from "
            f"{base_dir} (e.g. {missing[0]}): the adapter was trained on another layout or another base"
        )
    return model
