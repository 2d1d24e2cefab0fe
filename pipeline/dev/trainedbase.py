"""A trained stand-in base of the fleet's architecture: fidelity, acceptance and speed figures that mean something.

A random-weight base has nearly flat logits: NVFP4 flips its greedy tokens (3.4% agreement on the
H200), an MTP layer has nothing to predict, and a leaked packing state barely moves its loss. This
builder trains a small model of the same family and code path as Qwen3.6-27B from scratch, in
minutes on one GPU, on a real corpus that every host carries (`pipeline.dev.corpus`):

- `Qwen3_5ForConditionalGeneration` (`pipeline.dev.realbase.real_config`): `[linear x3, full]`
  layers, gated attention, Gated-DeltaNet, one MTP layer stored as `mtp.*`, a small vision tower
  (served with `--language-model-only`, as the fleet's text checkpoint is);
- a byte-level BPE tokenizer trained on the corpus (`tokenizers`), with the project's chat template
  and special tokens (`pipeline.dev.tinybase`);
- loss = language-model cross-entropy + `mtp_weight` x the MTP layer's draft loss, the MTP layer fed
  exactly what vLLM's `qwen3_5_mtp` drafter feeds it (`pipeline.serving.mtp.unrolled`: embedding of
  x_{i+1}, the target's final post-norm hidden state, steps 2-3 on the earlier steps' outputs). The
  hidden state is detached for the MTP loss, so the drafter learns from the trunk without bending it;
- held-out perplexity and MTP top-1 agreement / acceptance per draft position, on held-out text and on
  the model's own greedy continuations of held-out prompts (what an engine drafting greedily sees);
- transformers writes the checkpoint (`save_pretrained`), the `mtp.*` tensors go in one more
  safetensors shard of the same index (transformers has no MTP module and would drop them).

The report (`trained_base.json` in the checkpoint) holds the corpus's size and sha256, the geometry,
the training's steps/tokens/seconds and the figures above.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

from pipeline.dev import corpus as corpus_mod
from pipeline.dev.output import write_whole
from pipeline.dev.realbase import PREPROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG, real_config
from pipeline.dev.tinybase import build_tokenizer
from pipeline.errors import UsageError
from pipeline.serving.mtp import MtpLayer, draft_loss, draft_scores

log = logging.getLogger(__name__)

REPORT = "trained_base.json"
MTP_SHARD = "model-mtp.safetensors"
# the vision tower is never trained nor served (`--language-model-only`); small so it costs nothing
VISION = dict(depth=1, hidden_size=256, intermediate_size=512, num_heads=4)


def geometry(hidden: int, vocab_size: int) -> dict:
    """Text-config fields of a stand-in of width `hidden`, in Qwen3.6-27B's proportions.

    Attention heads of 128 (64 below hidden 512), 4 query heads per KV head (real: 24/4), gated
    attention; Gated-DeltaNet heads of 128 (vLLM's CPU path needs 128) with 3 value heads per key head
    (real: 48/16); MLP 3x hidden (real: 3.4x). Raises ValueError for a width not a multiple of 64.
    """
    if hidden < 64 or hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64 and >= 64, got {hidden}")
    head_dim = 128 if hidden >= 512 else 64
    heads = max(2, hidden // head_dim)
    lin_k = max(1, hidden // 256)
    return dict(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim,
        linear_num_key_heads=lin_k,
        linear_num_value_heads=3 * lin_k,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=vocab_size,
        max_position_embeddings=32768,
    )


def _token_stream(tok, docs: list[str], eod: int):
    """All documents' ids, each followed by `eod`, as one int64 tensor [N]."""
    import torch

    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eod)
    return torch.tensor(ids, dtype=torch.long)


def _windows(stream, n: int, length: int, gen):
    """`n` random windows [n, length] of the stream (`gen`: a torch.Generator)."""
    import torch

    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def _lr(frac: float, peak: float) -> float:
    """Linear warm-up over the first 3% of the time budget, then cosine to 10% of `peak`."""
    if frac < 0.03:
        return peak * max(frac / 0.03, 0.02)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (frac - 0.03) / 0.97))))


