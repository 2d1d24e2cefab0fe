"""`pipeline train`: check inputs, run axolotl itself, leave an adapter with a manifest.

axolotl runs in a child process through its own CLI and launchers (`--launcher python` for
one device, `accelerate`/`torchrun` for several, arguments after `--` passed through): never a
home-made launcher. The child writes per-step metrics to `metrics.jsonl` through
`pipeline.train.axolotl_plugin`; this process tails it for progress (step/total, loss, tokens/s,
ETA: a bar on a terminal, a log line every $PIPELINE_PROGRESS_INTERVAL seconds (30) and at each
evaluation otherwise, e.g. under cron or `> log 2>&1`) and for throughput, and axolotl's own MLflow integration logs per-step metrics into the run created
here (`MLFLOW_RUN_ID`).

Run directory layout (`<train.runs_dir>/<name>-<UTC timestamp>/`):
  resolved.yml       the config axolotl ran (overrides applied, paths absolute)
  dataset_report.json
  metrics.jsonl      per-step records from the trainer
  train.log          axolotl's stdout/stderr
  output/            axolotl's output_dir (checkpoints)
  adapter/           the adapter the rest of the pipeline uses, with manifest.json (written last)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.fingerprint import base_fingerprint, training_inputs
from pipeline.artifacts.manifest import MANIFEST, file_hashes, package_versions
from pipeline.artifacts.names import check_name, default_name
from pipeline.children import guarded
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, PipelineError
from pipeline.train.config import TrainingConfig, check_training_config, load_training_config
from pipeline.train.dataset import DatasetReport, check_datasets
from pipeline.train.preflight import Gpu, detect_gpus, logits_memory_problem, packing_problems
from pipeline.train.schema import check_axolotl_schema
from pipeline.validate.report import FleetRules

log = logging.getLogger("pipeline.train")

PLUGIN = "pipeline.train.axolotl_plugin.PipelinePlugin"
# Files copied from axolotl's output_dir into the adapter directory.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
# Per-GPU dense bf16 peak (TFLOP/s, no sparsity) by device-name substring, from vendor datasheets;
# the longest matching key wins ("H20" vs "H200"). Override with train.peak_tflops, e.g. with a
# measured matmul rate: an H200 here ran 8192^3 bf16 products at 727-798 TFLOP/s, so MFU against
# the datasheet reads ~0.78x MFU against the measured rate (benchmarks/RESULTS.md).
# MFU = 6 x base parameters x tokens/s / (peak x GPUs).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX PRO 6000": 504.0,
}


# Module names that FSDP2's activation checkpointing (torch.distributed checkpoint_wrapper), FSDP1 and
# torch.compile insert between a module and its children: the PEFT state dict of an FSDP2 run with
# `fsdp_config.activation_checkpointing: true` has keys like
# `...layers.0._checkpoint_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.lora_A.weight`
# (measured on 2 H200s, benchmarks/RESULTS.md), which no server maps to the base's modules.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def normalise_adapter_keys(path: Path) -> int:
    """Rewrite `path` (adapter_model.safetensors) without WRAPPER_SEGMENTS in tensor names.

    Returns the number of renamed tensors (0: file untouched). Raises CheckFailed when two tensors
    would get the same name.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        metadata = f.metadata()
        renames = {}
        for k in keys:
            new = k
            for seg in WRAPPER_SEGMENTS:
                new = new.replace(seg, "")
            if new != k:
                renames[k] = new
        if not renames:
            return 0
        tensors = {renames.get(k, k): f.get_tensor(k) for k in keys}
    if len(tensors) != len(keys):
        raise CheckFailed(f"{path}: removing wrapper names from tensor names makes two tensors collide")
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return len(renames)


class TrainError(CheckFailed):
    """axolotl exited non-zero or left no adapter."""


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    manifest: dict
    run_id: str | None
    seconds: float


