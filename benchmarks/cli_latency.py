"""Latency of the everyday commands, each a fresh `pipeline` process, against `pipeline --help` in the same run.

    .venv/bin/python benchmarks/cli_latency.py [--repeats 5] [--out benchmarks/results/cli_latency.json]

Setup (not timed): a project in a temp dir (pipeline.yaml, embedded sqlite MLflow, volume), the
tiny Qwen3.5 base, two adapters with manifests registered as versions 1 and 2 (validated), v1
published. Then, `--repeats` times each, round-robin so load drifts hit every command alike:

| command | what it does |
|---|---|
| `--help` | the baseline: Python start-up + typer, no command module |
| `status` / `status --json` | the registry read (pipeline.registry.read: sqlite read-only, no mlflow) |
| `status` via the MLflow client | the same rows through `read_mlflow` (what `status` did before), for comparison |
| `validate` | the demo-sized adapter against the base, no `--behaviour` |
| `promote` | alternates v1/v2, both already on the volume: publish's overhead beyond copying, no fleet |
| `rollback` | production back to previous (no fleet) |

Goals (issue 17): `status` < 1.5 s on the embedded default, `validate` < 2 s, publish overhead
< 2 s. The table prints median and max wall seconds, the ratio to `--help`'s median, the goal
and whether the median meets it. Results also go to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.helpers import write_project_config  # noqa: E402
from tests.support.registry_support import adapter_with_manifest  # noqa: E402


def setup(root: Path) -> tuple[dict, Path, Path]:
    """Project with two registered versions (v1 published); returns (env, adapter dir, base dir)."""
    from pipeline.config import load_config
    from pipeline.dev.tinybase import build_tiny_base
    from pipeline.registry import register_adapter
    from pipeline.release.publish import publish
    from pipeline.validate import validate_adapter

    cfg_path = write_project_config(root)
    cfg = load_config(cfg_path)
    base = build_tiny_base(root / "base")
    adapters = [adapter_with_manifest(base, root / f"a{i}", seed=i) for i in (1, 2)]
    for a in adapters:
        register_adapter(cfg, a, "agent-tools", validate_adapter(a, base).to_dict())
    publish(cfg, "agent-tools", version=1)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PIPELINE_CONFIG=str(cfg_path), PYTHONPATH=str(REPO))
    return env, adapters[0], base


def timed(args: list[str], env: dict, cwd: Path) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cli_latency.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as td:
        root = Path(td)
        env, adapter, base = setup(root)
        p = ["-m", "pipeline"]
        mlflow_status = [
            "-c",
            "from pipeline.config import load_config\nfrom pipeline.registry.read import read_mlflow\n"
            "read_mlflow(load_config(None), None)",
        ]
        commands = {
            "--help": ([*p, "--help"], None),
            "status": ([*p, "status", "--no-fleet"], 1.5),
            "status --json": ([*p, "status", "--json"], 1.5),
            "status (MLflow client)": (mlflow_status, None),
            "validate": ([*p, "validate", str(adapter), "--base", str(base)], 2.0),
            "promote (no copy, no fleet)": (None, 2.0),
            "rollback (no fleet)": ([*p, "rollback", "agent-tools"], 2.0),
        }
        times: dict[str, list[float]] = {k: [] for k in commands}
        load = []
        for i in range(args.repeats):
            load.append(os.getloadavg()[0])
            for name, (cmd, _) in commands.items():
                if cmd is None:  # promote alternates, so production moves every time
                    cmd = [*p, "promote", "agent-tools", str(2 - i % 2)]
                times[name].append(timed(cmd, env, root))
    base_med = statistics.median(times["--help"])
    rows = []
    for name, (_, goal) in commands.items():
        med = statistics.median(times[name])
        rows.append(
            {
                "command": name,
                "median_s": round(med, 3),
                "max_s": round(max(times[name]), 3),
                "ratio_to_help": round(med / base_med, 2),
                "goal_s": goal,
                "met": None if goal is None else med < goal,
                "runs": [round(t, 3) for t in times[name]],
            }
        )
    print(
        f"\nCLI latency, {args.repeats} runs each, load average {min(load):.1f}-{max(load):.1f}, "
        f"{os.cpu_count()} CPUs ({platform.python_version()})\n"
    )
    print(f"| {'command':<28} | median s | max s | x --help | goal s | met |")
    print(f"|{'-' * 30}|----------|-------|----------|--------|-----|")
    for r in rows:
        goal = "" if r["goal_s"] is None else f"< {r['goal_s']}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(
            f"| {r['command']:<28} | {r['median_s']:8.2f} | {r['max_s']:5.2f} | {r['ratio_to_help']:8.2f} | "
            f"{goal:>6} | {met:>3} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"repeats": args.repeats, "load_average": load, "cpus": os.cpu_count(), "rows": rows}, indent=2
        )
        + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
