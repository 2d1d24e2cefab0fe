"""The MTP drafter as vLLM's `qwen3_5_mtp` runs it, as torch modules: for training and estimating it.

What the drafter computes (vLLM 0.25.1, read in the wheel; the same in the CPU build 0.32; line
references and the first-pass / later-step contexts are in docs/vllm.md "The MTP drafter's inputs"):
- `model_executor/models/qwen3_5_mtp.py:139-165` (`Qwen3_5MultiTokenPredictor.forward`):
      z = fc(cat([pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)]))   embedding first
      out_i = norm(decoder_layer(z, position i))   (full attention, residual None)
  and `lm_head(out_i)` drafts x_{i+2}. `embed_tokens` and `lm_head` are the target's
  (`v1/spec_decode/llm_base_proposer.py` `_maybe_share_embeddings` / `_maybe_share_lm_head`).
- h_i is the target's final hidden state after its final norm (transformers' `last_hidden_state`).
- step 1 reads x_{i+1} at position i; step k+1 runs at position i + k on the token drafted by step k
  and step k's output (post-norm) as the hidden state, attending to the first pass's entries at
  positions <= i and the entries the earlier steps of this draft wrote (`unrolled`).
- greedy verification accepts draft k when it and all earlier drafts of the step equal the target's
  argmax; vLLM reports mean acceptance length `1 + accepted / drafts` (`v1/spec_decode/metrics.py`).

Checkpoint names: `mtp.fc.weight`, `mtp.norm.weight`, `mtp.pre_fc_norm_{embedding,hidden}.weight`,
`mtp.layers.0.*` (one full-attention decoder layer), as in Qwen/Qwen3.6-27B's index.
"""

from __future__ import annotations

STEPS = 3  # draft steps trained and evaluated: num_speculative_tokens of the fleet
STEP_WEIGHTS = (1.0, 0.5, 0.25)
NORMS = ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")


class MtpLayer:
    """The MTP layer as trainable float32 torch modules, loaded from / saved to `mtp.*` tensors.

    Args:
        text_cfg: the target's `Qwen3_5TextConfig` (hidden size, eps, the full-attention layer's shape).
        tensors: `mtp.*` name -> tensor (any float dtype); `None` draws a fresh layer (transformers'
            initialisation; the norms start at zero offset, i.e. scale 1).
        device: torch device for the parameters.

    Raises KeyError / RuntimeError (torch's `load_state_dict(strict=True)`) when `tensors` lacks a
    tensor of the layer or has one of another shape.
    """

    def __init__(self, text_cfg, tensors: dict | None, device):
        import copy

        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = text_cfg.hidden_size, text_cfg.rms_norm_eps
        full = text_cfg.layer_types.index("full_attention")
        # causal attention without a mask (SDPA's is_causal): the eager path would attend to later
        # positions when no mask is passed, and the layer would learn from tokens vLLM never shows it
        cfg = copy.deepcopy(text_cfg)
        cfg._attn_implementation = "sdpa"
        self.layer = Qwen3_5DecoderLayer(cfg, full)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.norms = {n: Qwen3_5RMSNorm(h, eps) for n in NORMS}
        self.modules = {"layers.0": self.layer, "fc": self.fc, **self.norms}
        if tensors is not None:
            self.load(tensors)
        for mod in self.modules.values():
            mod.to(device=device, dtype=torch.float32)

    def parameters(self):
        return [p for m in self.modules.values() for p in m.parameters()]

    def train(self, mode: bool = True) -> None:
        for m in self.modules.values():
            m.train(mode)

    def state(self) -> dict:
        """`mtp.*` name -> bf16 CPU tensor, the checkpoint's names and dtype."""
        import torch

        return {
            f"mtp.{prefix}.{k}": v.detach().to("cpu", torch.bfloat16).contiguous()
            for prefix, mod in self.modules.items()
            for k, v in mod.state_dict().items()
        }

    def load(self, state: dict) -> None:
        """Set the parameters from `mtp.*` tensors (a `state()` dict or a checkpoint's)."""
        for prefix, mod in self.modules.items():
            own = {k[len(f"mtp.{prefix}.") :]: v for k, v in state.items() if k.startswith(f"mtp.{prefix}.")}
            mod.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)

    def fc_inputs(self, emb, hidden):
        """[B, L, H] embeddings of x_{i+1} and hidden states h_i -> [B, L, 2H], embedding first."""
        import torch

        return torch.cat(
            [self.norms["pre_fc_norm_embedding"](emb), self.norms["pre_fc_norm_hidden"](hidden)], dim=-1
        )

    def forward(self, z, pos_emb, mask):
        """fc outputs z [B, L, H] -> normalised outputs [B, L, H]; `mask` [L, L] bool, True: query row
        may attend key column (the decoder layer with residual None, then `norm`)."""
        return self.norms["norm"](self.layer(z, position_embeddings=pos_emb, attention_mask=mask[None, None]))


