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
from pipeline.artifacts.manifest import (
    MANIFEST,
    AdapterManifest,
    BaseModelRef,
    DatasetFile,
    DatasetRecord,
    KeptSplit,
    LoraSettings,
    ServedRef,
    StrategyRecord,
    TrainingInputs,
    TrainMetrics,
    file_hashes,
    package_versions,
    write_manifest,
)
from pipeline.artifacts.names import check_name, default_name
from pipeline.children import guarded
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, PipelineError, UsageError
from pipeline.interrupt import Interrupted, shielded
from pipeline.redact import copy_redacted
from pipeline.registry.database import engine_uri
from pipeline.train.config import TrainingConfig, check_training_config, load_training_config
from pipeline.train.data_gate import axolotl_view, dataset_gate, dataset_report
from pipeline.train.dataset import DatasetReport
from pipeline.train.datasets_scope import by_content
from pipeline.train.gate import KEPT_PARAMS, kept_metrics
from pipeline.train.metrics import read_metrics, summarise
from pipeline.train.passthrough import split_passthrough
from pipeline.train.preflight import Gpu, detect_gpus, logits_memory_problem, packing_problems
from pipeline.train.prepared import KEEP, prepared_dir, prune, write_prepared
from pipeline.train.progress import follow_progress, progress_interval, progress_mode
from pipeline.train.schema import check_axolotl_schema
from pipeline.train.strategy import Choice, apply_choice, choose
from pipeline.train.wrapped_keys import WRAPPER_SEGMENTS, normalise_adapter_keys
from pipeline.validate.report import FleetRules

log = logging.getLogger("pipeline.train")

# Files copied from axolotl's output_dir into the adapter directory.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


class TrainError(CheckFailed):
    """axolotl exited non-zero or left no adapter."""


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path | None  # None on a worker node (node rank > 0): node 0 writes the adapter
    manifest: AdapterManifest
    run_id: str | None
    seconds: float


@dataclass
class LaunchPlan:
    """How axolotl is started: its launcher and the arguments after `--`, processes, this node's rank,
    and the multi-process strategy (pipeline.train.strategy) when there is more than one process."""

    launcher: str
    launcher_args: list[str]
    gpus: int  # processes on this node
    world: int  # processes on all nodes
    node_rank: int
    choice: Choice | None


_NNODES = ("--nnodes", "--num_machines", "--num-machines")
_NODE_RANK = ("--node-rank", "--node_rank", "--machine_rank", "--machine-rank")


