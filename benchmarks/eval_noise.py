"""Run-to-run spread of eval loss: N identical trainings, against which `run.eval_loss_margin` is set.

    .venv/bin/python benchmarks/eval_noise.py [--runs 5] [--out benchmarks/results/eval_noise.json]
    .venv/bin/python benchmarks/eval_noise.py --smoke        # 2 runs of 2 steps: the harness works
(The suite checks `row` and `summary` on its one session training: tests/benchmarks/test_smoke.py.)

Every run is `pipeline.train.launch.train` on the same inputs as `pipeline demo`: the tiny random
Qwen3.5 base (`build_tiny_base`, seed 0, built once), `axolotl_configs/tiny-cpu.yml` unchanged
(seed 42, 12 steps, evaluation at steps 6 and 12 on datasets/agent_chat_validation.jsonl), each in
its own run directory and prepared-dataset directory, as fresh demos are. The eval loss recorded
is the manifest's (the value the gate compares). The table gives min, max, range, mean and the
standard deviation (nats), and the margin these figures support: the gate must not hold back an
unchanged retrain, so the margin is set above the largest difference seen between identical runs
(the range), with headroom for runs not seen (docs/registry.md, "Gates on the version").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")

from tests.support.helpers import write_project_config  # noqa: E402

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def trainings(root: Path, runs: int, steps: int | None) -> list[dict]:
    from pipeline.config import load_config
    from pipeline.dev.tinybase import build_tiny_base
    from pipeline.train.launch import train

    base = build_tiny_base(root / "tiny-base")
    out = []
    cwd = os.getcwd()
    os.chdir(REPO)  # the config's dataset paths are relative to the repo root
    try:
        for i in range(runs):
            (root / f"p{i}").mkdir()
            cfg = load_config(write_project_config(root / f"p{i}"))
            sets = [f"base_model={base}", f"dataset_prepared_path={root / f'p{i}' / 'prepared'}"]
            if steps:
                sets += [f"max_steps={steps}", f"eval_steps={steps}", f"save_steps={steps}"]
            t = time.time()
            res = train(cfg, TINY, overrides=sets, show_progress=False)
            out.append(row(res, time.time() - t))
            print(
                f"run {i + 1}/{runs}: eval_loss {out[-1]['eval_loss']!r} ({out[-1]['s']:.0f} s)", flush=True
            )
    finally:
        os.chdir(cwd)
    return out


def row(res, seconds: float) -> dict:
    """One run's figures from its `TrainResult`: the manifest's losses (what the gate compares)."""
    m = res.manifest.metrics
    return {"eval_loss": m.eval_loss, "train_loss": m.train_loss, "s": seconds}


def summary(losses: list[float]) -> dict:
    """min, max, range, mean, stdev (sample) of `losses`; `margin_at_least`: twice the range, rounded up to 0.01."""
    import math

    rng = max(losses) - min(losses)
    return {
        "n": len(losses),
        "min": min(losses),
        "max": max(losses),
        "range": rng,
        "mean": statistics.fmean(losses),
        "stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "margin_at_least": math.ceil(2 * rng * 100) / 100,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="2 runs of 2 steps (seconds, not minutes)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs, steps = (2, 2) if args.smoke else (args.runs, None)
    with tempfile.TemporaryDirectory(prefix="eval-noise-") as td:
        load = os.getloadavg()[0]
        rows = trainings(Path(td), runs, steps)
    s = summary([r["eval_loss"] for r in rows])
    print(
        f"\neval loss of {runs} identical tiny trainings (seed 42), load {load:.1f}, {os.cpu_count()} CPUs\n"
    )
    print("| n | min | max | range | mean | stdev | margin >= 2 x range |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {s['n']} | {s['min']:.4f} | {s['max']:.4f} | {s['range']:.4f} | {s['mean']:.4f} | "
        f"{s['stdev']:.4f} | {s['margin_at_least']:.2f} |"
    )
    if args.out and not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"runs": rows, "summary": s, "load_average": load, "python": platform.python_version()},
                indent=2,
            )
            + "\n"
        )
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
