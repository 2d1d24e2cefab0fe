"""Parity gate: a merged checkpoint must behave like base + adapter applied by peft.

Both models run in fp32 on CPU from the checkpoints on disk: the reference is the bf16 base with
the adapter through `peft.PeftModel` (unmerged, fp32 LoRA weights); the candidate is the merged
checkpoint. The only expected difference is the one rounding of each merged weight to the output
dtype, so:

- logits over every position of each canary prompt must agree within
  `ROUNDINGS * unit roundoff(dtype) * max|reference logit|` (bf16: 8-bit significand, unit
  roundoff 2^-8; 4 roundings allow for accumulation across layers; measured on the tiny base:
  ~1 rounding, while a wrong scale or a missing module is 10-100x larger);
- greedy continuations must be token-identical, except a divergence at a step where the
  reference's top-2 logit margin is itself within the tolerance (a tie that rounding may flip;
  reported as `near_tie`).

Needs a checkpoint transformers can load as a causal LM (the text layout): the 27B needs ~2 x
108 GB of fp32 RAM, so it runs on small models or a large host (`parity="auto"` decides).
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.artifacts.checkpoint import read_checkpoint
from pipeline.artifacts.manifest import MergedManifest, MergeParity
from pipeline.artifacts.peft_model import load_peft
from pipeline.errors import CheckFailed, UsageError

ROUNDINGS = 4
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
AUTO_MAX_BYTES = 4 << 30
SMALL_BYTES = (
    256 << 20
)  # below this, parity runs single-threaded (see check_parity)  # parity="auto" runs on bases up to this many weight bytes
CANARY_PROMPTS = (
    "What is the weather in Tokyo right now?",
    "Call the get_weather tool for Paris and report the result.",
    "Summarise: the quick brown fox jumps over the lazy dog.",
    "List three prime numbers and explain why they are prime.",
)


def parity_skip_reason(base_dir: Path, layout: str, weight_bytes: int) -> str | None:
    """Why `auto` parity cannot run on this base (None: it can)."""
    if layout != "text":
        return f"{layout} layout: transformers cannot load it as a causal LM (run parity on the text-layout twin)"
    if weight_bytes > AUTO_MAX_BYTES:
        return f"base has {weight_bytes / 2**30:.1f} GiB of weights; two fp32 copies do not fit: run with --parity on a large host"
    return None


def _prompts(tokenizer, prompts) -> list:
    import torch

    out = []
    for p in prompts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                return_dict=True,
                return_tensors="pt",
            )["input_ids"]
        else:
            ids = tokenizer(p, return_tensors="pt")["input_ids"]
        out.append(ids.to(torch.long))
    return out


def check_parity(
    base_dir: Path,
    adapter_dir: Path,
    merged_dir: Path,
    dtype: str = "bfloat16",
    prompts=CANARY_PROMPTS,
    max_new_tokens: int = 8,
    threads: int | None = None,
) -> dict:
    """Compare the merged checkpoint with base + adapter through peft.

    Returns a JSON-able verdict: {verdict: pass|fail, max_abs_diff, tolerance, max_abs_logit,
    adapter_effect (max |base+adapter - base| logit: how much the adapter changes the output),
    greedy_equal, near_ties, prompts: [...per prompt...], reasons: [...]}.

    threads: torch intra-op threads for the run (restored after); 1 suits tiny models on shared
    cores, where OpenMP spinning made the same check take 74 s with 2 threads vs 6.8 s with 1.

    Raises whatever transformers/peft raise for unloadable checkpoints (OSError, ValueError).
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _check_parity(base_dir, adapter_dir, merged_dir, dtype, prompts, max_new_tokens)
    finally:
        torch.set_num_threads(before)


