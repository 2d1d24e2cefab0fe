"""Exact sample packing for Qwen3.5-family models (Gated DeltaNet + gated full attention).

In a packed row (several conversations one after another, positions restarting at 0 for each)
nothing may flow from one sample into the next. What transformers 5.16/5.17 and axolotl 0.19 do
with such a row (read from `transformers/models/qwen3_5/modeling_qwen3_5.py` and
`axolotl/monkeypatch/models/qwen3_5/modeling.py`):

- `Qwen3_5DecoderLayer.forward` does not hand `position_ids` to `linear_attn`, and
  `Qwen3_5GatedDeltaNet.forward` runs the 4-tap causal convolution and the chunked delta rule over
  the whole row (`cu_seqlens` only from flash-attention kwargs the trainer never sends): the conv
  window and the recurrent state of sample i leak into sample i+1.
- axolotl's packing patch fixes that with flash-linear-attention's varlen kernels, but only when
  CUDA is available, only for a batch of one row (fla requires B == 1 with `cu_seqlens`; several
  packed rows per micro-batch raise), and it keeps `apply_mask_to_padding_states`, which multiplies
  hidden states by the 2D attention mask: axolotl's multipack collator writes segment ids there
  (1, 2, 3, ...), so wherever that mask reaches the model, sample k is scaled by k.
- Full attention isolates samples only when the 2D mask is absent and `position_ids` carry the
  boundaries (transformers' `find_packed_sequence_indices`, axolotl's `sdpa_varlen` patch);
  a segment-id mask is read as an all-ones padding mask: plain causal attention across samples.
- The VL class's multi-axis rotary positions (`[4, B, T]`: text, temporal, height, width) come
  from 2D `position_ids` by expansion, so they restart with them; positions given as the three
  MRoPE axes only (`[3, B, T]`, the layout of Qwen-VL processors) leave the decoder layers without
  text positions, hence without boundaries.

`apply()` patches those classes (the pipeline's axolotl plugin calls it when `sample_packing`,
`eval_sample_packing` or `pipeline_fla_gdn` is on): boundaries come from the text `position_ids` (a sample starts where
its position is 0) or from a segment-id mask; the Gated-DeltaNet layers get them as `cu_seqlens`
(fla's `causal_conv1d` and `chunk_gated_delta_rule` on CUDA, rows flattened to one, as
NVIDIA-NeMo/Automodel#2147, modelscope/mcore-bridge#176, THUDM/slime#1686 and
hiyouga/LlamaFactory#10436 do) or, without fla or on CPU, through the torch reference below (the
convolution window masked at boundaries, the chunked rule run per sample from a zero state). A
segment-id mask is turned into positions and dropped, as axolotl's trainer drops it for sdpa/eager,
and `[3, B, T]` positions get their text axis. A row without a boundary inside runs transformers'
own forward unchanged.
"""

from __future__ import annotations

import functools

# (transformers module, class prefix) of the families this module patches; qwen3_next's layer is a
# different one (fused in_proj_qkvz) and is not covered (pipeline.train.preflight refuses packing there).
FAMILIES = {
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5"),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe"),
    "qwen3_5_moe_text": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe"),
}
_ORIGINAL = "__pipeline_packing_original__"
# Route every row (not only packed ones) through the forward below when on CUDA with fla: fla's
# Triton causal conv instead of transformers' F.conv1d fallback, axolotl's fused LoRA in-projections.
# Set through `route_all_rows` by the plugin from `pipeline_fla_gdn` (pipeline.train.recompute.PipelineArgs).
FLA_FOR_ALL_ROWS = False


def route_all_rows(on: bool) -> None:
    """Set `FLA_FOR_ALL_ROWS` (the plugin; benchmarks/recompute_sweep.py per phase). A call, so that a
    renamed flag fails loudly where an assignment would set a module attribute nothing reads."""
    global FLA_FOR_ALL_ROWS
    FLA_FOR_ALL_ROWS = bool(on)


# -- boundaries ------------------------------------------------------------------------------------
def segment_starts(position_ids=None, attention_mask=None):
    """Bool [B, T]: True where a packed sample starts; None when neither input marks any boundary.

    `position_ids`: text positions [B, T] (a sample starts where its position is 0).
    `attention_mask`: [B, T]; a segment-id mask (values > 1: axolotl's multipack collator writes
    sample i of a row as i + 1, padding 0) marks a start wherever the id changes. A plain 0/1 mask
    marks none. The first token of every row is a start.
    """
    import torch

    starts = None
    if position_ids is not None:
        starts = position_ids == 0
    if attention_mask is not None and attention_mask.ndim == 2 and attention_mask.dtype != torch.bool:
        if int(attention_mask.max()) > 1:
            change = torch.ones_like(attention_mask, dtype=torch.bool)
            change[:, 1:] = attention_mask[:, 1:] != attention_mask[:, :-1]
            starts = change if starts is None else starts | change
    if starts is None:
        return None
    starts = starts.clone()
    starts[:, 0] = True
    return starts