class _Parts:
    """The modules the builder trains and measures with, from one `Qwen3_5ForConditionalGeneration`."""

    def __init__(self, model, mtp):
        text = model.model.language_model
        self.model, self.text, self.mtp = model, text, mtp
        self.embed, self.lm_head, self.rotary = model.get_input_embeddings(), model.lm_head, text.rotary_emb

    def hidden(self, ids):
        return self.text(input_ids=ids).last_hidden_state

    def lm_loss(self, hidden, targets):
        import torch

        logits = self.lm_head(hidden).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _heldout_ppl(parts: _Parts, stream, seq_len: int, max_windows: int, batch: int, amp) -> tuple[float, int]:
    """Perplexity (exp of mean nats per token) over non-overlapping held-out windows; (ppl, tokens)."""
    import torch

    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n < 1:
        raise UsageError(f"the held-out split has {len(stream)} tokens, fewer than one window of {seq_len}")
    x = stream[: n * seq_len + 1]
    ids, tgt = x[:-1].view(n, seq_len), x[1:].view(n, seq_len)
    total, count = 0.0, 0
    with torch.no_grad(), amp():
        for i in range(0, n, batch):
            a = ids[i : i + batch].to(parts.embed.weight.device)
            b = tgt[i : i + batch].to(a.device)
            total += float(parts.lm_loss(parts.hidden(a), b)) * b.numel()
            count += b.numel()
    return math.exp(total / count), count


def _mtp_figures(parts: _Parts, ids, first: int, amp) -> dict:
    """Draft agreement / acceptance of the MTP layer on sequences `ids` [B, T] against the target's argmax."""
    import torch

    with torch.no_grad(), amp():
        hidden = parts.hidden(ids)
        labels = torch.cat([parts.lm_head(h).argmax(-1) for h in hidden.split(4)], 0)
    out = draft_scores(
        parts.mtp, parts.embed, parts.lm_head, hidden.float(), ids, labels, parts.rotary, first
    )
    return {k: ([round(x, 4) for x in v] if isinstance(v, list) else (round(v, 4) if isinstance(v, float) else v))
            for k, v in out.items()}  # fmt: skip


