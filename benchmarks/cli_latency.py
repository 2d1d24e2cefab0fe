"""Latency of the everyday commands, each a fresh `pipeline` process, against `pipeline --help` in the same run.

    .venv/bin/python benchmarks/cli_latency.py [--repeats 5] [--out benchmarks/results/cli_latency.json]
    .venv/bin/python benchmarks/cli_latency.py --smoke     # one round, no server: the harness works

Setup (not timed): a project in a temp dir (pipeline.yaml, embedded sqlite MLflow, volume), the
tiny Qwen3.5 base, adapters with manifests; versions 1 and 2 registered (validated), v1 published.
Then, `--repeats` times each, round-robin so load drifts hit every command alike:

| command | what it does |
|---|---|
| `--help` | the baseline: Python start-up + typer, no command module |
| `import mlflow` | `python -c "import mlflow"`: what every MLflow write costs first |
| `MLflow client + store` | import, `MlflowClient(sqlite)`, one registry read: the floor of a command that writes through MLflow's client |
| `status` / `status --json` | the registry read (pipeline.registry.read: sqlite read-only, no mlflow) |
| `validate` | the demo-sized adapter against the base, no `--behaviour` |
| `register` | validate + record a new version (a fresh adapter each time) |
| `promote` | alternates v1/v2, both already on the volume: publish's overhead beyond copying, no fleet |
| `rollback` | production back to previous (no fleet) |
| `dataset check` | 30 chat lines, no tokenizer |
| `train`/`run` option typo | `--lerning-rate 0.001`: click's usage error (exit 2) with the `--set` hint (issue 41 item 4) |
| `train` overlay key typo | `--overlay` with `gradient_acumulation_steps`: refused (exit 1) from axolotl's cached keys |
| `run --set` key typo | `--set learning_rat=0.1`: the same refusal through the scheduled job |
| `ui` (until /health) | `pipeline ui --port 0` until the server answers, then SIGTERM |

Each row gives median and max wall seconds, the median CPU seconds of the process tree (user +
system, from `getrusage(RUSAGE_CHILDREN)`: what the command costs on an idle core, whatever the
load), the ratio to `--help`'s median, the goal and whether the median CPU time meets it. Goals:
issue 17 (`status` < 1.5 s, `validate` < 2 s), issue 27 (state-changing commands < 2 s idle) and
issue 41 (usage and schema errors < 1 s). The typo rows read axolotl's config keys from the cache
`pipeline.train.schema.key_tree` keeps (any earlier check on the machine fills it); setup fills it
first (not timed; `--smoke` does not, so its first typo row may pay axolotl's import once).
Results go to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
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
    lines = (REPO / "datasets" / "agent_chat_train.jsonl").read_text().splitlines()[:30]
    (root / "thirty.jsonl").write_text("\n".join(lines) + "\n")
    (root / "typo.yml").write_text("gradient_acumulation_steps: 4\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PIPELINE_CONFIG=str(cfg_path), PYTHONPATH=str(REPO))
    return env, adapters[0], base


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(args: list[str], env: dict, cwd: Path, expect: int = 0) -> tuple[float, float]:
    """(wall s, CPU s of the process tree) of one run; RuntimeError if it exits other than `expect`."""
    c, t = _children_cpu(), time.perf_counter()
    r = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True)
    dt, cpu = time.perf_counter() - t, _children_cpu() - c
    if r.returncode != expect:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return dt, cpu


def timed_ui(env: dict, cwd: Path) -> tuple[float, float]:
    """`pipeline ui --port 0` until it prints its URL (after /health answered), then SIGTERM."""
    c, t = _children_cpu(), time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "ui", "--port", "0"],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = p.stdout.readline()
    dt = time.perf_counter() - t
    p.send_signal(signal.SIGTERM)
    p.wait(60)
    if not line.startswith("MLflow UI:"):
        raise RuntimeError(f"pipeline ui printed {line!r}")
    return dt, _children_cpu() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="one round, no `ui` row, nothing written")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cli_latency.json")
    args = ap.parse_args()
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as td:
        root = Path(td)
        env, adapter, base = setup(root)
        if (
            not args.smoke
        ):  # axolotl's keys, as any earlier check on the machine leaves them (imports axolotl)
            from pipeline.train.passthrough import config_keys
            from pipeline.train.schema import key_tree

            key_tree({})
            config_keys()
        tiny = str(REPO / "axolotl_configs" / "tiny-cpu.yml")
        uri = f"sqlite:///{root / 'state' / 'mlflow.db'}"
        p = ["-m", "pipeline"]
        floor = (
            "from mlflow import MlflowClient\n"
            f"MlflowClient({uri!r}, registry_uri={uri!r}).get_registered_model('agent-tools')"
        )
        # name -> (argv or a special, goal seconds or None[, expected exit code])
        commands: dict[str, tuple] = {
            "--help": ([*p, "--help"], None),
            "import mlflow": (["-c", "import mlflow"], None),
            "MLflow client + store": (["-c", floor], None),
            "status": ([*p, "status", "--no-fleet"], 1.5),
            "status --json": ([*p, "status", "--json"], 1.5),
            "validate": ([*p, "validate", str(adapter), "--base", str(base)], 2.0),
            "register": ("register", 2.0),
            "promote (no copy, no fleet)": ("promote", 2.0),
            "rollback (no fleet)": ([*p, "rollback", "agent-tools"], 2.0),
            "dataset check (30 lines)": ([*p, "dataset", "check", str(root / "thirty.jsonl")], 2.0),
            # usage and schema errors (exit 2, 1), refused before any heavy import (issue 41 item 4)
            "train option typo": ([*p, "train", tiny, "--lerning-rate", "0.001"], 1.0, 2),
            "run option typo": ([*p, "run", tiny, "--lerning-rate", "0.001"], 1.0, 2),
            "train overlay key typo": ([*p, "train", tiny, "--overlay", str(root / "typo.yml")], 1.0, 1),
            "run --set key typo": ([*p, "run", tiny, "--set", "learning_rat=0.1"], 1.0, 1),
        }
        if not args.smoke:
            commands["ui (until /health)"] = ("ui", None)
        wall: dict[str, list[float]] = {k: [] for k in commands}
        cpu: dict[str, list[float]] = {k: [] for k in commands}
        load = []
        for i in range(repeats):
            load.append(os.getloadavg()[0])
            for name, (cmd, _, *expect) in commands.items():
                if cmd == "ui":
                    w, c = timed_ui(env, root)
                else:
                    if cmd == "promote":  # alternates, so production moves every time
                        cmd = [*p, "promote", "agent-tools", str(2 - i % 2)]
                    elif cmd == "register":  # a new adapter each time: a new version
                        a = adapter_with_manifest(base, root / f"r{i}", seed=100 + i)
                        cmd = [*p, "register", str(a), "--name", "agent-tools", "--base", str(base)]
                    w, c = timed(cmd, env, root, *expect)
                wall[name].append(w)
                cpu[name].append(c)
    base_med = statistics.median(wall["--help"])
    rows = []
    for name, (_, goal, *_expect) in commands.items():
        med, cmed = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append(
            {
                "command": name,
                "median_s": round(med, 3),
                "max_s": round(max(wall[name]), 3),
                "cpu_median_s": round(cmed, 3),
                "ratio_to_help": round(med / base_med, 2),
                "goal_s": goal,
                "met": None if goal is None else cmed < goal,
                "runs": [round(t, 3) for t in wall[name]],
                "cpu_runs": [round(t, 3) for t in cpu[name]],
            }
        )
    print(
        f"\nCLI latency, {repeats} runs each, load average {min(load):.1f}-{max(load):.1f}, "
        f"{os.cpu_count()} CPUs ({platform.python_version()})\n"
    )
    print(f"| {'command':<28} | median s | max s | CPU s | x --help | goal s | met (CPU) |")
    print(f"|{'-' * 30}|----------|-------|-------|----------|--------|-----------|")
    for r in rows:
        goal = "" if r["goal_s"] is None else f"< {r['goal_s']}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(
            f"| {r['command']:<28} | {r['median_s']:8.2f} | {r['max_s']:5.2f} | {r['cpu_median_s']:5.2f} | "
            f"{r['ratio_to_help']:8.2f} | {goal:>6} | {met:>9} |"
        )
    if args.smoke:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"repeats": repeats, "load_average": load, "cpus": os.cpu_count(), "rows": rows}, indent=2)
        + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
