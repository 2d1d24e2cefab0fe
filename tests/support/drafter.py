"""Test helpers for the MTP estimate and the drafter: short conversations, VL-layout adapters, and a tiny base
whose MTP layer was distilled on the base's own outputs (so that the base has an acceptance to lose)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.helpers import peft_adapter

WORDS = [
    "tokyo",
    "rows",
    "docs",
    "invoice",
    "weather",
    "deploy",
    "logs",
    "cache",
    "queue",
    "index",
    "alert",
    "user",
]
_DRAFTED: dict[str, Path] = {}


def conversations(n: int, offset: int = 0) -> list[dict]:
    """`n` short chat conversations (prompts of ~20 tokens: the CPU suite trains on them in seconds)."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"{WORDS[(i + offset) % len(WORDS)]} {i + offset}"},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, convs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


def vl_adapter(base: Path, out: Path, **kw) -> Path:
    """A PEFT LoRA keyed for the VL layout (`model.language_model.layers.N`), as axolotl writes for the real base."""
    from safetensors.torch import load_file, save_file

    text = peft_adapter(base, out.with_name(out.name + "-text"), **kw)
    shutil.copytree(text, out)
    t = load_file(str(text / "adapter_model.safetensors"))
    save_file(
        {
            k.replace("base_model.model.model.layers", "base_model.model.model.language_model.layers"): v
            for k, v in t.items()
        },
        str(out / "adapter_model.safetensors"),
    )
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            shutil.copy2(base / f, out / f)
    return out


def write_mtp(ckpt: Path, state: dict) -> None:
    """Replace the `mtp.*` tensors of checkpoint `ckpt` in place (same names, shapes, dtypes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as sf:
            part = {k: sf.get_tensor(k) for k in sf.keys()}
        if any(k in state for k in part):
            save_file(
                {k: state.get(k, v).to(v.dtype) for k, v in part.items()},
                str(shard),
                metadata={"format": "pt"},
            )


def drafted_base(tiny_vl_base: Path, factory) -> Path:
    """A copy of the tiny VL base whose MTP layer is distilled on the base's own greedy continuations (once per
    session): its estimate for the base is above 1, so an adapter that moves the argmax has something to lose."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from pipeline.draft.distillation import distil
    from pipeline.validate.acceptance import mtp_tensors

    if "base" not in _DRAFTED:
        out = factory.mktemp("drafted-base") / "base"
        shutil.copytree(tiny_vl_base, out)
        tok = AutoTokenizer.from_pretrained(str(out))
        model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
            str(out), dtype=torch.float32
        ).eval()
        state, rep = distil(
            model, tok, conversations(8), conversations(4, offset=8), mtp_tensors(out),
            budget_s=600, max_steps=40, lr=1e-2, new_tokens=16, eval_every=10,
        )  # fmt: skip
        assert rep["after"]["acceptance_length"] > 1.0, rep
        write_mtp(out, state)
        _DRAFTED["base"] = out
    return _DRAFTED["base"]
