"""Make the MTP layer of a random-weight base agree with its own target model (self-distillation).

`pipeline dev real-base` draws the MTP layer (`mtp.*`: fc, one full-attention decoder layer, three
norms) at random, so vLLM's `qwen3_5_mtp` drafter proposes noise and every draft is rejected: the
acceptance figures of the canary and the benchmark would then measure nothing. This script trains
the MTP layer briefly on the base's own behaviour and writes it back into the checkpoint's `mtp.*`
tensors (bf16, same names and shapes), before the NVFP4 checkpoint is built from it (the fleet's
checkpoint keeps `mtp.*` in bf16).

What the drafter computes (vLLM 0.25.1 `model_executor/models/qwen3_5_mtp.py`,
`v1/spec_decode/llm_base_proposer.py`): at position i it takes the target model's final hidden
state h_i (after the final norm) and the embedding of the next token x_{i+1}:
    z = fc(cat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))
    out_i = norm(decoder_layer(z, position i))          -> logits lm_head(out_i) draft x_{i+2}
Draft step k > 1 feeds out_{i} back as the hidden state with the drafted token, one position on.
Under greedy verification a draft is accepted when it equals the target's argmax.

Recipe (about a minute on one H200 for the 8-layer base):
1. prompts: the repository's chat conversations rendered with the base's template, cut to one
   length, plus random token prompts; the base's greedy continuations of them (HF generate);
2. one forward pass: h_i and the target's argmax at every position (the labels);
3. fc initialised by ridge regression of h_{i+1} on the fc inputs, with the decoder layer's
   `o_proj` and `down_proj` zeroed (the layer starts as the identity);
4. AdamW on all MTP parameters, cross-entropy to the target's argmax for draft steps 1-3
   (steps 2-3 unrolled in parallel over the sequence, an approximation of vLLM's step-by-step
   attention), until the time budget;
5. held-out top-1 agreement of the draft with the target per draft step: random, ridge, trained;
   the better of ridge and trained is written (`kept`).

What the figure means afterwards: acceptance of a drafter trained for a minute to imitate this
random model on sequences like the canary's, not the real Qwen3.6 MTP head's 3.64 mean acceptance
length. It makes base-vs-adapter comparisons meaningful (the adapter moves the target away from
what the drafter learnt), not absolute acceptance.

    python benchmarks/mtp_distill.py BASE_DIR [--budget-s 60] [--json OUT.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHATS = [REPO / "datasets" / "agent_chat_validation.jsonl", REPO / "datasets" / "agent_chat_train.jsonl"]
STEPS = 3  # draft steps trained and evaluated (num_speculative_tokens of the fleet)
STEP_WEIGHTS = (1.0, 0.5, 0.25)


def _prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `length` ids: rendered chat conversations (cut or repeated), then random ids."""
    rng = random.Random(seed)
    out = []
    for f in CHATS:
        for line in f.read_text().splitlines():
            if not line.strip() or len(out) >= n // 2:
                continue
            msgs = json.loads(line)["messages"]
            cut = next((j for j, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
            text = tok.apply_chat_template(
                msgs[: max(cut, 1)],
                tokenize=False,
                add_generation_prompt=True,
                tools=json.loads(line).get("tools"),
            )
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            while len(ids) < length:
                ids = ids + ids
            out.append(ids[-length:])
    vocab = min(len(tok), 1 << 17)
    while len(out) < n:
        out.append([rng.randrange(vocab) for _ in range(length)])
    rng.shuffle(out)
    return out


class _Mtp:
    """The MTP layer as trainable torch modules, loaded from / saved to the checkpoint's `mtp.*` names."""

    def __init__(self, text_cfg, tensors: dict, device):
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = text_cfg.hidden_size, text_cfg.rms_norm_eps
        full = text_cfg.layer_types.index("full_attention")
        self.layer = Qwen3_5DecoderLayer(text_cfg, full)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.norms = {
            n: Qwen3_5RMSNorm(h, eps) for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
        }
        self.modules = {"layers.0": self.layer, "fc": self.fc, **self.norms}
        for prefix, mod in self.modules.items():
            own = {
                k[len(f"mtp.{prefix}.") :]: v for k, v in tensors.items() if k.startswith(f"mtp.{prefix}.")
            }
            mod.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)
            mod.to(device=device, dtype=torch.float32)

    def parameters(self):
        return [p for m in self.modules.values() for p in m.parameters()]

    def state(self) -> dict:
        import torch

        return {
            f"mtp.{prefix}.{k}": v.detach().to("cpu", torch.bfloat16).contiguous()
            for prefix, mod in self.modules.items()
            for k, v in mod.state_dict().items()
        }

    def fc_inputs(self, emb, hidden):
        import torch

        return torch.cat(
            [self.norms["pre_fc_norm_embedding"](emb), self.norms["pre_fc_norm_hidden"](hidden)], dim=-1
        )

    def forward(self, emb, hidden, pos_emb):
        """[B, T, H] embeddings of x_{i+1} and hidden states h_i -> normalised outputs out_i [B, T, H]."""
        z = self.fc(self.fc_inputs(emb, hidden))
        return self.norms["norm"](self.layer(z, position_embeddings=pos_emb))


def _pos_emb(rotary, x, offset: int = 0):
    import torch

    b, t = x.shape[:2]
    pos = torch.arange(offset, offset + t, device=x.device).view(1, 1, -1).expand(3, b, -1)
    return rotary(x, pos)


def _unrolled(mtp, embed, hidden, ids, rotary, steps: int):
    """Outputs of draft steps 1..steps over whole sequences: list of [B, T - 1 - k, H] (k = step - 1).

    Step k at position i reads the token x_{i+k+1} and the previous step's output at i (the target's
    hidden state for step 1) and drafts x_{i+k+2}.
    """
    outs, prev = [], hidden[:, :-1]
    for k in range(steps):
        t = ids.shape[1] - 1 - k
        emb = embed(ids[:, k + 1 : k + 1 + t])
        prev = mtp.forward(emb, prev[:, :t], _pos_emb(rotary, emb, k))
        outs.append(prev)
    return outs


def _agreement(mtp, embed, lm_head, hidden, ids, labels, rotary) -> list[float]:
    """Top-1 agreement of each draft step with the target's argmax, over the given sequences."""
    import torch

    with torch.no_grad(), torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        res = []
        for k, out in enumerate(_unrolled(mtp, embed, hidden, ids, rotary, STEPS)):
            pred = torch.cat([lm_head(o).argmax(-1) for o in out.split(4)], 0)
            res.append(float((pred == labels[:, k + 1 : k + 1 + out.shape[1]]).float().mean()))
    return res


def distill(
    base: Path,
    budget_s: float = 60.0,
    device: str = "cuda",
    n_prompts: int = 96,
    prompt_len: int = 48,
    new_tokens: int = 160,
    seed: int = 0,
    write: bool = True,
) -> dict:
    """Train the MTP layer of the checkpoint `base` in place; returns the report (see module docstring).

    Raises FileNotFoundError / KeyError for a checkpoint without `mtp.*` tensors.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    torch.manual_seed(seed)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted({f for k, f in index.items() if k.startswith("mtp.")})
    if not shards:
        raise KeyError(f"{base}: no mtp.* tensors in model.safetensors.index.json")
    tensors = {}
    for f in shards:
        with safe_open(str(base / f), "pt") as sf:
            tensors.update({k: sf.get_tensor(k) for k in sf.keys() if k.startswith("mtp.")})
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16, device_map=device).eval()
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    embed, lm_head, rotary = (
        model.get_input_embeddings(),
        model.get_output_embeddings(),
        model.model.rotary_emb,
    )
    for p in model.parameters():
        p.requires_grad_(False)
    rep: dict = {"base": str(base), "device": device, "load_s": round(time.time() - t0, 1)}

    # 1-2: greedy continuations, then one forward for hidden states and the target's argmax
    prompts = torch.tensor(_prompts(tok, n_prompts, prompt_len, seed), device=device)
    seqs, hid, lab = [], [], []
    bs = 32
    with torch.no_grad():
        for n, chunk in enumerate(prompts.split(bs)):
            if n and time.time() - t0 > budget_s / 2:  # generation is slow here: train on what there is
                rep["generation_cut"] = f"{n} of {len(prompts.split(bs))} batches (time budget)"
                break
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id or 0,
            )
            o = model.model(input_ids=out)
            h = o.last_hidden_state
            seqs.append(out)
            hid.append(h)
            lab.append(torch.cat([lm_head(x).argmax(-1) for x in h.split(4)], 0))
    ids, hidden, labels = torch.cat(seqs), torch.cat(hid), torch.cat(lab)
    rep["generate_s"] = round(time.time() - t0 - rep["load_s"], 1)
    cont = ids[:, prompt_len:]
    rep["continuations"] = {  # distinct tokens / tokens per continuation: ~0 means the model loops
        "sequences": int(ids.shape[0]),
        "tokens": int(ids.numel()),
        "distinct_ratio": round(sum(len(set(c.tolist())) / len(c) for c in cont) / len(cont), 3),
    }
    n_eval = max(2, ids.shape[0] // 8)
    ev = (ids[:n_eval], hidden[:n_eval], labels[:n_eval])
    tr = (ids[n_eval:], hidden[n_eval:], labels[n_eval:])

    mtp = _Mtp(text_cfg, tensors, device)
    rep["agreement_random"] = _agreement(mtp, embed, lm_head, ev[1], ev[0], ev[2], rotary)

    # 3: identity layer + ridge-regressed fc
    with torch.no_grad():
        mtp.layer.self_attn.o_proj.weight.zero_()
        mtp.layer.mlp.down_proj.weight.zero_()
        x = mtp.fc_inputs(embed(tr[0][:, 1:]).float(), tr[1][:, :-1].float()).flatten(0, 1)
        y = tr[1][:, 1:].float().flatten(0, 1)
        if x.shape[0] > 65536:
            sel = torch.randperm(x.shape[0], device=device)[:65536]
            x, y = x[sel], y[sel]
        gram = x.T @ x
        gram.diagonal().add_(1e-3 * gram.diagonal().mean())
        mtp.fc.weight.copy_(torch.linalg.solve(gram, x.T @ y).T)
        del x, y, gram
    rep["agreement_ridge"] = _agreement(mtp, embed, lm_head, ev[1], ev[0], ev[2], rotary)
    ridge_state = {k: v.clone() for k, v in mtp.state().items()}

    # 4: cross-entropy to the target's argmax, draft steps 1-3
    opt = torch.optim.AdamW(mtp.parameters(), lr=1e-4, weight_decay=0.0)
    steps, losses, mb = 0, [], 4
    t_train = time.time()
    while time.time() - t0 < budget_s:
        order = torch.randperm(tr[0].shape[0], device=device)
        for j in range(0, len(order) - mb + 1, mb):
            sel = order[j : j + mb]
            i_, h_, l_ = tr[0][sel], tr[1][sel], tr[2][sel]
            with torch.autocast(device if device != "cpu" else "cpu", dtype=torch.bfloat16):
                loss = 0.0
                for k, out in enumerate(_unrolled(mtp, embed, h_, i_, rotary, STEPS)):
                    logits = lm_head(out).float()
                    tgt = l_[:, k + 1 : k + 1 + out.shape[1]]
                    loss = loss + STEP_WEIGHTS[k] * torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), tgt.flatten()
                    )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            opt.step()
            steps += 1
            losses.append(round(float(loss), 4))
            if time.time() - t0 >= budget_s:
                break
    rep.update(
        train_steps=steps,
        train_s=round(time.time() - t_train, 1),
        losses=losses[:: max(1, len(losses) // 20)],
    )
    rep["agreement_trained"] = _agreement(mtp, embed, lm_head, ev[1], ev[0], ev[2], rotary)
    # keep whichever drafts better on the held-out sequences (a minute of Adam can undo the ridge fit)
    rep["kept"] = "trained" if sum(rep["agreement_trained"]) >= sum(rep["agreement_ridge"]) else "ridge"

    # 5: write back, shard by shard (same names, shapes and dtype; the index is unchanged)
    if write:
        new = mtp.state() if rep["kept"] == "trained" else ridge_state
        missing = set(tensors) - set(new)
        if missing:
            raise KeyError(f"MTP tensors not produced by the trained layer: {sorted(missing)[:5]}")
        for f in shards:
            path = base / f
            with safe_open(str(path), "pt") as sf:
                meta = sf.metadata()
                part = {k: (new[k] if k in new else sf.get_tensor(k)) for k in sf.keys()}
            tmp = path.with_suffix(".tmp")
            save_file(part, str(tmp), metadata=meta)
            os.replace(tmp, path)
        rep["written"] = shards
    rep["seconds"] = round(time.time() - t0, 1)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument(
        "--budget-s", type=float, default=60.0, help="stop training after this many seconds in all"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rep = distill(a.base, a.budget_s, a.device, a.prompts, a.prompt_len, a.new_tokens)
    text = json.dumps(rep, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