def is_packed(starts) -> bool:
    """Whether some row holds more than one sample."""
    return starts is not None and bool(starts[:, 1:].any())


def cu_seqlens(starts):
    """int64 [N + 1]: cumulative sample lengths over the rows flattened into one ([B, T] -> [B*T])."""
    import torch

    flat = starts.reshape(-1)
    idx = flat.nonzero().view(-1)
    return torch.cat([idx, torch.tensor([flat.numel()], device=idx.device)]).to(torch.int64)


def positions_from_starts(starts):
    """Long [B, T]: per-sample positions 0, 1, ... restarting at every start."""
    import torch

    t = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - last_start


# -- torch reference of the varlen kernels ---------------------------------------------------------
def causal_conv1d_varlen(x, weight, bias, activation, starts):
    """Depthwise causal convolution that restarts at every sample (the torch reference of fla's
    `causal_conv1d(..., cu_seqlens)`).

    x [1, L, D], weight [D, W], bias [D] or None, starts bool [L]; returns [1, L, D]. A tap that
    would read a token of the previous sample reads zero, as at the start of an unpacked row
    (transformers' `causal_conv1d_fn`: F.conv1d with W - 1 zeros of left padding).
    """
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    W = weight.shape[-1]
    seg = starts.long().cumsum(0)  # sample index per token
    seg_pad = F.pad(seg, (W - 1, 0), value=-1)
    same = seg_pad.unfold(0, W, 1) == seg[:, None]  # [L, W]: tap j reads token t - (W - 1) + j
    win = F.pad(x, (0, 0, W - 1, 0)).unfold(1, W, 1)  # [1, L, D, W]
    out = (win * same[None, :, None, :].to(x.dtype) * weight[None, None].to(x.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    return (ACT2FN[activation](out) if activation else out).to(x.dtype)


def chunk_rule_varlen(chunk_fn, query, key, value, g, beta, cu):
    """The chunked gated delta rule run per sample from a zero state (torch reference of fla's
    `chunk_gated_delta_rule(..., cu_seqlens)`); tensors [1, L, H, d] / [1, L, H], returns [1, L, H, dv]."""
    import torch

    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        o, _ = chunk_fn(
            query[:, s:e],
            key[:, s:e],
            value[:, s:e],
            g=g[:, s:e],
            beta=beta[:, s:e],
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(o)
    return torch.cat(outs, dim=1)


def _fla_kernels():
    """fla's varlen `causal_conv1d` and `chunk_gated_delta_rule`, or (None, None).

    fla 0.6.0 names the convolution `fla.modules.causal_conv1d` (aliases `convolution`, `conv`);
    0.4.1-0.5.x `fla.modules.convolution`.
    """
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None, None
    for mod in ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules.conv"):
        try:
            return __import__(mod, fromlist=["causal_conv1d"]).causal_conv1d, chunk_gated_delta_rule
        except Exception:
            continue
    return None, None


def kernels_for(device) -> str:
    """'fla' when fla's varlen kernels serve tensors on `device` (CUDA), else 'torch'."""
    conv, rule = _fla_kernels()
    return (
        "fla"
        if conv is not None and rule is not None and getattr(device, "type", device) == "cuda"
        else "torch"
    )


# -- the patched forwards --------------------------------------------------------------------------
def _in_proj(layer, x) -> dict:
    # axolotl's LoRA kernels (lora_qkv_kernel) fuse the four in-projections as `apply_in_proj_fused`
    fused = getattr(layer, "apply_in_proj_fused", None)
    if fused is not None:
        return fused(x)
    return {n: getattr(layer, n)(x) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def _out_proj(layer, x):
    fused = getattr(layer, "apply_out_proj", None)
    return fused(x) if fused is not None else layer.out_proj(x)


def _gdn_forward(module, original):
    """`Qwen3_5GatedDeltaNet.forward` that resets the conv window and the recurrent state at every
    packed-sample boundary; rows without a boundary inside, and decoding steps, run `original`.
    A packed forward leaves a cache it is given untouched (packed rows are never decoded from)."""

    @functools.wraps(original)
    def forward(self, hidden_states, cache_params=None, attention_mask=None, position_ids=None, **kwargs):
        import torch
        import torch.nn.functional as F

        if position_ids is None:
            position_ids = getattr(self, "_pipeline_position_ids", None)
        if position_ids is not None and position_ids.ndim == 3:  # [axes, B, T]: text axis first
            position_ids = position_ids[0]
        decoding = cache_params is not None and cache_params.has_previous_state(self.layer_idx)
        starts = None if decoding else segment_starts(position_ids, attention_mask)
        if not is_packed(starts) and not (FLA_FOR_ALL_ROWS and hidden_states.is_cuda and not decoding):
            return original(
                self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
            )
        B, T, _ = hidden_states.shape
        if starts is None:  # an unpacked batch (FLA_FOR_ALL_ROWS): one sample per row
            starts = torch.zeros(B, T, dtype=torch.bool, device=hidden_states.device)
            starts[:, 0] = True
        if attention_mask is not None and attention_mask.ndim == 2:  # padding as 0/1, never a scale
            hidden_states = hidden_states * (attention_mask != 0)[..., None].to(hidden_states.dtype)
        h = hidden_states.reshape(1, B * T, -1)  # rows are samples too: one flat row for the kernels
        flat_starts = starts.reshape(-1)
        cu = cu_seqlens(starts)
        proj = _in_proj(self, h)
        mixed = proj["in_proj_qkv"]
        fla_conv, fla_rule = _fla_kernels()
        use_fla = fla_conv is not None and fla_rule is not None and h.is_cuda
        weight = self.conv1d.weight.squeeze(1)
        if use_fla:
            mixed, _ = fla_conv(
                x=mixed.contiguous(),
                weight=weight,
                bias=self.conv1d.bias,
                activation=self.activation,
                cu_seqlens=cu,
            )
        else:
            mixed = causal_conv1d_varlen(mixed, weight, self.conv1d.bias, self.activation, flat_starts)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        L = B * T
        q = q.reshape(1, L, -1, self.head_k_dim)
        k = k.reshape(1, L, -1, self.head_k_dim)
        v = v.reshape(1, L, -1, self.head_v_dim)
        beta = proj["in_proj_b"].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(proj["in_proj_a"].float() + self.dt_bias)
        if self.num_v_heads // self.num_k_heads > 1:
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        if use_fla:
            core, _ = fla_rule(
                q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
            )  # fmt: skip
        else:
            core = chunk_rule_varlen(module.torch_chunk_gated_delta_rule, q, k, v, g, beta, cu)
        z = proj["in_proj_z"].reshape(-1, self.head_v_dim)
        core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(B, T, -1)
        return _out_proj(self, core)

    return forward


def _decoder_forward(original):
    """Hand the layer's text `position_ids` to its linear-attention module (transformers does not)."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        la = getattr(self, "linear_attn", None)
        if la is not None and "position_ids" in kwargs:
            la._pipeline_position_ids = kwargs["position_ids"]
        return original(self, *args, **kwargs)

    return forward


def _text_model_forward(original):
    """Packed inputs into the layout transformers isolates: boundaries in `position_ids`, no 2D mask."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        import torch

        mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if (
            isinstance(mask, torch.Tensor)
            and mask.ndim == 2
            and mask.dtype != torch.bool
            and int(mask.max()) > 1
        ):  # a segment-id mask: its boundaries become positions (or join the given ones), the mask goes
            if pos is None or pos.ndim == 2:
                kwargs["position_ids"] = pos = positions_from_starts(segment_starts(pos, mask))
            kwargs["attention_mask"] = None
        if isinstance(pos, torch.Tensor) and pos.ndim == 3 and pos.shape[0] == 3:
            # MRoPE axes only: a sample starts where all three are 0; its text positions restart there
            starts = (pos == 0).all(dim=0)
            starts[:, 0] = True
            if is_packed(starts):
                kwargs["position_ids"] = torch.cat([positions_from_starts(starts)[None], pos], dim=0)
        return original(self, *args, **kwargs)

    return forward


def _targets(model_type: str):
    import importlib

    mod_name, prefix = FAMILIES[model_type]
    module = importlib.import_module(mod_name)
    return module, [
        (getattr(module, f"{prefix}GatedDeltaNet"), lambda orig: _gdn_forward(module, orig)),
        (getattr(module, f"{prefix}DecoderLayer"), _decoder_forward),
        (getattr(module, f"{prefix}TextModel"), _text_model_forward),
    ]


def apply(model_type: str) -> bool:
    """Patch the family's Gated-DeltaNet, decoder-layer and text-model forwards (idempotent).

    Returns True when patched now, False when already patched. Raises KeyError for a model type
    not in FAMILIES. Call it after axolotl's own patches (the plugin's `pre_model_load` runs after
    them): this forward replaces axolotl's Gated-DeltaNet one and keeps its fused LoRA projections.
    """
    _, targets = _targets(model_type)
    done = False
    for cls, wrap in targets:
        if getattr(cls.forward, _ORIGINAL, None) is not None:
            continue
        original = cls.forward
        cls.forward = wrap(original)
        setattr(cls.forward, _ORIGINAL, original)
        done = True
    return done


def restore(model_type: str) -> None:
    """Undo `apply` (tests, and the packing check's leaking control)."""
    _, targets = _targets(model_type)
    for cls, _ in targets:
        original = getattr(cls.forward, _ORIGINAL, None)
        if original is not None:
            cls.forward = original


def is_applied(model_type: str) -> bool:
    _, targets = _targets(model_type)
    return all(getattr(cls.forward, _ORIGINAL, None) is not None for cls, _ in targets)
