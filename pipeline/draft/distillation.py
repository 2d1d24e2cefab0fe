"""Self-distil the MTP layer for one adapter: the drafter learns the adapted target's own argmax.

vLLM drafts for a LoRA request with the base's MTP layer fed the adapted target's hidden states
(`pipeline.validate.acceptance`); a drafter trained on the adapted target's behaviour wins the acceptance
back (vllm-project/speculators #366: acceptance length 2.01 -> 2.46 after fine-tuning the MTP head on the
target's outputs; FastMTP and EDA report the same direction for fine-tuned targets).

Recipe (`distil`):
1. prompts: the adapter's training conversations up to their first assistant turn (the estimate's held-out
   prompts are the validation conversations, never trained on);
2. the adapted target's greedy continuations of them, then one forward for its final hidden states and
   argmax (the labels); the base and the LoRA are frozen (`requires_grad` off), only `mtp.*` trains;
3. AdamW on the MTP layer from the base's weights, cross-entropy to the labels for draft steps 1-3 in the
   exact context vLLM builds (`pipeline.serving.mtp.draft_loss`), until the time budget; every `eval_every`
   steps the acceptance length on a held-out eighth of the training sequences, the best state kept;
4. the estimate before (the base's MTP layer) and after (the kept state) on the validation prompts.
"""

from __future__ import annotations

import random
import time

from pipeline.serving.mtp import STEPS, MtpLayer, draft_loss
from pipeline.validate.acceptance import (
    MAX_PROMPTS,
    NEW_TOKENS,
    Target,
    digest,
    eos_ids,
    prompts_of,
    score,
    sequences,
)

MAX_TRAIN_PROMPTS = 256


def distil(
    model,
    tok,
    train_conversations: list[dict],
    eval_conversations: list[dict],
    mtp_state: dict,
    *,
    budget_s: float = 60.0,
    max_steps: int | None = None,
    lr: float = 1e-4,
    new_tokens: int = 2 * NEW_TOKENS,
    max_prompts: int = MAX_TRAIN_PROMPTS,
    eval_prompts_max: int = MAX_PROMPTS,
    eval_every: int = 10,
    seed: int = 0,
) -> tuple[dict, dict]:
    """Train the MTP layer on base + adapter's own greedy continuations; returns (kept `mtp.*` state, report).

    Args:
        model: `peft.PeftModel` (base + adapter) on the device to train on; its weights are frozen here.
        tok: the base's tokenizer.
        train_conversations / eval_conversations: chat conversations; the estimate runs on the eval ones (when
            there are none, on an eighth of the training prompts held out from training).
        mtp_state: the base checkpoint's `mtp.*` tensors (the starting point and the "before" drafter).
        budget_s: seconds of the training loop (generation and estimates on top); max_steps: also stop after
            this many optimizer steps (a fixed amount of work, for tests).
        lr: AdamW learning rate; new_tokens: greedy tokens per training prompt (the estimate: `NEW_TOKENS`);
            max_prompts / eval_prompts_max: training / estimate prompts used at most; seed: sampling order.
    Returns (state: `mtp.*` name -> bf16 CPU tensor, report: {"before", "after" (`acceptance.score` figures on
    the eval prompts), "data_sha256", "eval_data_sha256", "steps", "seconds", "losses", "val_curve", "kept",
    "prompts", "eval_prompts", "new_tokens", "lr", "seed"}).
    Raises ValueError when no training prompt yields a continuation to learn from.
    """
    import torch

    t0 = time.time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    target = Target(model)
    pad, eos = tok.pad_token_id or 0, eos_ids(model, tok)
    train_prompts = prompts_of(tok, train_conversations, max_prompts)
    eval_prompts = prompts_of(tok, eval_conversations, eval_prompts_max)
    if not eval_prompts:  # no validation set: hold out an eighth of the training prompts
        k = max(1, len(train_prompts) // 8)
        eval_prompts, train_prompts = train_prompts[:k], train_prompts[k:]
    train = sequences(target, train_prompts, new_tokens, pad, eos)
    if not train:
        raise ValueError(
            f"{len(train_prompts)} training prompts gave no greedy continuation of {STEPS}+ tokens to distil on"
        )
    held = sequences(target, eval_prompts, NEW_TOKENS, pad, eos)
    # early stopping on an eighth of the training sequences (from position 0: every position is a sample)
    nv = max(1, len(train) // 8) if len(train) >= 4 else 0
    val, fit = (train[:nv], train[nv:]) if nv else (train, train)
    val = [(ids, h, lab, 0) for ids, h, lab, _ in val]

    mtp = MtpLayer(target.text_cfg, mtp_state, target.device)
    mtp.train(False)
    before = score(target, mtp, held)
    best = (score(target, mtp, val)["acceptance_length"] or 0.0, 0, mtp.state())
    curve = [(0, best[0])]
    opt = torch.optim.AdamW(mtp.parameters(), lr=lr, weight_decay=0.0)
    steps, losses = 0, []
    # bf16 under autocast on CUDA, and whenever the target is not fp32 (a bf16 target on CPU: the fp32 MTP layer's
    # linears would meet bf16 embeddings)
    amp = target.device.type == "cuda" or target.embed.weight.dtype != torch.float32
    t_train = time.time()
    while time.time() - t_train < budget_s and (max_steps is None or steps < max_steps):
        ids, h, lab, _ = fit[rng.randrange(len(fit))]
        mtp.train(True)
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = draft_loss(mtp, target.embed, target.lm_head, h, ids, lab, target.rotary, STEPS)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        steps += 1
        losses.append(round(float(loss.detach()), 4))
        if steps % eval_every == 0:
            mtp.train(False)
            v = score(target, mtp, val)["acceptance_length"] or 0.0
            curve.append((steps, v))
            if v > best[0]:
                best = (v, steps, mtp.state())
    if steps % eval_every:  # the last steps too
        mtp.train(False)
        v = score(target, mtp, val)["acceptance_length"] or 0.0
        curve.append((steps, v))
        if v > best[0]:
            best = (v, steps, mtp.state())
    train_s = time.time() - t_train
    mtp.load(best[2])
    mtp.train(False)
    after = score(target, mtp, held)
    report = {
        "before": before,
        "after": after,
        "data_sha256": digest(train_prompts),
        "eval_data_sha256": digest(eval_prompts),
        "prompts": len(train_prompts),
        "eval_prompts": len(eval_prompts),
        "new_tokens": new_tokens,
        "steps": steps,
        "kept": "base" if best[1] == 0 else f"step {best[1]}",
        "train_s": round(train_s, 1),
        "seconds": round(time.time() - t0, 1),
        "losses": losses[:: max(1, len(losses) // 20)],
        "val_curve": curve[:: max(1, len(curve) // 20)],
        "lr": lr,
        "seed": seed,
    }
    return best[2], report
