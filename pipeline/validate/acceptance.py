"""The adapter's speed before it reaches a GPU: MTP acceptance estimated offline, base vs base + adapter.

What vLLM does (0.25.1 and main; issue 38): with `--speculative-config '{"method": "mtp"}'` it drafts
with the checkpoint's own MTP layer (`Qwen3_5MTP`), fed the TARGET's final hidden states; with a LoRA
adapter in the request the target is base + adapter, while the drafter stays the base's: `Qwen3_5MTP`
has no LoRA support and an adapter's `mtp.*` keys are skipped (`vllm/v1/worker/gpu/spec_decode/eagle/
utils.py`: the draft is not part of the LoRA adapter). An adapter that moves the target's argmax away
from what the MTP layer learnt lowers acceptance, and with it decode speed (issue 38's field report:
0.23 accepted per draft with the base, 0.0 with an adapter, TPOT ratio 0.645 on the H200).

The estimate (`estimate`): for each validation prompt (the conversation up to its first assistant turn,
rendered with the generation prompt), the target's greedy continuation (`NEW_TOKENS`), one forward for its
hidden states and argmax (the labels), then the base's MTP layer as vLLM runs it
(`pipeline.serving.mtp.draft_scores`: the first pass and later draft steps' exact context) over every
start position from the last prompt token on. Once with the adapter disabled (the base), once enabled.
Figures: `acceptance` per draft position k (drafts 1..k all equal the target's argmax: vLLM's per-position
acceptance rate under greedy verification) and `acceptance_length` 1 + their sum (vLLM's mean acceptance
length, `v1/spec_decode/metrics.py`).

The speed model (`speed_ratio`): a decode step runs one target forward and emits `acceptance_length`
tokens on average; the drafter's own forward is the same with and without the adapter; so at equal
forward cost the decode-speed ratio adapter/base is AL_adapter / AL_base, times the LoRA kernels' cost
factor `fleet.lora_speed_factor` (decode tok/s with the LoRA kernels / without, at equal acceptance:
0.93 from issue 38's H200 measurement of 5-9% for the punica kernels, 8 layers, warmed).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pipeline.artifacts.bounded import load_json_file
from pipeline.artifacts.safetensors import HeaderError, read_safetensors_header
from pipeline.errors import UsageError
from pipeline.serving.mtp import STEPS, MtpLayer, draft_scores
from pipeline.validate.chat import render_hf
from pipeline.validate.facts import AdapterFacts
from pipeline.validate.rules import Issue, check

MAX_PROMPTS = 16  # validation prompts the estimate runs on
BATCH = 8  # prompts generated together
NEW_TOKENS = 32  # greedy tokens per prompt: the positions drafts are scored at
MTP_PREFIX = "mtp."
DEFAULT_WARN_RATIO = 0.9  # below this predicted AL ratio a warning when fleet.min_acceptance_ratio is unset


class NoMtpLayer(UsageError, ValueError):
    """The checkpoint holds no `mtp.*` tensors (a checkpoint without an MTP layer: nothing to estimate; exit 2)."""


def checkpoint_shards(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its `model.safetensors.index.json` names, else `*.safetensors`."""
    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        wm = load_json_file(index, 64 << 20).get("weight_map") or {}
        return [ckpt / f for f in sorted(set(wm.values()))]
    return sorted(ckpt.glob("*.safetensors"))


def mtp_tensors(ckpt: Path) -> dict:
    """`mtp.*` name -> torch tensor (as stored) of the checkpoint `ckpt`.

    Raises NoMtpLayer when there are none, OSError / safetensors errors for unreadable shards.
    """
    from safetensors import safe_open

    out = {}
    for f in checkpoint_shards(ckpt):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys() if k.startswith(MTP_PREFIX)})
    if not out:
        raise NoMtpLayer(f"{ckpt}: no {MTP_PREFIX}* tensors (the checkpoint has no MTP layer to draft with)")
    return out


def has_mtp_layer(ckpt: Path) -> bool:
    """Whether the checkpoint holds `mtp.*` tensors (headers only; False when it cannot be read)."""
    try:
        return any(
            k.startswith(MTP_PREFIX) for f in checkpoint_shards(ckpt) for k in read_safetensors_header(f)
        )
    except (HeaderError, OSError, ValueError):
        return False