def pos_emb(rotary, x, positions):
    """Rotary embeddings for positions [L] (text: the three M-RoPE rows equal), for x [B, L, H]."""
    b = x.shape[0]
    return rotary(x, positions.to(x.device).view(1, 1, -1).expand(3, b, -1))


def unrolled(mtp: MtpLayer, embed, hidden, ids, rotary, steps: int = STEPS):
    """Outputs of draft steps 1..steps over whole sequences, as vLLM's proposer computes them.

    Args: `hidden` [B, T, H] the target's final (post-norm) hidden states, `ids` [B, T] token ids,
    `embed` / `rotary` the target's embedding and rotary modules.
    Returns a list of `steps` tensors [B, T - 1 - k, H] (k = step - 1): entry i is step k+1's output
    for the draft started at position i. Step k+1 reads the true x_{i+k+1} (what it reads whenever
    the earlier drafts were accepted, which is all acceptance counts) and attends to the first
    pass's entries at positions <= i plus the entries steps 2..k+1 wrote for this start: the
    streams of steps 1..k+1 are concatenated and that is the attention mask.
    """
    import torch

    t_all = ids.shape[1]
    lens = [t_all - 1 - k for k in range(steps)]
    zs, outs, prev = [], [], hidden[:, :-1]
    for k in range(steps):
        t = lens[k]
        zs.append(mtp.fc(mtp.fc_inputs(embed(ids[:, k + 1 : k + 1 + t]), prev[:, :t])))
        x = torch.cat(zs, 1)
        start = torch.cat([torch.arange(n) for n in lens[: k + 1]])
        stream = torch.cat([torch.full((n,), m) for m, n in enumerate(lens[: k + 1])])
        q_start, q_stream = start[:, None], stream[:, None]
        mask = ((stream == 0) & (start <= q_start)) | (
            (stream >= 1) & (stream <= q_stream) & (start == q_start)
        )
        out = mtp.forward(x, pos_emb(rotary, x, start + stream), mask.to(x.device))
        prev = out[:, -t:]
        outs.append(prev)
    return outs


def draft_loss(mtp: MtpLayer, embed, lm_head, hidden, ids, targets, rotary, steps: int = STEPS):
    """Weighted cross-entropy (nats, `STEP_WEIGHTS`) of draft steps 1..steps against `targets` [B, T]:
    step k+1 from start i predicts `targets[:, i + k + 1]` (the token after x_{i+k+1}; pass the target's
    argmax to distil, or ids shifted by one to train on text)."""
    import torch

    loss = 0.0
    for k, out in enumerate(unrolled(mtp, embed, hidden, ids, rotary, steps)):
        logits = lm_head(out).float()
        tgt = targets[:, k + 1 : k + 1 + out.shape[1]]
        loss = loss + STEP_WEIGHTS[k] * torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    return loss


def draft_scores(
    mtp: MtpLayer, embed, lm_head, hidden, ids, labels, rotary, first: int, steps: int = STEPS
) -> dict:
    """Greedy-verification figures of the drafter on sequences, over start positions i >= `first`.

    Args: `labels` [B, T] the target's argmax at every position (what greedy verification compares
    drafts with). Returns {"agreement": [per step: draft k == target argmax], "acceptance": [per step:
    drafts 1..k all equal it: vLLM's per-position acceptance rate], "acceptance_length": 1 + sum of
    acceptance, "positions": start positions counted} (fractions of positions).
    Raises ValueError when the sequences are too short to hold one start position after `first`.
    """
    import torch

    span = ids.shape[1] - steps - first  # start positions every step covers
    if span <= 0:
        raise ValueError(f"sequences of {ids.shape[1]} tokens hold no draft start after position {first}")
    with torch.no_grad(), torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        outs = unrolled(mtp, embed, hidden, ids, rotary, steps)
        hits = []
        for k, out in enumerate(outs):
            pred = torch.cat([lm_head(o).argmax(-1) for o in out[:, first : first + span].split(4)], 0)
            hits.append(pred == labels[:, first + k + 1 : first + k + 1 + span])
    agree = [float(h.float().mean()) for h in hits]
    chain = torch.ones_like(hits[0])
    acc = []
    for h in hits:
        chain = chain & h
        acc.append(float(chain.float().mean()))
    return {
        "agreement": agree,
        "acceptance": acc,
        "acceptance_length": 1 + sum(acc),
        "positions": int(hits[0].numel()),
    }