def train_env(extra: dict | None = None) -> dict:
    """Environment for the axolotl child: offline, no telemetry."""
    env = dict(os.environ)
    for k in env.pop("PIPELINE_QUIETED_ENV", "").split(","):  # the CLI's quiet settings are for the CLI only
        env.pop(k, None)
    env.update(
        {
            "AXOLOTL_DO_NOT_TRACK": "1",
            "WANDB_MODE": "disabled",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    # axolotl's launchers run `accelerate` / `torchrun` by name: find ours even when the venv
    # is not activated (e.g. `.venv/bin/pipeline train ...` from cron).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def _load_tokenizer(base: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base)
    except Exception:  # hub id not cached offline: the length check is skipped
        return None


def check_inputs(
    cfg: ProjectConfig, tc: TrainingConfig, allow: set[str], world: int = 1, gpus: list[Gpu] | None = None
) -> DatasetReport:
    """Config servability, axolotl's schema, GPU preflight (packing on Gated-DeltaNet models,
    logits memory) and dataset checks. Raises CheckFailed before anything is written.

    `gpus`: the visible GPUs (default: pipeline.train.preflight.detect_gpus()); `world`: processes.
    """
    gpus = detect_gpus() if gpus is None else gpus
    # the rules `validate` runs (train scope), the preflight's packing facts among them (train.sample_packing)
    check_training_config(tc, FleetRules.from_config(cfg), allow, packing=packing_problems(tc, gpus))
    check_axolotl_schema(tc)
    problems = []
    if "logits_memory" not in allow and (msg := logits_memory_problem(tc, gpus, world)):
        problems.append(f"{msg} (override with --allow logits_memory)")
    if problems:
        raise CheckFailed("training config refused:\n  " + "\n  ".join(problems))
    # each file with its own datasets entry (field mappings, roles, roles_to_train), as axolotl reads it
    formats = {
        str(Path(d["path"])): d
        for key in ("datasets", "test_datasets")
        for d in tc.data.get(key) or []
        if isinstance(d, dict) and d.get("path")
    }
    report = check_datasets(
        tc.dataset_paths("datasets"),
        tc.dataset_paths("test_datasets"),
        tokenizer=_load_tokenizer(str(tc.data.get("base_model"))),
        sequence_len=tc.data.get("sequence_len"),
        formats=formats,
        config=tc.data,
    )
    if not report.ok:
        shown = "\n  ".join(str(f) for f in report.errors[:30])
        more = f"\n  ... and {len(report.errors) - 30} more" if len(report.errors) > 30 else ""
        raise CheckFailed(f"dataset check failed ({len(report.errors)} errors):\n  {shown}{more}")
    return report


def resolve(tc: TrainingConfig, run_dir: Path, cfg: ProjectConfig) -> dict:
    """The config axolotl will run: absolute paths, our output_dir, plugin and MLflow settings."""
    d = json.loads(json.dumps(tc.data))
    for key in ("datasets", "test_datasets"):
        for ds in d.get(key) or []:
            if isinstance(ds, dict) and "path" in ds and Path(ds["path"]).exists():
                ds["path"] = str(Path(ds["path"]).resolve())
    if Path(str(d.get("base_model", ""))).exists():
        d["base_model"] = str(Path(d["base_model"]).resolve())
    # `base_model_revision` is the pipeline's key (axolotl ignores it); axolotl's loaders read revision_of_model
    rev = d.get("base_model_revision")
    if rev and not (d.get("revision_of_model") or d.get("model_revision")):
        d["revision_of_model"] = rev
    if d.get("dataset_prepared_path"):
        d["dataset_prepared_path"] = str(Path(d["dataset_prepared_path"]).resolve())
    d["output_dir"] = str(run_dir / "output")
    d["plugins"] = list(dict.fromkeys([*(d.get("plugins") or []), PLUGIN]))
    d["use_mlflow"] = True
    d["mlflow_tracking_uri"] = cfg.tracking_uri
    d["mlflow_experiment_name"] = cfg.registry.experiment
    return d


def launcher_command(
    resolved_yml: Path, gpus: int = 1, launcher: str | None = None, launcher_args=()
) -> list[str]:
    """The axolotl CLI command for this run (shown to the user before it starts).

    One device: `--launcher python` (in-process trainer, no accelerate wrapper). Several:
    axolotl's `accelerate` launcher (or `torchrun`) with `--num_processes N` / `--nproc_per_node N`
    unless given in `launcher_args`.
    """
    launcher = launcher or ("python" if gpus <= 1 else "accelerate")
    cmd = [sys.executable, "-m", "axolotl.cli.main", "train", str(resolved_yml), "--launcher", launcher]
    extra = list(launcher_args)
    if gpus > 1 and launcher == "accelerate" and not any(a.startswith("--num_processes") for a in extra):
        extra = ["--num_processes", str(gpus), *extra]
    if gpus > 1 and launcher == "torchrun" and not any(a.startswith("--nproc_per_node") for a in extra):
        extra = ["--nproc_per_node", str(gpus), *extra]
    if extra:
        cmd += ["--", *extra]
    return cmd


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete `checkpoint-N` under axolotl's output_dir, or None.

    Complete = has `trainer_state.json` (the Trainer writes it after the weights and optimizer).
    """
    cands = []
    for p in Path(output_dir).glob("checkpoint-*"):
        if p.is_dir() and (p / "trainer_state.json").exists() and p.name.split("-")[-1].isdigit():
            cands.append((int(p.name.split("-")[-1]), p))
    return max(cands)[1] if cands else None


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def peak_for(gpu: str | None) -> float | None:
    """Datasheet bf16 TFLOP/s for a CUDA device name (longest PEAK_TFLOPS key it contains), or None."""
    keys = [k for k in PEAK_TFLOPS if gpu and k in gpu]
    return PEAK_TFLOPS[max(keys, key=len)] if keys else None


def summarise(records: list[dict], peak_tflops: float | None = None) -> dict:
    """Final losses, throughput and MFU from the records of metrics.jsonl.

    Throughput counts training time only: the sum of gaps between consecutive training log
    records, leaving out gaps that contain an evaluation and gaps across a restart (a new `begin`
    record, e.g. after resuming: model loading is not training). Token counts are axolotl's
    cumulative `tokens/total` and `tokens/trainable` (all ranks). Keys written when derivable:
    train_loss, eval_loss, tokens_per_s, trainable_tokens_per_s, mfu (fraction of
    `peak_tflops` x world_size, default: PEAK_TFLOPS for the GPU named in `begin`), peak_tflops,
    peak_mem_gib (axolotl's `memory/max_allocated (GiB)`), train_runtime_s, steps.
    """
    out: dict = {}
    segment, seg_of = 0, []
    for r in records:  # which training session (one per `begin`) each record belongs to
        segment += r.get("event") == "begin"
        seg_of.append(segment)
    logs = [(s, r) for s, r in zip(seg_of, records, strict=True) if r.get("event") == "log"]
    begins = [r for r in records if r.get("event") == "begin"]
    begin = begins[-1] if begins else {}
    train = [(s, r) for s, r in logs if "loss" in r]
    evals = [r for _, r in logs if "eval_loss" in r]
    if train:
        out["train_loss"] = train[-1][1]["loss"]
    if evals:
        out["eval_loss"] = evals[-1]["eval_loss"]
    dt_s = dtok = dtrain = 0.0
    has_trainable = True
    tok = [(s, r) for s, r in train if "tokens/total" in r]
    for (sa, a), (sb, b) in zip(tok, tok[1:], strict=False):
        if sa != sb or any(a["time"] < e["time"] < b["time"] for e in evals):
            continue
        if b["tokens/total"] < a["tokens/total"]:  # counters reset: not a training gap
            continue
        dt_s += b["time"] - a["time"]
        dtok += b["tokens/total"] - a["tokens/total"]
        if "tokens/trainable" in a and "tokens/trainable" in b:
            dtrain += b["tokens/trainable"] - a["tokens/trainable"]
        else:
            has_trainable = False
    if dt_s > 0 and dtok > 0:
        out["tokens_per_s"] = dtok / dt_s
        if has_trainable:
            out["trainable_tokens_per_s"] = dtrain / dt_s
    final = next((r for _, r in reversed(logs) if "train_runtime" in r), None)
    if final:
        out["train_runtime_s"] = final["train_runtime"]
    mem = [r["memory/max_allocated (GiB)"] for _, r in logs if "memory/max_allocated (GiB)" in r]
    if mem:
        out["peak_mem_gib"] = max(mem)
    world = begin.get("world_size") or 1
    peak = peak_tflops or peak_for(begin.get("gpu"))
    if peak:
        out["peak_tflops"] = peak
    if peak and begin.get("base_params") and out.get("tokens_per_s"):
        out["mfu"] = 6 * begin["base_params"] * out["tokens_per_s"] / (peak * 1e12 * world)
    out["steps"] = max((r.get("step", 0) for _, r in logs), default=0)
    return out


@dataclass
class Progress:
    """Training progress read from metrics.jsonl: step/total, losses, tokens/s, elapsed and ETA (seconds)."""

    step: int = 0
    total: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None

    def line(self) -> str:
        """`train: step 6/12 (50%)  loss 2.3456  eval 2.4012  1234 tokens/s  elapsed 0:01:02  ETA 0:01:02`."""
        if self.step == 0:
            return f"train: loading model and data  elapsed {_hms(self.elapsed_s)}"
        total = f"/{self.total} ({100 * self.step / self.total:.0f}%)" if self.total else ""
        parts = [f"train: step {self.step}{total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.0f} tokens/s")
        parts.append(f"elapsed {_hms(self.elapsed_s)}")
        if self.eta_s is not None:
            parts.append(f"ETA {_hms(self.eta_s)}")
        return "  ".join(parts)


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_of(records: list[dict], started: float, now: float | None = None) -> Progress:
    """Progress from metrics.jsonl records of the latest session (`begin`); `started`: wall time (s) it began.

    tokens/s: axolotl's cumulative `tokens/total` over wall time between the session's first and
    last training log; ETA: time per step so far in this session x steps left.
    """
    now = time.time() if now is None else now
    begins = [i for i, r in enumerate(records) if r.get("event") == "begin"]
    recs = records[begins[-1] :] if begins else records
    logs = [r for r in recs if r.get("event") == "log"]
    p = Progress(elapsed_s=now - started)
    begin = recs[0] if begins else {}
    p.total = begin.get("max_steps") or next(
        (r.get("max_steps") for r in reversed(logs) if r.get("max_steps")), None
    )
    if not logs:
        return p
    last = logs[-1]
    p.step = int(last.get("step") or 0)
    p.total = last.get("max_steps") or p.total
    p.loss = next((r["loss"] for r in reversed(logs) if "loss" in r), None)
    p.eval_loss = next((r["eval_loss"] for r in reversed(logs) if "eval_loss" in r), None)
    tok = [r for r in logs if "tokens/total" in r and "time" in r]
    if len(tok) >= 2 and tok[-1]["time"] > tok[0]["time"]:
        p.tokens_per_s = (tok[-1]["tokens/total"] - tok[0]["tokens/total"]) / (
            tok[-1]["time"] - tok[0]["time"]
        )
    train = [r for r in logs if "loss" in r and "time" in r and r.get("step")]  # evaluations take extra time
    if len(train) >= 2 and p.total and int(train[-1]["step"]) > int(train[0]["step"]):
        per_step = (train[-1]["time"] - train[0]["time"]) / (int(train[-1]["step"]) - int(train[0]["step"]))
        p.eta_s = per_step * max(p.total - p.step, 0)
    return p


# Seconds between progress lines when stderr is not a terminal (`pipeline train > log 2>&1`, cron, CI).
PROGRESS_INTERVAL_ENV = "PIPELINE_PROGRESS_INTERVAL"


def _progress_loop(proc: subprocess.Popen, metrics: Path, mode: str, interval_s: float | None = None) -> None:
    """Wait for the trainer, showing progress: `bar` (rich, a terminal), `lines` (a log line every
    `interval_s` seconds, default $PIPELINE_PROGRESS_INTERVAL or 30, plus one per evaluation and
    at the end), or `off`."""
    started = time.time()
    if mode == "lines":
        interval_s = interval_s or float(os.environ.get(PROGRESS_INTERVAL_ENV) or 30)
        last_line = 0.0
        last_eval = None
        while proc.poll() is None:
            p = progress_of(read_metrics(metrics), started)
            now = time.time()
            if now - last_line >= interval_s or (p.eval_loss is not None and p.eval_loss != last_eval):
                log.info(p.line())
                last_line, last_eval = now, p.eval_loss
            time.sleep(min(0.5, interval_s))
        log.info(progress_of(read_metrics(metrics), started).line() + f"  (trainer exited {proc.returncode})")
        return
    if mode != "bar":
        proc.wait()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar

    with Bar(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as prog:
        task = prog.add_task("train", total=None, info="loading model and data")
        while proc.poll() is None:
            p = progress_of(read_metrics(metrics), started)
            if p.step:
                info = f"loss {p.loss:.4f}" if p.loss is not None else ""
                info += f"  eval {p.eval_loss:.4f}" if p.eval_loss is not None else ""
                info += f"  {p.tokens_per_s:.0f} tok/s" if p.tokens_per_s is not None else ""
                prog.update(task, total=p.total, completed=p.step, info=info)
            time.sleep(0.5)


def progress_mode(show_progress: bool | str) -> str:
    """`bar` on a terminal, `lines` otherwise; `off` when disabled. Accepts a mode string as is."""
    if isinstance(show_progress, str):
        return show_progress
    if not show_progress:
        return "off"
    return "bar" if sys.stderr.isatty() else "lines"


def train(
    cfg: ProjectConfig,
    config_path: Path,
    *,
    overrides: list[str] = (),
    overlays: list[Path] = (),
    allow: set[str] = frozenset(),
    name: str | None = None,
    gpus: int = 1,
    launcher: str | None = None,
    launcher_args: list[str] = (),
    show_progress: bool | str = True,
    echo=None,
    run_dir: Path | None = None,
) -> TrainResult:
    """Check, train with axolotl, and write `adapter/` + `manifest.json` in a new run directory.

    Raises:
        UsageError / CheckFailed: bad config or dataset (nothing written).
        TrainError: axolotl exited non-zero or produced no adapter (the run directory keeps
            train.log; no adapter/manifest is written, so nothing downstream can pick it up).
    """
    echo = echo or log.info
    t0 = time.time()
    name = check_name(
        name or default_name(Path(config_path).stem),
        "adapter name (--name, default: from the config file name)",
    )
    tc = load_training_config(Path(config_path), list(overrides), list(overlays))
    ds_report = check_inputs(cfg, tc, set(allow), world=gpus)
    registry.check_store(cfg)  # an unusable store fails before the run directory exists
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    run_dir = Path(run_dir) if run_dir else cfg.train.runs_dir / f"{name}-{stamp}"
    if (run_dir / "adapter" / MANIFEST).exists():
        raise PipelineError(f"{run_dir} already holds a finished adapter; use another run directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = resolve(tc, run_dir, cfg)
    resume = latest_checkpoint(run_dir / "output")
    if resume is not None:
        # An interrupted run with the same inputs: axolotl/HF Trainer resume (optimizer, scheduler, RNG, step).
        resolved["resume_from_checkpoint"] = str(resume)
        echo(f"resuming from {resume}")
    resolved_yml = run_dir / "resolved.yml"
    resolved_tc = TrainingConfig(resolved_yml, resolved)
    resolved_yml.write_text(resolved_tc.dump())
    write_json_atomic(run_dir / "dataset_report.json", ds_report.to_dict())

    datasets = [
        {
            "name": Path(f.path).name,
            "path": str(Path(f.path).resolve()),
            "sha256": f.sha256,
            "role": "training" if f.role == "train" else "validation",
        }
        for f in ds_report.files
    ]
    params = {
        "axolotl": {
            k: v
            for k, v in resolved.items()
            if k not in ("plugins", "mlflow_tracking_uri", "resume_from_checkpoint")
        },
        "dataset_fingerprint": ds_report.fingerprint,
        "config_sha256": tc.sha256,
    }
    run_file = run_dir / "mlflow_run.json"
    run_id = json.loads(run_file.read_text())["run_id"] if resume is not None and run_file.exists() else None
    if run_id is None:
        run_id = registry.start_training_run(cfg, run_dir.name, params, datasets)
        write_json_atomic(run_file, {"run_id": run_id})
    else:
        registry.reopen_training_run(cfg, run_id)

    metrics_file = run_dir / "metrics.jsonl"
    cmd = launcher_command(resolved_yml, gpus, launcher, launcher_args)
    echo(f"run dir: {run_dir}\nmlflow run: {run_id}\nlaunching: {' '.join(cmd)}")
    env = train_env(
        {
            "PIPELINE_METRICS_FILE": str(metrics_file),
            "MLFLOW_RUN_ID": run_id,
            "MLFLOW_TRACKING_URI": cfg.tracking_uri,
        }
    )
    with open(run_dir / "train.log", "w") as train_log:
        # Under the guard with no grace: the trainer and any launcher workers (accelerate, torchrun)
        # are SIGKILLed when `pipeline` dies, so none keeps writing into the run directory.
        proc = subprocess.Popen(
            guarded(cmd, grace_s=0),
            stdout=train_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            _progress_loop(proc, metrics_file, progress_mode(show_progress))
        except BaseException:
            proc.terminate()
            proc.wait(30)
            registry.finish_training_run(cfg, run_id, {}, [run_dir / "train.log"], ok=False)
            raise
    summary = summarise(read_metrics(metrics_file), cfg.train.peak_tflops)
    out_dir = run_dir / "output"
    if proc.returncode != 0 or not all((out_dir / f).exists() for f in ADAPTER_FILES):
        registry.finish_training_run(cfg, run_id, summary, [run_dir / "train.log"], ok=False)
        tail = "\n".join((run_dir / "train.log").read_text(errors="replace").splitlines()[-25:])
        raise TrainError(f"axolotl failed (exit {proc.returncode}); log: {run_dir / 'train.log'}\n{tail}")

    adapter_dir = run_dir / "adapter"
    staging = run_dir / ".adapter.tmp"
    staging.mkdir()
    for f in ADAPTER_FILES + TOKENIZER_FILES:
        if (out_dir / f).exists():
            shutil.copy2(out_dir / f, staging / f)
    renamed = normalise_adapter_keys(staging / "adapter_model.safetensors")
    if renamed:
        echo(f"adapter: removed wrapper names ({', '.join(WRAPPER_SEGMENTS)}) from {renamed} tensor names")
    adapter_cfg = json.loads((staging / "adapter_config.json").read_text())
    base = str(tc.data.get("base_model"))
    manifest = {
        "schema": 1,
        "name": name,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "files": file_hashes(staging),
        "base_model": {
            "id": base,
            "revision": tc.data.get("base_model_revision"),
            "fingerprint": base_fingerprint(base),
        },
        "served": {
            "checkpoint": cfg.served.checkpoint,
            "revision": cfg.served.revision,
            "model": cfg.served.model,
        },
        "dataset": {
            "fingerprint": ds_report.fingerprint,
            "files": [
                {"path": f.path, "role": f.role, "sha256": f.sha256, "conversations": f.conversations}
                for f in ds_report.files
            ],
        },
        "config_sha256": tc.sha256,
        # the input fingerprint every registration tags (`run.fingerprint`): pipeline/artifacts/fingerprint.py
        "inputs": training_inputs(ds_report.fingerprint, tc.data),
        "resolved_config": str(resolved_yml),
        "adapter": {
            k: adapter_cfg.get(k)
            for k in (
                "r",
                "lora_alpha",
                "target_modules",
                "rank_pattern",
                "alpha_pattern",
                "use_rslora",
                "use_dora",
                "peft_type",
            )
        },
        "versions": package_versions(),
        "metrics": summary,
        "mlflow_run_id": run_id,
        "gpus": gpus,
    }
    write_json_atomic(staging / MANIFEST, manifest)
    os.replace(staging, adapter_dir)
    registry.finish_training_run(
        cfg, run_id, summary, [adapter_dir / MANIFEST, run_dir / "dataset_report.json"], ok=True
    )
    return TrainResult(run_dir, adapter_dir, manifest, run_id, time.time() - t0)
