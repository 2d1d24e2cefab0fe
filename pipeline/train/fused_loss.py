"""Causal-LM loss without materialised logits for `Qwen3_5ForConditionalGeneration` (the VL class
the shipped Qwen3.6-27B config loads).

axolotl 0.19's Liger integration replaces `Qwen3_5ForCausalLM.forward` only (its
`integrations/liger/models/qwen3_5.py`), so with the VL class the full [batch, seq, 248,320]
logits are built in bf16, upcast to fp32 and kept for the backward: ~10 bytes per logit element,
~41 GB at seq 16384 (benchmarks/RESULTS.md: 8-layer peak 61.9 GB unfused vs 21.2 GB fused).
`patch_vl_fused_cross_entropy` (called by `pipeline.train.axolotl_plugin.PipelinePlugin` when the
config sets `liger_fused_linear_cross_entropy: true`) gives the VL class the same treatment:
whenever labels are passed, the loss comes from the last hidden states and `lm_head.weight` in
chunks, and `logits` is None. Without labels (generation) the original forward runs.

Kernel: Liger's fused linear cross-entropy (`liger_kernel.transformers.model.loss_utils.
LigerForCausalLMLoss`, Triton) on CUDA; elsewhere `chunked_causal_lm_loss`, the same
computation in plain PyTorch (token chunks, each recomputed in the backward), which is what the
CPU tests exercise. Both shift labels by one and ignore -100 exactly like transformers'
`ForCausalLMLoss`; with `num_items_in_batch` the sum is divided by it, else the mean over labelled
tokens is taken.
"""

from __future__ import annotations

import functools

IGNORE_INDEX = -100
# Bytes of GPU memory per logit element when a causal LM materialises its logits in training
# (bf16 logits + fp32 upcast + fp32 log-softmax kept for the backward): measured 40.7 GB for
# 16384 x 248,320 elements on an H200 (benchmarks/RESULTS.md, 8 layers, 61.9 -> 21.2 GB).
LOGIT_BYTES_PER_ELEMENT = 10
DEFAULT_CHUNK_TOKENS = 2048


def _ce_sum(hidden, weight, labels, ignore_index: int):
    import torch.nn.functional as F

    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(
    hidden_states,
    lm_head_weight,
    labels,
    num_items_in_batch=None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
):
    """Next-token cross-entropy of `hidden_states @ lm_head_weight.T` without keeping the logits.

    Args:
        hidden_states: [batch, seq, hidden] final hidden states (any float dtype).
        lm_head_weight: [vocab, hidden].
        labels: [batch, seq] token ids, `ignore_index` for positions without a loss; shifted by
            one inside (position t predicts label t+1), as transformers' ForCausalLMLoss does.
        num_items_in_batch: divide the summed loss by this (gradient accumulation across
            micro-batches) instead of taking the mean over labelled tokens.
        chunk_tokens: tokens per chunk; peak extra memory ~ chunk_tokens x vocab x 4 bytes.

    Returns a scalar fp32 tensor (NaN when no token is labelled and num_items_in_batch is None,
    like torch's mean cross-entropy).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    y = shift.reshape(-1).to(h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk_tokens):
        yc = y[s : s + chunk_tokens]
        if bool((yc != ignore_index).any()):
            total = total + checkpoint(
                _ce_sum, h[s : s + chunk_tokens], lm_head_weight, yc, ignore_index, use_reentrant=False
            )
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (y != ignore_index).sum()


def fused_causal_lm_loss(hidden_states, lm_head_weight, labels, num_items_in_batch=None):
    """Liger's fused linear cross-entropy on CUDA, `chunked_causal_lm_loss` elsewhere (same maths)."""
    if hidden_states.is_cuda:
        try:
            from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
        except ImportError:
            pass
        else:
            return LigerForCausalLMLoss(
                hidden_states=hidden_states,
                lm_head_weight=lm_head_weight,
                labels=labels,
                hidden_size=hidden_states.shape[-1],
                num_items_in_batch=num_items_in_batch,
            )
    return chunked_causal_lm_loss(hidden_states, lm_head_weight, labels, num_items_in_batch)


def _fused_forward(original):
    @functools.wraps(original)
    def forward(self, *args, labels=None, **kwargs):
        # Positional calls and calls without labels (generation, inference) keep the original path.
        if labels is None or args or kwargs.get("shift_labels") is not None:
            return original(self, *args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        outputs = self.model(**kwargs)
        loss = fused_causal_lm_loss(outputs[0], self.lm_head.weight, labels, num_items)
        return _output_class()(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            rope_deltas=getattr(outputs, "rope_deltas", None),
        )

    forward.__pipeline_fused__ = True
    return forward


def _output_class():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5.Qwen3_5CausalLMOutputWithPast


def patch_vl_fused_cross_entropy() -> bool:
    """Make `Qwen3_5ForConditionalGeneration.forward` compute its loss without logits.

    Idempotent; returns True when it patched, False when already patched.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5

    cls = modeling_qwen3_5.Qwen3_5ForConditionalGeneration
    if getattr(cls.forward, "__pipeline_fused__", False):
        return False
    cls.forward = _fused_forward(cls.forward)
    return True


def is_patched() -> bool:
    """Whether `Qwen3_5ForConditionalGeneration.forward` is the fused one."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return bool(
        getattr(modeling_qwen3_5.Qwen3_5ForConditionalGeneration.forward, "__pipeline_fused__", False)
    )
