"""Is sample packing exact for Qwen3.5 (Gated DeltaNet + gated attention) through `pipeline train`? GPU check.

The model is loaded by axolotl itself (`axolotl.loaders.ModelLoader` on the shipped config with
`sample_packing: true`, `attn_implementation: sdpa` and the pipeline's plugin, so every patch a
packed `pipeline train` run gets is in place: axolotl's (fla varlen Gated-DeltaNet forward, SDPA
varlen attention) and then the pipeline's (pipeline.train.packing: conv window and recurrent
state reset at every boundary through fla's `causal_conv1d` / `chunk_gated_delta_rule` with
`cu_seqlens`, rows flattened, segment-id masks turned into positions). Packed rows come from
axolotl's multipack collator (`V2BatchSamplerDataCollatorForSeq2Seq`) and reach the model the way
axolotl's trainer sends them for sdpa: `input_ids` + restarting `position_ids`, the 2D mask dropped
(`sample_packing_drop_attention_mask`).

For each sample, the mean next-token loss over its labelled tokens and its logits are computed
(a) alone in a row of its own and (b) inside a packed row. Paths compared on the same rows:
- `pipeline`: the pipeline's patch (what `pipeline train` runs); also fed the collator's
  segment-id mask (`pipeline_with_mask`), which must not matter;
- `axolotl`: axolotl 0.19's own packing patch (the pipeline's undone);
- `unpatched`: transformers' forwards (both undone): the leak the check must be able to see.
Optionally (`--grads`, default on) the LoRA gradients of the summed per-sample losses, packed vs
alone (fla's varlen backward on the GPU). The check passes when the `pipeline` path's largest
per-sample relative loss difference is below --tol (1e-3) and the unpatched control differs at
least 10x more than the pipeline path, on logits and on the loss of later samples in a row (the check
would notice a leak). On a random base the logits are nearly flat and a leak hardly moves the loss
(2026-12-01: unpatched 2.3e-4 vs pipeline 5.8e-4): run it on `pipeline dev trained-base`, whose
samples are then held-out corpus text (`--text`, default for a base with trained_base.json).

    python benchmarks/packing_check.py --base DIR --out result.json [--samples 24] [--row 4096]
    python benchmarks/packing_check.py --smoke   # CPU, seconds: tiny base, 4 samples in rows of 256, no grads
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGIN = "pipeline.train.axolotl_plugin.PipelinePlugin"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from axolotl_h200 import CPU  # noqa: E402  (the CPU smoke overrides: no Triton kernels)

SMOKE_SETS = [*CPU, f"plugins=[{PLUGIN}]"]


def _logit_rel_diffs(logits, ref_logits: list, bounds) -> list[float]:
    """Per sample: ||packed - alone|| / ||alone|| over the sample's logits (fp32)."""
    out = []
    for (s, e), ref in zip(bounds, ref_logits, strict=True):
        d = logits[0, s:e].float() - ref
        out.append((d.norm() / ref.norm()).item())
    return out


def _per_sample_losses(logits, labels, bounds, reduce="mean"):
    import torch.nn.functional as F

    out = []
    for s, e in bounds:
        lg = logits[0, s : e - 1].float()
        lb = labels[0, s + 1 : e]
        out.append(F.cross_entropy(lg, lb, ignore_index=-100, reduction=reduce))
    return out


def _forwards(model_type: str) -> dict:
    """The class forwards pipeline.train.packing patches, as they are now."""
    from pipeline.train import packing

    _, targets = packing._targets(model_type)
    return {cls: cls.forward for cls, _ in targets}


def _set(forwards: dict) -> None:
    for cls, fwd in forwards.items():
        cls.forward = fwd


def _lora_grads(model):
    import torch

    return torch.cat(
        [
            p.grad.float().reshape(-1)
            for n, p in model.named_parameters()
            if "lora_" in n and p.grad is not None
        ]
    )


def _worst(xs: list[float]) -> float:
    """The largest difference, inf when any is NaN or inf (max() keeps a NaN only in first place:
    max([1e-5, nan]) is 1e-5, so a packed path giving NaN for a later sample passed)."""
    return math.inf if any(not math.isfinite(x) for x in xs) else max(xs)


def _ratio(control: float, path: float) -> float:
    """control / path; inf for a path of 0 (a control of 0 too gives 0: nothing to detect)."""
    if not math.isfinite(control):
        return 0.0
    return control / path if path > 0 else (math.inf if control > 0 else 0.0)