class Target:
    """The target model's parts the drafter reads: embedding, lm_head, rotary, final hidden states.

    `model`: a `peft.PeftModel` (base + adapter; `disable_adapter()` gives the base) or a transformers
    model, text (`Qwen3_5ForCausalLM`) or VL (`Qwen3_5ForConditionalGeneration`) class.
    """

    def __init__(self, model):
        self.model = model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner = lm.model
        self.text = getattr(inner, "language_model", inner)
        self.embed = lm.get_input_embeddings()
        self.lm_head = lm.get_output_embeddings()
        self.rotary = self.text.rotary_emb
        self.text_cfg = lm.config.get_text_config()
        self.device = next(lm.parameters()).device

    def continuations(self, prompts: list[list[int]], new_tokens: int, pad_id: int, eos: set[int]) -> list:
        """[1, P + n] id tensors: each prompt and the target's greedy continuation, cut after the first EOS.

        Generated as left-padded batches of `BATCH` (exact for Qwen3.5 in transformers: padded positions are
        masked in attention and zeroed before the Gated DeltaNet recurrence; `pipeline.validate.behaviour.greedy`).
        """
        import torch

        out = []
        for i in range(0, len(prompts), BATCH):
            batch = prompts[i : i + BATCH]
            width = max(map(len, batch))
            x = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            with torch.no_grad():
                y = self.model.generate(
                    input_ids=x,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            for p, row in zip(batch, y[:, width:].tolist(), strict=True):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                out.append(torch.tensor([p + row[:cut]], device=self.device))
        return out

    def hidden_and_labels(self, ids):
        """(final hidden states after the final norm [1, T, H], the target's argmax at every position [1, T])."""
        import torch

        with torch.no_grad():  # not inference_mode: distillation feeds these to autograd (as constants)
            h = self.text(input_ids=ids).last_hidden_state
            return h, self.lm_head(h).argmax(-1)


def prompts_of(tok, conversations: list[dict], limit: int = MAX_PROMPTS) -> list[list[int]]:
    """Token ids of each conversation up to its first assistant turn, rendered with the generation prompt."""
    out = []
    for conv in conversations:
        msgs = conv.get("messages") or []
        cut = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
        if not cut:
            continue
        text = render_hf(tok, msgs[:cut], conv.get("tools"), add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if ids:
            out.append(ids)
        if len(out) >= limit:
            break
    return out


def eos_ids(model, tok) -> set[int]:
    """The ids that end a generation: the model's generation config's and the tokenizer's EOS."""
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(e) if isinstance(e, list) else {e}
    return {i for i in ids | {tok.eos_token_id} if i is not None}


def digest(prompts: list[list[int]]) -> str:
    """sha256 of the prompt ids (what an estimate or a distillation was computed on)."""
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()


def sequences(
    target: Target, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_ids=()
) -> list[tuple]:
    """[(ids [1, T], hidden [1, T, H], labels [1, T], first)] per prompt: the target's greedy continuation, its final
    hidden states and argmax, and the first draft start (the last prompt token: vLLM's first draft after the
    prefill). Prompts whose continuation is shorter than `STEPS` tokens (EOS at once) are left out."""
    eos = {t for t in (eos_ids or []) if t is not None}
    out = []
    for p, ids in zip(prompts, target.continuations(prompts, new_tokens, pad_id, eos), strict=True):
        if ids.shape[1] - len(p) < STEPS:
            continue
        h, labels = target.hidden_and_labels(ids)
        out.append((ids, h, labels, len(p) - 1))
    return out


def score(target: Target, mtp: MtpLayer, seqs: list[tuple]) -> dict:
    """The drafter's figures on `sequences(...)`, from each sequence's first draft start on.

    Returns {"acceptance": [per draft position], "agreement": [...], "acceptance_length", "positions",
    "sequences"} (fractions of draft start positions, weighted by each sequence's positions; None without any).
    """
    acc, agree, n = [0.0] * STEPS, [0.0] * STEPS, 0
    for ids, h, labels, first in seqs:
        s = draft_scores(mtp, target.embed, target.lm_head, h, ids, labels, target.rotary, first, STEPS)
        w = s["positions"]
        acc = [a + x * w for a, x in zip(acc, s["acceptance"], strict=True)]
        agree = [a + x * w for a, x in zip(agree, s["agreement"], strict=True)]
        n += w
    if not n:
        return {
            "acceptance": None,
            "agreement": None,
            "acceptance_length": None,
            "positions": 0,
            "sequences": 0,
        }
    acc = [round(a / n, 4) for a in acc]
    return {
        "acceptance": acc,
        "agreement": [round(a / n, 4) for a in agree],
        "acceptance_length": round(1 + sum(acc), 4),
        "positions": n,
        "sequences": len(seqs),
    }


def estimate(
    model,
    tok,
    conversations: list[dict],
    mtp_state: dict,
    new_tokens: int = NEW_TOKENS,
    limit: int = MAX_PROMPTS,
) -> dict:
    """MTP acceptance of the base's drafter with the base and with base + adapter as the target.

    Args:
        model: `peft.PeftModel` (base + adapter), in eval mode.
        tok: the base's transformers tokenizer.
        conversations: chat conversations (the adapter's validation set); at most `MAX_PROMPTS` are used.
        mtp_state: `mtp.*` tensors of the drafter (the base checkpoint's: `mtp_tensors`).
        new_tokens: greedy tokens generated per prompt; limit: prompts used at most.
    Returns {"base": figures, "adapter": figures (`score`), "prompts", "new_tokens", "data_sha256",
    "acceptance_ratio": AL_adapter / AL_base (None when either is missing)}.
    """
    target = Target(model)
    mtp = MtpLayer(target.text_cfg, mtp_state, target.device)
    mtp.train(False)
    prompts = prompts_of(tok, conversations, limit)
    pad, eos = tok.pad_token_id or 0, eos_ids(model, tok)
    with model.disable_adapter():
        base = score(target, mtp, sequences(target, prompts, new_tokens, pad, eos))
    adapter = score(target, mtp, sequences(target, prompts, new_tokens, pad, eos))
    return {
        "base": base,
        "adapter": adapter,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "data_sha256": digest(prompts),
        "acceptance_ratio": ratio(adapter["acceptance_length"], base["acceptance_length"]),
    }


def measure(model, tok, conversations: list[dict], base_dir: Path) -> dict:
    """`estimate` with the base checkpoint's own MTP layer, or {"unavailable": why} (no `mtp.*` tensors in
    `base_dir`, no validation conversation)."""
    try:
        state = mtp_tensors(base_dir)
    except NoMtpLayer as e:
        return {"unavailable": str(e)}
    if not conversations:
        return {"unavailable": "no validation conversations to estimate on"}
    return estimate(model, tok, conversations, state)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 4 places, None when either is missing or not finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 4)


def speed_ratio(acceptance_ratio: float | None, lora_speed_factor: float) -> float | None:
    """Predicted decode tok/s with the adapter / the base's: AL ratio x the LoRA kernels' factor (module doc)."""
    return None if acceptance_ratio is None else round(acceptance_ratio * lora_speed_factor, 4)


def summary(est: dict, lora_speed_factor: float) -> dict:
    """The figures recorded on a version (`pipeline.registry.versions`): flat, numbers as numbers."""
    b, a = est["base"], est["adapter"]
    return {
        "acceptance_length_base": b["acceptance_length"],
        "acceptance_length_adapter": a["acceptance_length"],
        "acceptance_base": b["acceptance"],
        "acceptance_adapter": a["acceptance"],
        "acceptance_ratio": est["acceptance_ratio"],
        "speed_ratio": speed_ratio(est["acceptance_ratio"], lora_speed_factor),
        "lora_speed_factor": lora_speed_factor,
        "positions": a["positions"],
        "prompts": est["prompts"],
        "data_sha256": est["data_sha256"],
    }


def gate(ratio_: float | None, minimum: float | None) -> tuple[str, str] | None:
    """(severity, why) when the predicted acceptance ratio keeps an adapter back, else None.

    `minimum` is `fleet.min_acceptance_ratio`: set, a ratio below it (or none measured) is an error; unset,
    a ratio below `DEFAULT_WARN_RATIO` is a warning.
    """
    if minimum is not None:
        if ratio_ is None:
            return "error", f"MTP acceptance not estimated while fleet.min_acceptance_ratio is {minimum}"
        if ratio_ < minimum:
            return "error", f"predicted MTP acceptance ratio {ratio_} < fleet.min_acceptance_ratio {minimum}"
        return None
    if ratio_ is not None and ratio_ < DEFAULT_WARN_RATIO:
        return "warning", f"predicted MTP acceptance ratio {ratio_} < {DEFAULT_WARN_RATIO}"
    return None


@check(
    "behaviour.acceptance",
    "warning",
    "predicted MTP acceptance length with the adapter / the base's (the base's MTP layer drafting for base + "
    "adapter) below `fleet.min_acceptance_ratio`, or below 0.9 while that is unset; or not estimated while it is set",
    option="behaviour",
    severity_doc="warning; error when `fleet.min_acceptance_ratio` is set",
)
def acceptance(ctx: AdapterFacts):
    fact = ctx.behaviour
    if fact.value is None or not ctx.rules.speculative_mtp:
        return
    est = fact.value.get("acceptance")
    minimum = ctx.rules.min_acceptance_ratio
    if not isinstance(est, dict) or "base" not in est:
        why = (est or {}).get("unavailable", "not estimated") if isinstance(est, dict) else "not estimated"
        if minimum is not None:
            yield Issue(
                f"MTP acceptance not estimated ({why}) while fleet.min_acceptance_ratio is {minimum}: pass a base "
                "with its mtp.* tensors (--base), or unset fleet.min_acceptance_ratio",
                str(ctx.base_dir or ""),
                "error",
            )
        return
    figures = summary(est, ctx.rules.lora_speed_factor)
    ctx.stats["acceptance"] = figures
    verdict = gate(figures["acceptance_ratio"], minimum)
    if verdict:
        severity, why = verdict
        yield Issue(
            f"{why}: acceptance length {figures['acceptance_length_adapter']} with the adapter vs "
            f"{figures['acceptance_length_base']} for the base on {figures['prompts']} validation prompts "
            f"(predicted decode speed {figures['speed_ratio']}x the base's); the base's MTP layer drafts for the "
            f"adapter on vLLM: train a drafter for this version (`pipeline draft NAME --version N`) or serve it "
            "merged (`pipeline merge --quantize nvfp4`)",
            str(ctx.adapter_dir),
            severity,
        )