def _greedy(parts: _Parts, prompts, new_tokens: int):
    """The model's greedy continuations [B, P + new_tokens] of `prompts` [B, P] (HF generate)."""
    import torch

    with torch.no_grad():
        return parts.model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def build_trained_base(
    out: Path,
    *,
    layers: int = 8,
    hidden: int = 1024,
    minutes: float = 4.0,
    max_steps: int | None = None,
    device: str = "cuda",
    corpus_roots: list[Path] | None = None,
    corpus_mb: float = 150.0,
    vocab_size: int = 8192,
    seq_len: int = 1024,
    batch: int = 32,
    lr: float = 1.5e-3,
    mtp_weight: float = 0.5,
    mtp_len: int = 256,
    eval_windows: int = 64,
    greedy_prompts: int = 16,
    prompt_len: int = 64,
    new_tokens: int = 128,
    seed: int = 0,
) -> dict:
    """Train a stand-in base from scratch on an offline corpus and write it to `out`; returns the report.

    Args:
        out: directory to write (replaced whole; `pipeline.dev.output.write_whole`).
        layers: decoder layers, a multiple of 4 ([linear x3, full] repeated); hidden: model width.
        minutes: wall-clock budget of the training loop after its first step (which compiles kernels: ~100 s
            on a fresh H200); the corpus, tokenizer and evaluation come on top.
        max_steps: stop after this many optimizer steps even within `minutes` (tests: a fixed amount of work).
        device: "cuda" (bf16 autocast) or "cpu" (float32: tests at tiny sizes).
        corpus_roots / corpus_mb: where the corpus is read (default: site-packages) and its cap, MB (1e6 bytes).
        vocab_size: BPE ids, special tokens included. seq_len / batch: tokens per window / windows per step.
        mtp_weight: weight of the MTP draft loss; mtp_len: positions of each window the MTP loss covers.
        eval_windows: held-out windows of `seq_len` for perplexity (MTP figures use the first 8);
        greedy_prompts / prompt_len / new_tokens: held-out prompts continued greedily for the
            acceptance estimate an engine would see.

    Raises UsageError for a `device="cuda"` without a GPU, `layers` not a multiple of 4, a width not a
    multiple of 64, a corpus folder that is missing or too small for one held-out window, or an `out` that
    may not be written (nothing written then).
    """
    import torch

    if layers < 4 or layers % 4:
        raise UsageError(
            f"--layers must be a multiple of 4 ([linear, linear, linear, full] repeated), got {layers}"
        )
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible to torch here; use --device cpu")
    try:
        geometry(hidden, vocab_size)
    except ValueError as e:
        raise UsageError(f"--hidden {hidden}: {e}") from None
    with write_whole(out) as partial:
        report = _build(
            partial, **{k: v for k, v in locals().items() if k not in ("out", "partial", "torch")}
        )
        (partial / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    log.info("trained base in %s", out)
    return report


def _build(out: Path, *, layers, hidden, minutes, max_steps, device, corpus_roots, corpus_mb, vocab_size, seq_len, batch, lr,
           mtp_weight, mtp_len, eval_windows, greedy_prompts, prompt_len, new_tokens, seed) -> dict:  # fmt: skip
    import contextlib

    import torch
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rep: dict = {"device": device, "seed": seed}

    corpus = corpus_mod.collect(corpus_roots, int(corpus_mb * 1e6))
    rep["corpus"] = corpus.describe()
    sample, size = [], 0  # the tokenizer learns from the first ~30 MB of training text
    for d in corpus.train:
        sample.append(d)
        size += len(d)
        if size > 30e6:
            break
    tok = build_tokenizer(out, corpus=sample, vocab_size=vocab_size)
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    train_ids = _token_stream(tok, corpus.train, eod)
    held_ids = _token_stream(tok, corpus.heldout, eod)
    rep["tokenizer"] = {"kind": "byte-level BPE (tokenizers)", "vocab": len(tok),
                        "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
                        "bytes_per_token": round(corpus.bytes / max(1, len(train_ids) + len(held_ids)), 3)}  # fmt: skip
    if len(train_ids) <= seq_len + 1:
        raise UsageError(
            f"the corpus gives {len(train_ids)} training tokens, fewer than one window of {seq_len}"
        )
    rep["prepare_s"] = round(time.time() - t0, 1)

    cfg = real_config(layers, geometry(hidden, len(tok)), {**VISION, "out_hidden_size": hidden})
    text_cfg = cfg.text_config
    text_cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    text_cfg.pad_token_id = eod
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    model.requires_grad_(False)
    model.model.language_model.requires_grad_(True)
    model.lm_head.requires_grad_(True)
    mtp = MtpLayer(text_cfg, None, device)
    parts = _Parts(model, mtp)
    params = [p for p in model.parameters() if p.requires_grad] + mtp.parameters()
    rep["model"] = {"architecture": "Qwen3_5ForConditionalGeneration", "layers": layers,
                    "layer_types": text_cfg.layer_types, "geometry": geometry(hidden, len(tok)),
                    "text_parameters": sum(p.numel() for p in model.model.language_model.parameters())
                    + model.lm_head.weight.numel(),
                    "mtp_parameters": sum(p.numel() for p in mtp.parameters())}  # fmt: skip

    cuda = str(device).startswith("cuda")

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    rep["heldout_ppl_initial"], _ = _heldout_ppl(parts, held_ids, seq_len, 4, batch, amp)
    opt = torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, **({"fused": True} if cuda else {})
    )
    budget = minutes * 60
    t_train, steps, tokens, curve, compile_s = time.time(), 0, 0, [], 0.0
    model.train()
    mtp.train()
    m = min(mtp_len, seq_len)
    while (elapsed := time.time() - t_train) < budget and (max_steps is None or steps < max_steps):
        frac = max(elapsed / budget, steps / max_steps if max_steps else 0.0)
        for g in opt.param_groups:
            g["lr"] = _lr(frac, lr)
        w = _windows(train_ids, batch, seq_len + 1, gen).to(device, non_blocking=True)
        x, y = w[:, :-1], w[:, 1:]
        with amp():
            h = parts.hidden(x)
            lm = parts.lm_loss(h, y)
            dl = draft_loss(
                mtp, parts.embed, parts.lm_head, h[:, :m].detach(), x[:, :m], y[:, :m], parts.rotary
            )
            loss = lm + mtp_weight * dl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        steps += 1
        tokens += x.numel()
        if steps == 1:  # the first step compiles kernels (fla's tilelang backward: ~100 s on a fresh H200):
            if cuda:  # the budget is for training, so it starts after it
                torch.cuda.synchronize()
            compile_s = time.time() - t_train
            t_train = time.time()
        if steps == 1 or steps % 50 == 0:
            curve.append({"step": steps, "s": round(time.time() - t_train, 1), "lm_loss": round(float(lm.detach()), 4),
                          "mtp_loss": round(float(dl.detach()), 4)})  # fmt: skip
    if cuda:
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    rep["training"] = {"steps": steps, "tokens": tokens, "seconds": round(train_s, 1), "first_step_s": round(compile_s, 1),
                       "tokens_per_s": round((tokens - batch * seq_len) / train_s) if steps > 1 else None, "epochs": round(tokens / len(train_ids), 3),
                       "seq_len": seq_len, "batch": batch, "lr": lr, "mtp_weight": mtp_weight, "mtp_len": m,
                       "curve": curve[-40:]}  # fmt: skip
    model.eval()
    mtp.train(False)

    rep["heldout_ppl"], rep["heldout_eval_tokens"] = _heldout_ppl(
        parts, held_ids, seq_len, eval_windows, batch, amp
    )
    n_mtp = min(8, max(1, (len(held_ids) - 1) // seq_len))
    span = min(seq_len, 512)
    text_ids = held_ids[: n_mtp * span].view(n_mtp, span).to(device)
    rep["mtp_heldout_text"] = _mtp_figures(parts, text_ids, 0, amp)
    n_p = min(greedy_prompts, max(1, len(held_ids) // (prompt_len * 4)))
    prompts = torch.stack(
        [held_ids[i * prompt_len * 4 : i * prompt_len * 4 + prompt_len] for i in range(n_p)]
    )
    with amp():
        seqs = _greedy(parts, prompts.to(device), new_tokens)
    rep["mtp_greedy"] = {**_mtp_figures(parts, seqs, prompt_len - 1, amp), "prompts": n_p,
                         "prompt_len": prompt_len, "new_tokens": new_tokens}  # fmt: skip
    rep["eval_s"] = round(time.time() - t_train - train_s, 1)  # t_train: after the first step

    # transformers writes the model; the MTP layer is one more shard of the same index
    from safetensors.torch import save_file

    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        eos_token_id=text_cfg.eos_token_id, pad_token_id=eod, do_sample=False
    )
    model.save_pretrained(out, max_shard_size="2GB")
    _add_mtp_shard(out, mtp.state(), save_file)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2))
    rep["seconds"] = round(time.time() - t0, 1)
    return rep


def _add_mtp_shard(out: Path, tensors: dict, save_file) -> None:
    """Write `tensors` (`mtp.*`) as one more shard and list it in `model.safetensors.index.json`
    (created for a single-file checkpoint, whose shard keeps its name)."""
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
        size = (out / "model.safetensors").stat().st_size
        index = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    save_file(tensors, str(out / MTP_SHARD), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, MTP_SHARD))
    index["metadata"]["total_size"] = int(index["metadata"].get("total_size", 0)) + sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