def _text_ids(tok, a) -> list[int]:
    """Token ids of held-out corpus text (`pipeline.dev.corpus`, the trained base's held-out split)."""
    from pipeline.dev.corpus import collect

    corpus = collect(max_bytes=int(a.text_mb * 1e6))
    ids: list[int] = []
    for doc in corpus.heldout:
        ids += tok(doc, add_special_tokens=False)["input_ids"]
        if len(ids) > 8 * a.row * a.samples:
            break
    if len(ids) < 2 * a.row:
        raise SystemExit(f"the held-out corpus gave {len(ids)} tokens; raise --text-mb")
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="required unless --smoke (which builds the tiny base)")
    ap.add_argument("--out", type=Path, help="required unless --smoke")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--row", type=int, default=4096)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grads", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--set", action="append", default=[], help="config override key=YAML (CPU smoke tests)")
    ap.add_argument(
        "--text",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="samples of held-out corpus text (default: when the base is a trained one, trained_base.json)",
    )
    ap.add_argument("--text-mb", type=float, default=60.0, help="corpus read for --text, MB")
    ap.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="weights and compute: fp32 (default) puts the kernels' own rounding far below --tol, so a "
        "difference is the packing's; bf16 alone differs by ~1e-3 between a packed and an unpacked forward "
        "(2026-12-03, the trained base: pipeline and axolotl paths 1.7e-3, identical to 1e-9)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the check on CPU in seconds (the suite runs it); exit 1 unless ok",
    )
    a = ap.parse_args()
    if a.smoke:  # the CPU settings of benchmarks/axolotl_h200.py's CPU plans, with the pipeline's plugin
        tmp = Path(tempfile.mkdtemp(prefix="packing-smoke-"))
        if a.base is None:
            from pipeline.dev.tinybase import build_tiny_base

            a.base = build_tiny_base(tmp / "base")
        a.out = a.out or tmp / "result.json"
        a.samples, a.row, a.grads = 4, 256, False
        a.set = [*SMOKE_SETS, *a.set]
    elif a.base is None or a.out is None:
        ap.error("--base and --out are required (or --smoke)")

    if a.text is None:
        a.text = (a.base / "trained_base.json").is_file()
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
        lora_dropout=0.0,
    )
    if a.dtype == "fp32":  # float32 weights, no TF32 matmuls
        cfg_data.update(bf16=False, fp16=False, tf32=False)
    cfg_data["plugins"] = list(dict.fromkeys([*(cfg_data.get("plugins") or []), PLUGIN]))
    for item in a.set:
        k, v = item.split("=", 1)
        cfg_data[k] = yaml.safe_load(v)
    cfg_data.pop("base_model_revision", None)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(cfg_data, f)
    cfg = load_cfg(f.name)
    model_type = cfg.model_config_type
    import importlib

    from pipeline.train import packing

    importlib.import_module(packing.FAMILIES[model_type][0])
    unpatched = _forwards(model_type)  # transformers' own, before axolotl's and the pipeline's patches
    tok = load_tokenizer(cfg)
    model, _ = ModelLoader(cfg, tok).load()
    model.eval()
    assert packing.is_applied(model_type), "the pipeline plugin did not patch the model"
    pipeline_fwd = _forwards(model_type)
    packing.restore(model_type)
    axolotl_fwd = _forwards(model_type)
    _set(pipeline_fwd)
    dev = next(model.parameters()).device

    def progress(what: str) -> None:  # to stderr, flushed: a run cut by its timeout still says how far it got
        print(f"[packing_check {time.time() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    progress(f"model loaded on {dev} ({a.dtype})")
    rng = random.Random(a.seed)
    vocab = min(len(tok), 1024)
    text_ids = _text_ids(tok, a) if a.text else None
    samples = []
    for _ in range(a.samples):
        n = int(min(a.row // 2, max(48, math.exp(rng.gauss(math.log(600), 0.8)))))
        if text_ids is not None:  # real text: a trained base predicts it, so a leaked state moves the loss
            start = rng.randrange(0, len(text_ids) - n)
            ids = text_ids[start : start + n]
        else:
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
    paths = {
        "pipeline": pipeline_fwd,
        "pipeline_with_mask": pipeline_fwd,
        "axolotl": axolotl_fwd,
        "unpatched": unpatched,
    }
    alone, alone_logits = [], []
    packed = {p: [] for p in paths}
    logit_l2 = {p: [] for p in paths}
    first_in_row = []
    with torch.no_grad():
        for s in samples:
            b = {k: torch.tensor([v], device=dev) for k, v in s.items()}
            out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
            alone += [
                x.item() for x in _per_sample_losses(out.logits, b["labels"], [(0, len(s["input_ids"]))])
            ]
            alone_logits.append(out.logits[0].float())
        progress(f"{len(samples)} samples alone")
        done = 0
        for ri, row in enumerate(rows, 1):
            b = {k: v.to(dev) for k, v in collate([row]).items()}
            bounds, s0 = [], 0
            for x in row:
                bounds.append((s0, s0 + len(x["input_ids"])))
                s0 += len(x["input_ids"])
            first_in_row += [True] + [False] * (len(row) - 1)
            refs = alone_logits[done : done + len(row)]
            for p, fwd in paths.items():
                _set(fwd)
                kw = {"attention_mask": b["attention_mask"]} if p == "pipeline_with_mask" else {}
                out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False, **kw)
                packed[p] += [x.item() for x in _per_sample_losses(out.logits, b["labels"], bounds)]
                logit_l2[p] += _logit_rel_diffs(out.logits, refs, bounds)
                progress(f"row {ri}/{len(rows)}: {p}")
            done += len(row)
    _set(pipeline_fwd)

    def rel(x, y):
        return [abs(p - q) / abs(q) for p, q in zip(x, y, strict=True)]

    res = {
        "model_type": model_type,
        "device": str(dev),
        "kernels": packing.kernels_for(dev),
        "samples": len(samples),
        "rows": len(rows),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "lengths": [len(s["input_ids"]) for s in samples],
        "tol": a.tol,
        "dtype": a.dtype,
        "loss_alone": alone,
    }
    for p in paths:
        later = [d for d, first in zip(rel(packed[p], alone), first_in_row, strict=True) if not first]
        res[f"max_rel_diff_{p}"] = _worst(rel(packed[p], alone))
        res[f"max_rel_diff_{p}_later_samples"] = _worst(later) if later else None
        res[f"max_logit_rel_l2_{p}"] = _worst(logit_l2[p])
        res[f"loss_packed_{p}"] = packed[p]
    res["max_rel_diff_packed"] = res["max_rel_diff_pipeline"]  # the figure the issue names
    # the unpatched control (a leak) must move both figures >= 10x more than the pipeline's path, else a
    # pass says nothing; the loss is compared on later samples of a row (the first of a row cannot leak)
    res["samples_from"] = (
        "held-out corpus text (pipeline.dev.corpus)" if text_ids is not None else "random ids"
    )
    res["logit_leak_ratio"] = _ratio(res["max_logit_rel_l2_unpatched"], res["max_logit_rel_l2_pipeline"])
    res["loss_leak_ratio"] = _ratio(
        res["max_rel_diff_unpatched_later_samples"] or 0.0, res["max_rel_diff_pipeline"]
    )
    res["leak_detectable"] = res["logit_leak_ratio"] >= 10 and res["loss_leak_ratio"] >= 10
    res["ok"] = res["max_rel_diff_pipeline"] < a.tol and res["leak_detectable"]
    res["grads"] = "not measured yet"
    res["seconds"] = round(time.time() - t0, 1)
    a.out.write_text(json.dumps(res, indent=1))  # the forward verdict first: the backward compiles (~2 min)

    if a.grads:  # LoRA gradients of the summed per-sample losses: packed rows vs samples alone
        model.zero_grad()
        for s in samples:
            b = {k: torch.tensor([v], device=dev) for k, v in s.items()}
            out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
            _per_sample_losses(out.logits, b["labels"], [(0, len(s["input_ids"]))], "sum")[0].backward()
        g_alone = _lora_grads(model)
        model.zero_grad()
        for row in rows:
            b = {k: v.to(dev) for k, v in collate([row]).items()}
            bounds, s0 = [], 0
            for x in row:
                bounds.append((s0, s0 + len(x["input_ids"])))
                s0 += len(x["input_ids"])
            out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
            sum(_per_sample_losses(out.logits, b["labels"], bounds, "sum")).backward()
        g_packed = _lora_grads(model)
        grads = {
            "lora_params": g_alone.numel(),
            "rel_l2_packed_vs_alone": ((g_packed - g_alone).norm() / g_alone.norm()).item(),
            "grad_norm_alone": g_alone.norm().item(),
        }

        res["grads"] = grads
        res["seconds"] = round(time.time() - t0, 1)
        a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