def _check_parity(base_dir, adapter_dir, merged_dir, dtype, prompts, max_new_tokens) -> dict:
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(merged_dir))
    with torch.no_grad():
        # the class whose modules the adapter's keys name (a VL-trained adapter on the causal-LM
        # class would apply none of its tensors: the reference would be the base)
        ref = load_peft(base_dir, adapter_dir, "float32")
        inputs = _prompts(tok, prompts)
        with ref.disable_adapter():
            base_logits = [ref(ids).logits for ids in inputs]
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
        per_prompt, reasons = [], []
        worst = effect = scale = 0.0
        ties = 0
        for text, ids, lb in zip(prompts, inputs, base_logits, strict=True):
            lr, lm = ref(ids).logits, merged(ids).logits
            diff = (lr - lm).abs().max().item()
            diff = diff if math.isfinite(diff) else math.inf  # NaN: max() below would drop it and pass
            worst, scale = max(worst, diff), max(scale, lr.abs().max().item())
            effect = max(effect, (lr - lb).abs().max().item())
            gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            out_r = ref.generate(ids, output_logits=True, return_dict_in_generate=True, **gen)
            out_m = merged.generate(ids, **gen)
            tr, tm = out_r.sequences[0, ids.shape[1] :].tolist(), out_m[0, ids.shape[1] :].tolist()
            first = next((i for i, (a, b) in enumerate(zip(tr, tm, strict=False)) if a != b), None)
            if first is None and len(tr) != len(tm):
                first = min(len(tr), len(tm))
            margin = None
            if first is not None and first < len(out_r.logits):
                top = out_r.logits[first][0].float().topk(2).values
                margin = (top[0] - top[1]).item()
            per_prompt.append(
                {
                    "prompt": text,
                    "max_abs_diff": diff,
                    "ref_tokens": tr,
                    "merged_tokens": tm,
                    "first_divergence": first,
                    "ref_margin_at_divergence": margin,
                }
            )
        tol = ROUNDINGS * UNIT_ROUNDOFF[dtype] * max(scale, 1e-6)
        if not math.isfinite(tol):
            # an infinite reference logit makes the tolerance infinite: every difference and every
            # divergence (margin <= 2 x inf) would pass
            reasons.append(
                f"the reference's logits are not finite (max |logit| {scale}): no tolerance can be set; "
                f"check the adapter's values (pipeline validate) and the base"
            )
        for p in per_prompt:
            if p["first_divergence"] is None:
                continue
            margin = p["ref_margin_at_divergence"]
            if margin is not None and math.isfinite(tol) and margin <= 2 * tol:
                ties += 1  # the reference itself was undecided within rounding
            else:
                reasons.append(
                    f"greedy tokens differ at step {p['first_divergence']} for prompt {p['prompt']!r}"
                )
        if worst > tol:
            reasons.insert(
                0,
                f"max |logit difference| {worst:.3g} > tolerance {tol:.3g} "
                f"({ROUNDINGS} x {dtype} unit roundoff x max |logit| {scale:.3g})",
            )
    return {
        "verdict": "fail" if reasons else "pass",
        "max_abs_diff": worst,
        "tolerance": tol,
        "max_abs_logit": scale,
        "adapter_effect": effect,
        "greedy_equal": all(p["first_divergence"] is None for p in per_prompt),
        "near_ties": ties,
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.time() - t0, 2),
        "reasons": reasons,
        "prompts": per_prompt,
    }


class ParityFailed(CheckFailed):
    """The merged checkpoint does not reproduce base + adapter (exit 1); `verdict` has the numbers."""

    def __init__(self, message: str, verdict: dict):
        super().__init__(message)
        self.verdict = verdict


def parity_gate(base_dir: Path, adapter_dir: Path, dtype: str, mode: str = "auto"):
    """A `finalize` callable for `merge_adapter` that records the parity verdict in the manifest.

    mode: `auto` (run when the base is a loadable text layout of at most `AUTO_MAX_BYTES`),
    `on` (always; UsageError now if it cannot run), `off` (recorded as skipped).
    The callable raises ParityFailed on a failing verdict, so the merge is discarded.
    """

    if mode not in ("auto", "on", "off"):
        raise UsageError(f"--parity {mode!r}: use auto, on or off")
    ck = read_checkpoint(base_dir)
    weight_bytes = sum(t.nbytes for t in ck.tensors.values())
    reason = "--parity off" if mode == "off" else parity_skip_reason(base_dir, ck.layout, weight_bytes)
    if mode == "on" and reason and ck.layout != "text":
        raise UsageError(f"--parity on: {reason}")

    def finalize(partial: Path, manifest: MergedManifest) -> None:
        if reason and mode != "on":
            manifest.parity = MergeParity(verdict="skipped", reason=reason)
            return
        v = check_parity(
            base_dir, adapter_dir, partial, dtype=dtype, threads=1 if weight_bytes < SMALL_BYTES else None
        )
        manifest.parity = MergeParity.model_validate(v)
        if v["verdict"] != "pass":
            raise ParityFailed(
                "parity gate failed: merged model differs from base + adapter through peft:\n  "
                + "\n  ".join(v["reasons"]),
                v,
            )

    return finalize


def parity_tags(
    out: Path, parity: MergeParity | None, manifest: MergedManifest | None = None
) -> dict[str, str]:
    """MLflow model-version tags summarising a merge and its parity verdict.

    `manifest`: the merged checkpoint's (None when the merge was discarded: only the verdict is known).
    """
    merge = manifest.merge if manifest else None
    tags = {
        "merge.parity": parity.verdict if parity else "unknown",
        "merge.path": str(out),
        "merge.dtype": merge.dtype if merge else "",
        "merge.merged_modules": str(merge.merged_modules) if merge else "",
    }
    for k in ("max_abs_diff", "tolerance", "adapter_effect", "greedy_equal", "reason"):
        if parity and getattr(parity, k) is not None:
            tags[f"merge.parity.{k}"] = str(getattr(parity, k))
    q = manifest.quantization if manifest else None
    if q:  # what the served (NVFP4) merge was quantized with
        tags.update(
            {
                "merge.format": q.format,
                "merge.quantizer": f"{q.tool} {q.version}",
                "merge.quantizer.config": f"{q.config} + {','.join(q.extra_disabled)} disabled",
                "merge.quantizer.calibration_sha256": str(q.calibration.get("token_ids_sha256")),
                "merge.quantizer.hf_quant_config_sha256": str(q.hf_quant_config_sha256),
                "merge.served_parity": manifest.served_parity.status if manifest.served_parity else "pending",
            }
        )
    return tags
