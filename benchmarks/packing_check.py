"""Is axolotl's sample-packing path exact for Qwen3.5 (Gated DeltaNet + gated attention)? GPU check.

The model is loaded by axolotl itself (`axolotl.loaders.ModelLoader` on the shipped config with
`sample_packing: true`, so every patch axolotl applies for packing is in place: the fla varlen
Gated-DeltaNet forward with `cu_seqlens`, the SDPA varlen/block-diagonal attention path), and the
packed rows are built by axolotl's own multipack collator (`V2BatchSamplerDataCollatorForSeq2Seq`).
For each sample, the mean next-token loss over its labelled tokens is computed (a) alone in a row
of its own and (b) inside a packed row of several samples; the check passes when the largest
relative difference is below --tol (1e-3). A control packs the same rows with position ids that
do not restart per sample (what a leaking path sees): its differences show that the check would
notice a leak.

    python benchmarks/packing_check.py --base DIR --out result.json [--samples 24] [--row 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _logit_rel_diffs(logits, ref_logits: list, bounds) -> list[float]:
    """Per sample: ||packed - alone|| / ||alone|| over the sample's logits (fp32)."""
    out = []
    for (s, e), ref in zip(bounds, ref_logits, strict=True):
        d = logits[0, s:e].float() - ref
        out.append((d.norm() / ref.norm()).item())
    return out


def _per_sample_losses(logits, labels, bounds) -> list[float]:
    import torch.nn.functional as F

    out = []
    for s, e in bounds:
        lg = logits[0, s : e - 1].float()
        lb = labels[0, s + 1 : e]
        out.append(F.cross_entropy(lg, lb, ignore_index=-100).item())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--row", type=int, default=4096)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="config override key=YAML (CPU smoke tests)")
    a = ap.parse_args()

    os.environ.update(AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    import torch
    import yaml
    from axolotl.cli.config import load_cfg
    from axolotl.loaders import ModelLoader, load_tokenizer
    from axolotl.utils.collators import V2BatchSamplerDataCollatorForSeq2Seq

    t0 = time.time()
    cfg_data = yaml.safe_load((REPO / "axolotl_configs/qwen3.6-27b-lora.yml").read_text())
    cfg_data.update(
        base_model=str(a.base.resolve()),
        base_model_revision=None,
        sequence_len=a.row,
        sample_packing=True,
        eval_sample_packing=False,
        attn_implementation="sdpa",
        # per-sample losses need the logits: the fused loss is a training-memory setting, not maths
        liger_fused_linear_cross_entropy=False,
        output_dir=tempfile.mkdtemp(),
        dataset_prepared_path=tempfile.mkdtemp(),
        test_datasets=None,
    )
    for item in a.set:
        k, v = item.split("=", 1)
        cfg_data[k] = yaml.safe_load(v)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(cfg_data, f)
    cfg = load_cfg(f.name)
    tok = load_tokenizer(cfg)
    model, _ = ModelLoader(cfg, tok).load()
    model.eval()
    dev = next(model.parameters()).device

    rng = random.Random(a.seed)
    vocab = min(len(tok), 1024)
    samples = []
    for _ in range(a.samples):
        n = int(min(a.row // 2, max(48, math.exp(rng.gauss(math.log(600), 0.8)))))
        ids = [rng.randrange(16, vocab) for _ in range(n)]
        labels = [-100] * (n // 4) + ids[n // 4 :]
        samples.append(
            {"input_ids": ids, "attention_mask": [1] * n, "labels": labels, "position_ids": list(range(n))}
        )
    rows, cur = [], []
    for s in samples:  # greedy first-fit into rows of <= a.row tokens, like multipack's bins
        if cur and sum(len(x["input_ids"]) for x in cur) + len(s["input_ids"]) > a.row:
            rows.append(cur)
            cur = []
        cur.append(s)
    rows.append(cur)

    collate = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer=tok, padding=True, return_tensors="pt")
    alone, packed, control, alone_logits, dl_packed, dl_control = [], [], [], [], [], []
    with torch.no_grad():
        for s in samples:
            b = {k: torch.tensor([v], device=dev) for k, v in s.items()}
            out = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
            )
            alone += _per_sample_losses(out.logits, b["labels"], [(0, len(s["input_ids"]))])
            alone_logits.append(out.logits[0].float())
        for row in rows:
            b = {k: v.to(dev) for k, v in collate([row]).items()}
            bounds, s0 = [], 0
            for x in row:
                bounds.append((s0, s0 + len(x["input_ids"])))
                s0 += len(x["input_ids"])
            out = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
            )
            packed += _per_sample_losses(out.logits, b["labels"], bounds)
            refs = alone_logits[len(dl_packed) : len(dl_packed) + len(row)]
            dl_packed += _logit_rel_diffs(out.logits, refs, bounds)
            pos = torch.arange(b["input_ids"].shape[1], device=dev)[None]
            out = model(
                input_ids=b["input_ids"], attention_mask=torch.ones_like(b["input_ids"]), position_ids=pos
            )
            control += _per_sample_losses(out.logits, b["labels"], bounds)
            dl_control += _logit_rel_diffs(out.logits, refs, bounds)

    def rel(x, y):
        return [abs(p - q) / abs(q) for p, q in zip(x, y, strict=True)]

    res = {
        "samples": len(samples),
        "rows": len(rows),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "lengths": [len(s["input_ids"]) for s in samples],
        "max_rel_diff_packed": max(rel(packed, alone)),
        "max_rel_diff_control_no_position_reset": max(rel(control, alone)),
        "max_logit_rel_l2_packed": max(dl_packed),
        "max_logit_rel_l2_control": max(dl_control),
        "tol": a.tol,
        "loss_alone": alone,
        "loss_packed": packed,
        "seconds": round(time.time() - t0, 1),
    }
    res["ok"] = res["max_rel_diff_packed"] < a.tol
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()
