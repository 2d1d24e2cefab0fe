"""Training runs: parameters, dataset inputs (with digests), summary metrics and artifacts of `pipeline train`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pipeline.config import ProjectConfig
from pipeline.figures import figure
from pipeline.registry.presentation import NOTE_TAG, RUN_HEADLINES, file_experiment, with_headline
from pipeline.registry.store import ensure_experiment, flatten_params, mlflow_for

SUMMARY_PREFIX = "summary."


# -- training runs --------------------------------------------------------------------------
def start_training_run(cfg: ProjectConfig, run_name: str, params: dict, datasets: list[dict]) -> str:
    """Create the MLflow run for one training; returns its run id.


    `datasets`: [{"name", "path", "sha256", "role"}]; each becomes a run input with its digest.
    """
    mlflow = mlflow_for(cfg)
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    client = mlflow.MlflowClient()
    experiment = ensure_experiment(cfg, mlflow)
    file_experiment(client, experiment)
    note = with_headline(_facts(params, datasets), "TRAINING (axolotl)", RUN_HEADLINES)
    run = client.create_run(experiment, run_name=run_name, tags={NOTE_TAG: note, "pipeline.stage": "train"})
    rid = run.info.run_id
    flat = flatten_params(params)
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in sorted(flat.items())]
    for i in range(0, len(items), 100):
        client.log_batch(rid, params=items[i : i + 100])
    with mlflow.start_run(run_id=rid):
        for d in datasets:
            ds = MetaDataset(
                source=LocalArtifactDatasetSource(str(d["path"])), name=d["name"], digest=d["sha256"][:36]
            )
            mlflow.log_input(ds, context=d["role"])
    return rid


def _facts(params: dict, datasets: list[dict]) -> str:
    """The run description's facts paragraph: what was trained on what (from the run's own params)."""
    ax = params.get("axolotl") or {}
    files = ", ".join(f"{d['name']} ({d['role']})" for d in datasets) or "none"
    return (
        f"LoRA r={ax.get('lora_r')} alpha={ax.get('lora_alpha')} on {ax.get('base_model')}; datasets {files}, "
        f"fingerprint {str(params.get('dataset_fingerprint') or '')[:16]}; config sha256 "
        f"{str(params.get('config_sha256') or '')[:16]}. Charts: per-step `loss`, `eval_loss`, `learning_rate`, "
        f"`grad_norm` from the trainer; the run's figures as `{SUMMARY_PREFIX}*` (one value each)."
    )


def _outcome(metrics: dict, status: str) -> str:
    if status == "KILLED":
        return "KILLED: stopped by a signal; the next run with these inputs resumes from its last checkpoint"
    if status == "FAILED":
        return "FAILED: the trainer exited with an error or wrote no adapter (see train.log in the artifacts)"
    loss = ", ".join(f"{k} {figure(metrics[k])}" for k in ("train_loss", "eval_loss") if k in metrics)
    return f"TRAINED in {metrics.get('steps', '?')} steps" + (f": {loss}" if loss else "")


def summary_key(key: str) -> str:
    """The name a summary figure of `summarise` is logged under: `summary.<key>`, so that it is not
    a point of the trainer's per-step curve of the same name (`eval_loss` at step 0 drew a vertical
    segment, a final `train_loss` at step 0 made the loss look as if it rose). Dataset counts
    (`dataset.*`) are their own names already."""
    return key if key.startswith("dataset.") else SUMMARY_PREFIX + key


def finish_training_run(
    cfg: ProjectConfig,
    run_id: str,
    metrics: dict,
    artifacts: list[Path],
    ok: bool,
    status: Literal["FINISHED", "FAILED", "KILLED"] | None = None,
) -> None:
    """Log train's summary (losses, `tokens_per_s`, `mfu`, runtime) and artifacts; end the run.


    `metrics` is `pipeline.train.metrics.summarise` output, logged as `summary.<key>` at the last step
    (`summary_key`); the run's description says how it ended (`TRAINED ...`, `FAILED`, `KILLED`). Losses are plain numbers, `tokens_per_s` is
    tokens per second of training wall time, `mfu` a fraction (0-1). `mfu` exists only when the
    accelerator's peak is known (`train.peak_tflops` or a GPU in `train.PEAK_TFLOPS`); without it
    the run gets the tag `mfu.unavailable` saying why, so the UI does not just lack a number.
    Per-step metrics (loss, eval_loss, learning_rate, grad_norm, tokens/train_per_sec_per_gpu)
    are logged by axolotl's own MLflow integration into the same run (MLFLOW_RUN_ID).
    `status`: the run's end state (MLflow's RunStatus names); default FINISHED when `ok`, else
    FAILED; KILLED for a training stopped by a signal.
    """
    mlflow = mlflow_for(cfg)
    client = mlflow.MlflowClient()
    step = int(metrics.get("steps") or 0)  # the figures are the run's at its end
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            client.log_metric(run_id, summary_key(k), float(v), step=step)
    end = status or ("FINISHED" if ok else "FAILED")
    note = client.get_run(run_id).data.tags.get(NOTE_TAG)
    client.set_tag(run_id, NOTE_TAG, with_headline(note, _outcome(metrics, end), RUN_HEADLINES))
    if ok and "mfu" not in metrics:
        client.set_tag(
            run_id, "mfu.unavailable", "no accelerator peak known: set train.peak_tflops (TFLOP/s per device)"
        )
    for a in artifacts:
        if Path(a).exists():
            client.log_artifact(run_id, str(a))
    client.set_terminated(run_id, end)


def reopen_training_run(cfg: ProjectConfig, run_id: str) -> None:
    """Mark an interrupted training run RUNNING again before it resumes (same run, continued metrics)."""
    client = mlflow_for(cfg).MlflowClient()
    client.update_run(run_id, status="RUNNING")
    note = client.get_run(run_id).data.tags.get(NOTE_TAG)
    client.set_tag(run_id, NOTE_TAG, with_headline(note, "TRAINING (axolotl, resumed)", RUN_HEADLINES))
