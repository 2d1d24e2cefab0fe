"""Training runs: parameters, dataset inputs (with digests), summary metrics and artifacts of `pipeline train`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pipeline.config import ProjectConfig
from pipeline.registry.store import ensure_experiment, flatten_params, mlflow_for


# -- training runs --------------------------------------------------------------------------
def start_training_run(cfg: ProjectConfig, run_name: str, params: dict, datasets: list[dict]) -> str:
    """Create the MLflow run for one training; returns its run id.


    `datasets`: [{"name", "path", "sha256", "role"}]; each becomes a run input with its digest.
    """
    mlflow = mlflow_for(cfg)
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    client = mlflow.MlflowClient()
    run = client.create_run(
        ensure_experiment(cfg, mlflow), run_name=run_name, tags={"pipeline.stage": "train"}
    )
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


def finish_training_run(
    cfg: ProjectConfig,
    run_id: str,
    metrics: dict,
    artifacts: list[Path],
    ok: bool,
    status: Literal["FINISHED", "FAILED", "KILLED"] | None = None,
) -> None:
    """Log train's summary (losses, `tokens_per_s`, `mfu`, runtime) and artifacts; end the run.


    `metrics` is `pipeline.train.metrics.summarise` output: losses are plain numbers, `tokens_per_s` is
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
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            client.log_metric(run_id, k, float(v))
    if ok and "mfu" not in metrics:
        client.set_tag(
            run_id, "mfu.unavailable", "no accelerator peak known: set train.peak_tflops (TFLOP/s per device)"
        )
    for a in artifacts:
        if Path(a).exists():
            client.log_artifact(run_id, str(a))
    client.set_terminated(run_id, status or ("FINISHED" if ok else "FAILED"))


def reopen_training_run(cfg: ProjectConfig, run_id: str) -> None:
    """Mark an interrupted training run RUNNING again before it resumes (same run, continued metrics)."""
    client = mlflow_for(cfg).MlflowClient()
    client.update_run(run_id, status="RUNNING")