def _int_arg(args: list[str], names: tuple[str, ...], default: int) -> int:
    """The integer value of a launcher option (`--nnodes 2`, `--nnodes=2`, torchrun's `--nnodes 1:2`: the max)."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return max(int(v) for v in value.split(":"))
            except ValueError:
                raise UsageError(f"`-- {name} {value}`: expected a number") from None
    return default


def _value(args: list[str], option: str) -> str:
    name, eq, value = option.partition("=")
    return value if eq else (args[args.index(option) + 1] if args.index(option) + 1 < len(args) else "")


def training_setup(
    config_path: Path,
    overrides: list[str] = (),
    overlays: list[Path] = (),
    gpus: int = 1,
    launcher: str | None = None,
    launcher_args: list[str] = (),
    strategy: str = "auto",
    visible: list[Gpu] | None = None,
) -> tuple[TrainingConfig, LaunchPlan]:
    """The training config and launch plan of `pipeline train`/`pipeline run` options: arguments after
    `--` split into launcher options and axolotl config keys (pipeline.train.passthrough), then with
    several processes DDP or FSDP2 chosen and applied (pipeline.train.strategy). `visible`: the GPUs
    (default: nvidia-smi). Raises UsageError for a launcher/option mismatch."""
    launcher = launcher or ("python" if gpus <= 1 else "accelerate")
    if launcher == "python" and gpus > 1:
        raise UsageError(
            f"--launcher python runs one process: use --launcher accelerate or torchrun for --gpus {gpus}"
        )
    passed = split_passthrough(list(launcher_args), launcher)
    tc = load_training_config(Path(config_path), [*overrides, *passed.overrides], list(overlays))
    nnodes = _int_arg(passed.launcher_args, _NNODES, 1)
    world = gpus * nnodes
    dynamic = next(
        (a for a in passed.launcher_args if a.split("=")[0] in ("--rdzv-backend", "--rdzv_backend")), None
    )
    if nnodes > 1 and dynamic and _value(passed.launcher_args, dynamic) != "static":
        raise UsageError(
            "several nodes with a dynamic rendezvous (--rdzv-backend): torchrun then gives global rank 0, which "
            "writes the adapter, to any node; use the static one (--master-addr HOST --master-port PORT "
            "--node-rank K on each node) so that node 0 writes it"
        )
    choice = None
    if world > 1:
        choice = choose(tc, detect_gpus() if visible is None else visible, strategy)
        tc = TrainingConfig(tc.path, apply_choice(tc.data, choice), tc.origins)
    elif strategy != "auto":
        raise UsageError(
            f"--strategy {strategy}: only for several processes (--gpus N, or a multi-node launcher)"
        )
    plan = LaunchPlan(
        launcher, passed.launcher_args, gpus, world, _int_arg(passed.launcher_args, _NODE_RANK, 0), choice
    )
    return tc, plan


LOG_DRAIN_S = 10  # after the trainer exits, its output still in the pipe reaches train.log


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


def check_inputs(
    cfg: ProjectConfig, tc: TrainingConfig, allow: set[str], world: int = 1, gpus: list[Gpu] | None = None
) -> DatasetReport:
    """Config servability, axolotl's schema, GPU preflight (packing on Gated-DeltaNet models,
    logits memory), dataset checks, the run's keyed `dataset_prepared_path` (`prepared_dir`:
    created, writable) and the dataset gate (what axolotl keeps: the report's `kept`).
    Raises CheckFailed, or VolumeError for a `dataset_prepared_path` this user cannot write, before
    anything is written but that directory (the gate's datasets cache goes there).

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
    report = dataset_report(tc, allow)
    keyed = prepared_dir(tc.data, report.fingerprint, cfg.state_dir, cfg.root)
    report.kept = [sc.to_dict() for sc in dataset_gate(cfg, tc, allow, keyed, by_content(report.fingerprint))]
    return report


def resolve(tc: TrainingConfig, run_dir: Path, cfg: ProjectConfig, prepared: Path | None = None) -> dict:
    """The config axolotl will run: `axolotl_view` plus our output_dir and MLflow settings."""
    d = axolotl_view(tc, prepared)
    d["output_dir"] = str(run_dir / "output")
    d["use_mlflow"] = True
    # The tracking URI reaches the trainer through its environment ($MLFLOW_TRACKING_URI, which
    # axolotl and transformers' MLflowCallback read), never through resolved.yml: the file is
    # readable by other users and kept with the run, and a server's URI may carry a password.
    # One in the user's config would override the environment in axolotl, so it goes too.
    d.pop("mlflow_tracking_uri", None)
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


def prepare_datasets(cfg: ProjectConfig, tc: TrainingConfig, report: DatasetReport) -> Path:
    """The run's keyed `dataset_prepared_path` (`prepared_dir`), with axolotl's prepared datasets
    written there (pipeline.train.prepared) from `report`'s files (checked: as many rows as its
    gate counts, `report.kept`); when they cannot be written here (the base's tokenizer is not
    readable, a hub id not cached offline) the trainer prepares them itself, in the same keyed place.
    Raises VolumeError when that place cannot be written, CheckFailed when the rows differ."""
    keyed = prepared_dir(tc.data, report.fingerprint, cfg.state_dir, cfg.root)
    try:
        kept = {k["split"]: k["kept"] for k in report.kept}
        write_prepared(axolotl_view(tc, keyed), kept=kept, cache=by_content(report.fingerprint))
    except (OSError, ValueError) as e:
        log.warning("the trainer prepares the datasets itself (%s)", str(e).splitlines()[0] if str(e) else e)
    else:
        for gone in prune(keyed.parent, keyed):
            log.debug("removed the prepared datasets %s (older than the newest %d)", gone, KEEP)
    return keyed


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete `checkpoint-N` under axolotl's output_dir, or None.

    Complete = has `trainer_state.json` (the Trainer writes it after the weights and optimizer).
    """
    cands = []
    for p in Path(output_dir).glob("checkpoint-*"):
        if p.is_dir() and (p / "trainer_state.json").exists() and p.name.split("-")[-1].isdigit():
            cands.append((int(p.name.split("-")[-1]), p))
    return max(cands)[1] if cands else None


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
    strategy: str = "auto",
    show_progress: bool | str = True,
    run_dir: Path | None = None,
) -> TrainResult:
    """Check, train with axolotl, and write `adapter/` + `manifest.json` in a new run directory.

    `launcher_args`: the arguments after `--` (launcher options pass through, axolotl config keys
    become overrides); with several processes, `strategy` (auto|ddp|fsdp2) picks DDP or FSDP2. On a
    worker node (launcher node rank > 0) axolotl runs, and no MLflow run or adapter is written here:
    node 0 writes them.

    Raises:
        UsageError / CheckFailed: bad config or dataset (nothing written).
        TrainError: axolotl exited non-zero or produced no adapter (the run directory keeps
            train.log; no adapter/manifest is written, so nothing downstream can pick it up).
    """
    echo = log.info  # progress and stage messages: the `pipeline.train.launch` logger
    t0 = time.time()
    name = check_name(
        name or default_name(Path(config_path).stem),
        "adapter name (--name, default: from the config file name)",
        served=cfg.served_base_names,
    )
    tc, plan = training_setup(
        Path(config_path), list(overrides), list(overlays), gpus, launcher, list(launcher_args), strategy
    )
    if plan.choice:
        echo(
            f"{plan.world} processes: {plan.choice.strategy.upper()} ({plan.choice.reason}; --strategy overrides)"
        )
    progress_interval()  # a bad $PIPELINE_PROGRESS_INTERVAL fails now, not once the trainer runs
    ds_report = check_inputs(cfg, tc, set(allow), world=plan.world)
    worker = plan.node_rank > 0
    registry.check_store(cfg)  # an unusable store fails before the run directory exists
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    run_dir = Path(run_dir) if run_dir else cfg.train.runs_dir / f"{name}-{stamp}"
    if (run_dir / "adapter" / MANIFEST).exists():
        raise PipelineError(f"{run_dir} already holds a finished adapter; use another run directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    keyed = prepare_datasets(cfg, tc, ds_report)
    resolved = resolve(tc, run_dir, cfg, keyed)
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
        # what axolotl keeps of each split, counted before the model loads (pipeline.train.gate)
        "dataset_kept": {k["split"]: {n: k[n] for n in KEPT_PARAMS} for k in ds_report.kept},
    }
    run_file = run_dir / "mlflow_run.json"
    run_id = json.loads(run_file.read_text())["run_id"] if resume is not None and run_file.exists() else None
    if worker:
        pass  # node 0 holds the MLflow run
    elif run_id is None:
        run_id = registry.start_training_run(cfg, run_dir.name, params, datasets)
        write_json_atomic(run_file, {"run_id": run_id})
    else:
        registry.reopen_training_run(cfg, run_id)

    metrics_file = run_dir / "metrics.jsonl"
    cmd = launcher_command(resolved_yml, plan.gpus, plan.launcher, plan.launcher_args)
    echo(f"run dir: {run_dir}\nmlflow run: {run_id}\nlaunching: {' '.join(cmd)}")
    env = train_env(
        {
            "PIPELINE_METRICS_FILE": str(metrics_file),
            "MLFLOW_TRACKING_URI": engine_uri(cfg.tracking_uri),  # `postgresql://`: the shipped driver
            # the trainer's datasets cache is named by the data's bytes too: when it tokenizes (nothing
            # prepared here), the rows come from the files' bytes (pipeline.train.datasets_scope)
            "HF_DATASETS_CACHE": str(by_content(ds_report.fingerprint)),
        }
        | ({"MLFLOW_RUN_ID": run_id} if run_id else {})
    )
    with open(run_dir / "train.log", "w") as train_log:
        # Under the guard with no grace: the trainer and any launcher workers (accelerate, torchrun)
        # are SIGKILLed when `pipeline` dies, so none keeps writing into the run directory. Its output
        # reaches train.log redacted (pipeline.redact: MLflow prints the tracking URI, credentials too).
        proc = subprocess.Popen(
            guarded(cmd, grace_s=0),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        copier = copy_redacted(proc.stdout, train_log)
        try:
            follow_progress(proc, metrics_file, progress_mode(show_progress))
            copier.join(LOG_DRAIN_S)
        except BaseException as e:
            stopped = isinstance(e, Interrupted | KeyboardInterrupt)  # SIGTERM/SIGINT: KILLED, not FAILED
            with shielded():  # the clean-up itself is not cut by a second signal
                proc.terminate()  # the guard ends the trainer's process group (no grace: pipeline/children.py)
                proc.wait(30)
                copier.join(LOG_DRAIN_S)
                if run_id:
                    registry.finish_training_run(
                        cfg,
                        run_id,
                        {},
                        [run_dir / "train.log"],
                        ok=False,
                        status="KILLED" if stopped else None,
                    )
            if stopped:
                log.warning("training stopped; %s keeps its checkpoints: the next run resumes", run_dir)
            raise
    summary = summarise(read_metrics(metrics_file), cfg.train.peak_tflops)
    out_dir = run_dir / "output"
    if worker and proc.returncode == 0:
        echo(f"node {plan.node_rank}: training finished; node 0 writes the adapter and the MLflow run")
        worker_manifest = AdapterManifest(files={}, metrics=TrainMetrics(**summary), gpus=plan.world)
        return TrainResult(run_dir, None, worker_manifest, None, time.time() - t0)
    if proc.returncode != 0 or not all((out_dir / f).exists() for f in ADAPTER_FILES):
        if run_id:
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
    manifest = AdapterManifest(
        name=name,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        files=file_hashes(staging),
        base_model=BaseModelRef(
            id=base, revision=tc.data.get("base_model_revision"), fingerprint=base_fingerprint(base)
        ),
        served=ServedRef(
            checkpoint=cfg.served.checkpoint, revision=cfg.served.revision, model=cfg.served.model
        ),
        dataset=DatasetRecord(
            fingerprint=ds_report.fingerprint,
            files=[
                DatasetFile(path=f.path, role=f.role, sha256=f.sha256, conversations=f.conversations)
                for f in ds_report.files
            ],
            # what axolotl kept per split (pipeline.train.gate): conversations, tokens, trainable tokens
            kept=[KeptSplit(**k) for k in ds_report.kept],
        ),
        config_sha256=tc.sha256,
        # the input fingerprint every registration tags (`run.fingerprint`): pipeline/artifacts/fingerprint.py
        inputs=TrainingInputs(**training_inputs(ds_report.fingerprint, tc.data)),
        resolved_config=str(resolved_yml),
        adapter=LoraSettings(**{k: adapter_cfg.get(k) for k in (*LoraSettings.KEYS, "peft_type")}),
        versions=package_versions(),
        metrics=TrainMetrics(**summary),
        mlflow_run_id=run_id,
        gpus=plan.world,
        # DDP or FSDP2 and why (pipeline.train.strategy); None for one process
        strategy=StrategyRecord(**plan.choice.to_dict()) if plan.choice else None,
    )
    write_manifest(staging, manifest)
    os.replace(staging, adapter_dir)
    registry.finish_training_run(
        cfg,
        run_id,
        {**summary, **kept_metrics(ds_report.kept)},
        [adapter_dir / MANIFEST, run_dir / "dataset_report.json"],
        ok=True,
    )
    return TrainResult(run_dir, adapter_dir, manifest, run_id, time.time() - t0)
