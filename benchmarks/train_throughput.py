"""LoRA training throughput of the shipped Qwen3.6-27B config, against the naive baseline.

Builds truncated Qwen3.6-27B-shaped text models (random weights; the real dimensions and the
real [linear x3, full] layer pattern; vocab 248,320) with 4 and 8 layers (1 and 2 groups), trains
each variant for a fixed number of steps through the HF Trainer + peft path that axolotl drives
(production LoRA settings read from the shipped config; Liger applied through axolotl 0.19's own
`apply_liger_kernel_to_qwen3_5`), and extrapolates the per-group step time to 64 layers.

Per variant and sequence length it prints tokens/s, effective (trainable-label) tokens/s, MFU,
peak GPU memory, seconds per layer group and the 64-layer extrapolation, and writes JSON.
MFU = 6 x N x tokens/s / peak, N = parameters of the 64-layer text model (counted on the meta
device), peak = the bf16 matmul rate measured in the same run (8192^3, random data) and, for
comparison, the datasheet rate in `pipeline.train.metrics.PEAK_TFLOPS`.

Each variant runs in its own subprocess: the Gated-DeltaNet kernel (flash-linear-attention or the
plain-torch fallback) is chosen when transformers imports the Qwen3.5 module, and Liger patches
classes at module level. Losses and grad norms per step are recorded for the same data and the
same weights (initialised by parameter name), so kernels can be checked against the reference.

    python benchmarks/train_throughput.py --out results.json                 # on a GPU
    python benchmarks/train_throughput.py --tiny --variants baseline,shipped  # toy geometry on CPU
    python benchmarks/train_throughput.py --smoke   # the suite's check: baseline, 4 and 8 toy layers, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "axolotl_configs" / "qwen3.6-27b-lora.yml"
sys.path.insert(0, str(ROOT))  # run as a script from any directory (also on the GPU host)
from pipeline.dev.realbase import QWEN36_27B_TEXT  # noqa: E402
from pipeline.train.metrics import peak_for  # noqa: E402 (the datasheet table: one copy)

# Qwen3.6-27B text geometry: the one copy in pipeline/dev/realbase.py (docs/qwen3.6-27b.md).
GEOMETRY = {k: v for k, v in QWEN36_27B_TEXT.items() if k != "num_hidden_layers"} | {
    "max_position_embeddings": 32768
}
TINY = dict(
    GEOMETRY,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    vocab_size=512,
)
FULL_LAYERS = 64
SEED_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_FRACTION = 0.25  # leading labels masked (-100) like a chat prompt: effective = trainable tokens
LIGER_ALL = dict(
    liger_rms_norm=True,
    liger_glu_activation=True,
    liger_rms_norm_gated=True,
    liger_fused_linear_cross_entropy=True,
)

# name -> (settings overriding the shipped config, sequence lengths, layer counts). "fla": flash-linear-attention
# Gated-DeltaNet kernels; otherwise transformers' plain-torch fallback. "shipped" takes every
# setting from the config file as it is now.
VARIANTS = {
    "baseline": (
        dict(
            lora_target_modules=SEED_TARGETS,
            fla=False,
            liger={},
            gradient_checkpointing=True,
            micro_batch_size=1,
        ),
        (4096, 16384),
        (4, 8),
    ),
    "prod-ref": (dict(fla=False, liger={}), (4096, 16384), (4, 8)),
    "liger": (dict(fla=False, liger=LIGER_ALL), (4096,), (4, 8)),
    "fla": (dict(fla=True, liger={}), (4096, 16384), (4, 8)),
    "fla+liger": (dict(fla=True, liger=LIGER_ALL), (4096, 16384), (4, 8)),
    "fla+liger-mbs2": (dict(fla=True, liger=LIGER_ALL, micro_batch_size=2), (4096,), (4, 8)),
    "fla+liger-eager": (dict(fla=True, liger=LIGER_ALL, attn="eager"), (4096,), (4, 8)),
    "fla+liger-noGC": (dict(fla=True, liger=LIGER_ALL, gradient_checkpointing=False), (4096,), (4, 8, 64)),
    # axolotl `selective_checkpointing: {save: ["aten::mm"]}`: keep matmul outputs, recompute the rest
    "fla+liger-sacmm": (dict(fla=True, liger=LIGER_ALL, sac=["aten::mm"]), (4096,), (4, 8, 64)),
    # with the CUDA causal_conv1d package (built from its sdist; no wheel on PyPI) instead of F.conv1d
    "fla+liger+cc1d": (dict(fla=True, liger=LIGER_ALL, cc1d=True), (4096,), (4, 8)),
    "shipped+cc1d": (dict(cc1d=True), (4096,), (64,)),
    # the shipped config as it is, measured directly at the full 64 layers
    "shipped": (dict(), (4096, 16384), (64,)),
}


def shipped_settings() -> dict:
    """The LoRA/optimizer/kernel settings of the shipped axolotl config."""
    import yaml

    c = yaml.safe_load(CONFIG.read_text())
    liger = {
        k: bool(c.get(k))
        for k in (
            "liger_rms_norm",
            "liger_glu_activation",
            "liger_rms_norm_gated",
            "liger_fused_linear_cross_entropy",
        )
        if c.get(k)
    }
    return dict(
        lora_r=c["lora_r"],
        lora_alpha=c["lora_alpha"],
        lora_dropout=c.get("lora_dropout", 0.0),
        lora_target_modules=c["lora_target_modules"],
        learning_rate=float(c["learning_rate"]),
        optimizer=c.get("optimizer", "adamw_torch"),
        weight_decay=c.get("weight_decay", 0.0),
        gradient_checkpointing=bool(c.get("gradient_checkpointing")),
        micro_batch_size=c.get("micro_batch_size", 1),
        liger=liger,
        fla=True,
        attn="sdpa" if not c.get("flash_attention") else "flash_attention_2",
    )


def layer_types(n: int) -> list[str]:
    return [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)]


# ----------------------------------------------------------------------------- worker
def _init_by_name(model) -> None:
    """Same weights in every variant: each tensor drawn from a generator seeded by its name."""
    import torch

    for name, p in model.named_parameters():
        short = name.replace("base_model.model.", "").replace(".default", "")
        g = torch.Generator(device=p.device).manual_seed(zlib.crc32(short.encode()))
        with torch.no_grad():
            if "lora_B" in short:
                p.zero_()
            elif "lora_A" in short:
                p.uniform_(-1.0, 1.0, generator=g).mul_(p.shape[1] ** -0.5)
            elif short.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=g).log())
            elif short.endswith("dt_bias"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            # 1-D norm weights keep their class's constant init (zeros for (1+w) norms, ones otherwise)


def run_case(s: dict, layers: int, seq: int, steps: int, warmup: int, tiny: bool) -> dict:
    """Train `steps` + `warmup` steps of one model; step times exclude the warmup steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cuda = torch.cuda.is_available() and not tiny
    dev = "cuda" if cuda else "cpu"
    geom = TINY if tiny else GEOMETRY
    cfg = Qwen3_5TextConfig(**geom, num_hidden_layers=layers, layer_types=layer_types(layers))
    cfg._attn_implementation = s.get("attn", "sdpa")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = mq.Qwen3_5ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if s.get("sac"):
        from axolotl.monkeypatch.selective_checkpointing import apply_selective_checkpointing

        apply_selective_checkpointing(model, save=s["sac"])  # forces non-reentrant checkpointing
    if s["gradient_checkpointing"]:
        # as axolotl does for adapters: reentrant checkpointing needs inputs that require grad
        model.enable_input_require_grads()
    base_params = sum(p.numel() for p in model.parameters())
    lcfg = LoraConfig(
        r=s["lora_r"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=s["lora_dropout"],
        target_modules=s["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lcfg)
    _init_by_name(model)

    mbs = s["micro_batch_size"]
    n = mbs * (steps + warmup)
    gen = torch.Generator().manual_seed(1234 + seq)
    ids = torch.randint(0, cfg.vocab_size, (n, seq), generator=gen)
    labels = ids.clone()
    labels[:, : int(seq * PROMPT_FRACTION)] = -100

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {
                "input_ids": ids[i],
                "labels": labels[i],
                "attention_mask": torch.ones(seq, dtype=torch.long),
            }

    times, records = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                records.append(
                    {"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm")}
                )

    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"tt-{os.getpid()}"
    args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=1,
        max_steps=steps + warmup,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        optim=s["optimizer"],
        weight_decay=s["weight_decay"],
        bf16=cuda,
        tf32=cuda,
        gradient_checkpointing=s["gradient_checkpointing"],
        # axolotl 0.19 sets use_reentrant=True when gradient_checkpointing is on and no kwargs given
        gradient_checkpointing_kwargs={"use_reentrant": True},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=42,
        disable_tqdm=True,
        use_cpu=not cuda,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[Timer()])
    trainer.train()
    timed = times[warmup:]
    step_s = statistics.median(timed)
    tokens = mbs * seq
    res = dict(
        layers=layers,
        seq=seq,
        mbs=mbs,
        step_s=step_s,
        step_times=times,
        base_params=base_params,
        tokens_per_step=tokens,
        trainable_per_step=int((labels[:mbs, 1:] != -100).sum()),
        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        logs=records,
        gdn_kernel=("fla" if sys.modules.get("fla") else "torch")
        + ("+cc1d" if sys.modules.get("causal_conv1d") else ""),
    )
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return res


def worker(variant: str, layers: list[int], seqs: list[int], steps: int, warmup: int, tiny: bool) -> None:
    over = VARIANTS[variant][0]
    s = shipped_settings()
    s.update({k: v for k, v in over.items()})
    if not s.get("fla"):
        sys.modules["fla"] = None  # transformers then binds its plain-torch Gated-DeltaNet path
    if not s.get("cc1d"):
        sys.modules["causal_conv1d"] = None  # transformers' F.conv1d fallback (what axolotl installs)
    if s.get("liger"):
        # axolotl's own Qwen3.5 Liger patch (LigerPlugin does exactly this for model_config_type qwen3_5)
        from axolotl.integrations.liger.models.qwen3_5 import apply_liger_kernel_to_qwen3_5

        apply_liger_kernel_to_qwen3_5(
            rms_norm=s["liger"].get("liger_rms_norm", False),
            glu_activation=s["liger"].get("liger_glu_activation", False),
            rms_norm_gated=s["liger"].get("liger_rms_norm_gated", False),
            fused_linear_cross_entropy=s["liger"].get("liger_fused_linear_cross_entropy", False),
        )
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401  (binds the GDN kernel)

    settings = dict(s)
    print("SETTINGS " + json.dumps(settings, default=str), flush=True)
    for seq in seqs:
        for n in layers:
            t0 = time.time()
            try:
                r = run_case(s, n, seq, steps, warmup, tiny)
                r["ok"] = True
            except Exception as e:  # OOM or a kernel refusing: record it and go on
                r = dict(layers=n, seq=seq, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            r.update(variant=variant, wall_s=time.time() - t0, settings=settings)
            print("RESULT " + json.dumps(r), flush=True)


# ----------------------------------------------------------------------------- orchestrator
def measure_peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192**3 / statistics.median(ts) / 1e12


def full_params(tiny: bool) -> int:
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    cfg = Qwen3_5TextConfig(
        **(TINY if tiny else GEOMETRY), num_hidden_layers=FULL_LAYERS, layer_types=layer_types(FULL_LAYERS)
    )
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(cfg)
    return sum(p.numel() for p in m.parameters())


def extrapolate(rows: list[dict], n_full: int, peak: float | None, datasheet: float | None) -> list[dict]:
    """Per (variant, seq): a linear fit t(L) = c + s*L through the truncated runs, taken to 64 layers;
    runs made at the full 64 layers are reported as measured (`direct`)."""
    out, seen = [], set()
    # one run per (variant, seq, layers): the first given wins
    rows = [
        r
        for r in rows
        if not (
            (r["variant"], r["seq"], r["layers"]) in seen or seen.add((r["variant"], r["seq"], r["layers"]))
        )
    ]
    keys = sorted(
        {(r["variant"], r["seq"], r["layers"] >= FULL_LAYERS) for r in rows},
        key=lambda k: (list(VARIANTS).index(k[0]), k[2], k[1]),
    )
    for v, seq, direct in keys:
        mine = [
            r
            for r in rows
            if r["variant"] == v and r["seq"] == seq and (r["layers"] >= FULL_LAYERS) == direct
        ]
        ok = sorted((r for r in mine if r.get("ok")), key=lambda r: r["layers"])
        err = next((r["error"] for r in mine if not r.get("ok")), None)
        row = dict(variant=v, seq=seq, direct=direct, error=err)
        if direct and ok:
            a = ok[-1]
            t_full, group, mem64 = a["step_s"], None, a["peak_mem_gb"]
        elif len(ok) >= 2:
            a, b = ok[0], ok[-1]
            slope = (b["step_s"] - a["step_s"]) / (b["layers"] - a["layers"])
            t_full, group = a["step_s"] + slope * (FULL_LAYERS - a["layers"]), slope * 4
            mem64 = None
            if a["peak_mem_gb"]:
                mslope = (b["peak_mem_gb"] - a["peak_mem_gb"]) / (b["layers"] - a["layers"])
                mem64 = a["peak_mem_gb"] + mslope * (FULL_LAYERS - a["layers"])
        else:
            out.append(row)
            continue
        tps = a["tokens_per_step"] / t_full
        row.update(
            mbs=a["mbs"],
            group_s=group,
            t_step_64=t_full,
            tokens_per_s=tps,
            trainable_tokens_per_s=a["trainable_per_step"] / t_full,
            mfu=6 * n_full * tps / (peak * 1e12) if peak else None,
            mfu_datasheet=6 * n_full * tps / (datasheet * 1e12) if datasheet else None,
            mem_gb_measured={r["layers"]: r["peak_mem_gb"] for r in ok},
            mem_gb_64=mem64,
            losses={r["layers"]: [x["loss"] for x in r["logs"]] for r in ok},
            grad_norms={r["layers"]: [x["grad_norm"] for x in r["logs"]] for r in ok},
        )
        out.append(row)
    # loss check: each variant against the reference with the same LoRA targets (same trained params)
    for row in out:
        ref_name = "baseline" if row["variant"] == "baseline" else "prod-ref"
        ref = next(
            (
                r
                for r in out
                if r["variant"] == ref_name and r["seq"] == row["seq"] and "losses" in r and not r["direct"]
            ),
            None,
        )
        if ref and "losses" in row and VARIANTS[row["variant"]][0].get("lora_target_modules") is None:
            L = max(ref["losses"])
            # same data only with the same batch and step count (the Trainer shuffles the n samples)
            if (
                L in row["losses"]
                and row.get("mbs") == ref.get("mbs")
                and len(row["losses"][L]) == len(ref["losses"][L])
            ):
                la, lb = row["losses"][L], ref["losses"][L]
                ga, gb = row["grad_norms"][L], ref["grad_norms"][L]
                row["loss_max_rel_diff"] = _worst([abs(x - y) / abs(y) for x, y in zip(la, lb, strict=False)])
                row["grad_norm_max_rel_diff"] = _worst(
                    [abs(x - y) / abs(y) for x, y in zip(ga, gb, strict=False) if y]
                )
    return out


def _worst(xs: list[float]) -> float | None:
    """The largest difference; inf when any is NaN or inf (max() drops a NaN that is not first)."""
    if not xs:
        return None
    return math.inf if any(not math.isfinite(x) for x in xs) else max(xs)


def table(rows: list[dict], peak: float | None) -> str:
    hdr = (
        f"{'variant':<17}{'seq':>6}{'mbs':>4}{'s/group':>9}{'s/step64':>9}{'tok/s':>8}{'eff tok/s':>10}"
        f"{'MFU':>7}{'MFU(ds)':>8}{'memL GB':>9}{'mem64 GB':>9}{'dloss':>9}{'dgnorm':>8}"
    )
    lines = [
        f"64-layer extrapolation; MFU vs measured bf16 matmul {peak or float('nan'):.0f} TFLOP/s, "
        "MFU(ds) vs datasheet",
        hdr,
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(
                f"{r['variant'] + (' @64' if r['direct'] else ''):<17}{r['seq']:>6}  FAILED: {r.get('error')}"
            )
            continue
        f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        m8 = r["mem_gb_measured"].get(max(r["mem_gb_measured"]))
        name = r["variant"] + (" @64" if r["direct"] else "")
        lines.append(
            f"{name:<17}{r['seq']:>6}{r['mbs']:>4}{f(r['group_s'], 3):>9}{r['t_step_64']:>9.2f}"
            f"{r['tokens_per_s']:>8.0f}{r['trainable_tokens_per_s']:>10.0f}"
            f"{f(r['mfu'] and 100 * r['mfu']):>6}%{f(r['mfu_datasheet'] and 100 * r['mfu_datasheet']):>7}%"
            f"{f(m8):>9}{f(r['mem_gb_64']):>9}{f(r.get('loss_max_rel_diff'), 4):>9}"
            f"{f(r.get('grad_norm_max_rel_diff'), 3):>8}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", default=None, help="override every variant's layer counts")
    ap.add_argument("--seqs", default=None, help="override every variant's sequence lengths")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="toy geometry on CPU")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="--tiny, variant baseline, layers 4,8, seq 64, 2 steps; exit 1 on a failure",
    )
    ap.add_argument("--out", default="train_throughput.json")
    ap.add_argument("--raw", default=None, help="append each worker result here as JSON lines")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant subprocess")
    ap.add_argument("--from-raw", default=None, help="summarise these --raw files (comma-separated); no runs")
    ap.add_argument("--peak", type=float, default=None, help="with --from-raw: measured bf16 TFLOP/s")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:  # the variant that runs without CUDA/Triton kernels (fla, Liger need a GPU)
        a.tiny, a.variants, a.layers, a.seqs, a.steps, a.warmup = True, "baseline", "4,8", "64", 2, 1
    if a.worker:
        layers = [int(x) for x in a.layers.split(",")]
        worker(a.worker, layers, [int(x) for x in a.seqs.split(",")], a.steps, a.warmup, a.tiny)
        return 0
    if a.from_raw:
        rows = [
            json.loads(x)
            for f in a.from_raw.split(",")
            for x in Path(f).read_text().splitlines()
            if x.strip()
        ]
        gpu = "H200"
        datasheet = peak_for("H200")
        summary = extrapolate(rows, full_params(a.tiny), a.peak, datasheet)
        Path(a.out).write_text(
            json.dumps(
                dict(peak_tflops_measured=a.peak, peak_tflops_datasheet=datasheet, rows=summary), indent=1
            )
        )
        print(table(summary, a.peak))
        return 0

    import torch

    peak = measure_peak_tflops()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    datasheet = peak_for(gpu)
    n_full = full_params(a.tiny)
    print(
        f"gpu={gpu} measured bf16 matmul={peak} TFLOP/s datasheet={datasheet} params(64 layers)={n_full}",
        flush=True,
    )
    rows, dead = [], []
    for v in a.variants.split(","):
        seqs = a.seqs or ",".join(str(s) for s in VARIANTS[v][1])
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            v,
            "--layers",
            a.layers or ",".join(str(n) for n in VARIANTS[v][2]),
            "--seqs",
            seqs,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
        ] + (["--tiny"] if a.tiny else [])
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            stdout, rc = p.stdout, p.returncode
            tail = (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired as e:
            stdout, rc = (
                (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                "timeout",
            )
            tail = stdout[-1500:]
        got = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
        for r in got:
            short = {
                k: r.get(k) for k in ("layers", "seq", "step_s", "peak_mem_gb", "ok", "error", "gdn_kernel")
            }
            print(f"  {v}: {short}", flush=True)
        if rc != 0 or not got:
            print(f"  {v}: rc={rc}\n{tail}", flush=True)
        if rc != 0:  # a worker that died after some cases: the cases it did not report failed
            dead.append(f"{v}: worker exit {rc} after {len(got)} case(s)")
        if a.raw:
            with open(a.raw, "a") as f:
                for r in got:
                    f.write(json.dumps(r) + "\n")
        rows += got
        print(f"{v}: {time.time() - t0:.0f}s", flush=True)
    summary = extrapolate(rows, n_full, peak, datasheet)
    Path(a.out).write_text(
        json.dumps(
            dict(
                gpu=gpu,
                peak_tflops_measured=peak,
                peak_tflops_datasheet=datasheet,
                params_64=n_full,
                rows=summary,
                raw=rows,
            ),
            indent=1,
        )
    )
    print(table(summary, peak))
    failed = [r for r in rows if not r.get("ok")]
    for d in dead:
        print(f"FAILED {d}", flush=True)
    return 1 if not rows or (a.smoke and (failed or dead)) else 0


if __name__ == "__main__":
    sys.exit(main())
