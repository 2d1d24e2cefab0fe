"""The PEFT + transformers reference the canary compares a staging engine with.

The base is loaded with transformers (float32 by default: the bf16 weights upcast, so the
reference is exact for them) and the adapter with peft, on a GPU when torch sees one, else
CPU, with the model class whose module names the adapter's tensors use
(`pipeline.artifacts.peft_model.load_peft`; a load that leaves a tensor unapplied is refused). The engine's greedy tokens are then teacher-forced through the reference: one forward
pass per prompt gives, at every generated position, the reference's argmax and the log-
probabilities of the tokens the engine reported. Greedy decoding by the reference reproduces
the engine's tokens up to the first position where its argmax differs (the same argument as
`pipeline.validate.behaviour.greedy_matches`), so this also gives the first divergence.

An adapter whose `adapter_config.json` `r` disagrees with its tensors cannot be loaded by
peft (shape mismatch), while vLLM serves it scaled by `lora_alpha / r_config`
(docs/vllm.md). The reference is what training computed: peft with the
tensors' rank, so the scale is `lora_alpha / rank` (rsLoRA: `/ sqrt(rank)`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.adapter import (
    CONFIG_FILE,
    adapter_tensors,
    load_adapter_config,
    parse_key,
    read_adapter_config,
)
from pipeline.artifacts.peft_model import load_peft


@dataclass
class PositionScore:
    """The reference at one generated position: its argmax and logprobs (nats) of some tokens."""

    argmax: int
    argmax_logprob: float
    logprobs: dict[int, float]


def rank_mismatches(adapter_dir: Path) -> list[tuple[str, int, int]]:
    """[(peft module name, rank in adapter_config.json, rank of its lora_A tensor)] where they differ.

    Reads the safetensors header only. Raises FileNotFoundError / HeaderError for a missing or
    unreadable weights file.
    """
    cfg = load_adapter_config(adapter_dir)
    out = []
    for name, info in adapter_tensors(adapter_dir).items():
        k = parse_key(name)
        if k is None or k.kind != "A" or not info.shape:
            continue
        rank = int(info.shape[0])
        declared = cfg.rank_for(k.peft_module)
        if declared != rank:
            out.append((k.peft_module, declared, rank))
    return sorted(out)


def trained_rank_copy(adapter_dir: Path, work: Path) -> tuple[Path, list[str]]:
    """The adapter as training saw it: a copy whose config ranks equal the tensors' (or the dir itself).

    Returns (directory to load with peft, notes). The copy sets `r` to the most common tensor
    rank and `rank_pattern` for the other modules; alphas are kept, so each module's scale is
    the one training used.
    """
    bad = rank_mismatches(adapter_dir)
    if not bad:
        return Path(adapter_dir), []
    ranks = {}
    for name, info in adapter_tensors(adapter_dir).items():
        k = parse_key(name)
        if k is not None and k.kind == "A" and info.shape:
            ranks[k.peft_module] = int(info.shape[0])
    common = Counter(ranks.values()).most_common(1)[0][0]
    raw = dict(read_adapter_config(Path(adapter_dir)).raw)  # bounded (pipeline.artifacts.bounded)
    raw["r"] = common
    raw["rank_pattern"] = {re.escape(m): r for m, r in sorted(ranks.items()) if r != common}
    dst = Path(work) / "reference-adapter"
    shutil.copytree(adapter_dir, dst)
    (dst / CONFIG_FILE).chmod(0o644)
    (dst / CONFIG_FILE).write_text(json.dumps(raw, indent=2))
    m, declared, rank = bad[0]
    return dst, [
        f"adapter_config.json declares r={declared} but the tensors have rank {rank} "
        f"({len(bad)} module(s), e.g. {m}): the reference uses the tensors' rank (the scale training used)"
    ]


class Reference:
    """Base + adapter loaded once; `score` teacher-forces token sequences with or without the adapter.

    Args:
        base_dir: transformers-loadable base checkpoint (the bf16 base the adapter was trained on).
        adapter_dir: PEFT adapter directory (its ranks already consistent, see `trained_rank_copy`).
        dtype: "float32" or "bfloat16".

    Raises whatever transformers/peft raise for an unloadable checkpoint (the caller wraps it).
    """

    def __init__(self, base_dir: Path, adapter_dir: Path, dtype: str = "float32"):
        import torch

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # the class whose modules the adapter's keys name (a VL-trained adapter on the causal-LM class
        # would load none of its tensors: pipeline.artifacts.peft_model), straight onto the device
        self.model = load_peft(base_dir, adapter_dir, dtype, self.device)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The reference's own greedy continuation (adapter on) of `prompt`: up to `max_tokens` ids
        (transformers' `generate`, greedy; it stops after an EOS id)."""
        import torch

        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        x = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=getattr(cfg, "pad_token_id", None) or 0,
            )
        return out[0, len(prompt) :].tolist()

    def token_logprobs(self, prompt: list[int], tokens: list[int], adapter: bool) -> list[float]:
        """log p(tokens[j] | prompt + tokens[:j]) for every j, with or without the adapter (nats)."""
        if not tokens:
            return []
        return [
            s.logprobs[t]
            for s, t in zip(self.score(prompt, tokens, [[] for _ in tokens], adapter), tokens, strict=True)
        ]

    def score(
        self, prompt: list[int], generated: list[int], query: list[list[int]], adapter: bool
    ) -> list[PositionScore]:
        """Reference scores at each generated position.

        Args:
            prompt: prompt token ids (length P).
            generated: the engine's generated token ids (length G >= 1).
            query: per generated position, the token ids whose logprobs are wanted (the engine's
                top tokens); the generated token is always added.
            adapter: False runs the base alone (adapter disabled).

        Returns G scores. One forward over P + G - 1 tokens; logits [P+G-1, vocab] in float32.
        """
        import contextlib

        import torch

        x = torch.tensor([prompt + generated[:-1]], device=self.device)
        ctx = contextlib.nullcontext() if adapter else self.model.disable_adapter()
        with torch.inference_mode(), ctx:
            logits = self.model(input_ids=x).logits[0, len(prompt) - 1 :].float()
        lp = torch.log_softmax(logits, -1).cpu()
        top_lp, top_id = lp.max(-1)
        out = []
        for j, tok in enumerate(generated):
            ids = set(query[j]) | {tok}
            out.append(
                PositionScore(
                    int(top_id[j]),
                    float(top_lp[j]),
                    {t: float(lp[j, t]) for t in ids if 0 <= t < lp.shape[1]},
                )
            )
        return out
