"""MLflow: training runs, the adapter as a LoggedModel, model versions and aliases.

Embedded default: sqlite at `<state_dir>/mlflow.db`, artifacts under `<state_dir>/mlartifacts`;
`MLFLOW_TRACKING_URI` or `registry.tracking_uri` select a server or PostgreSQL instead.
Concurrent first-time schema creation corrupts sqlite (../shared/design/mlflow.md), so the
store is initialised once under a file lock before anything else touches it.

mlflow is imported inside functions: `pipeline --help` must not pay ~2 s for it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ProjectConfig
from pipeline.errors import UsageError

ALIAS_CANDIDATE = "candidate"
ALIAS_PRODUCTION = "production"
ALIAS_PREVIOUS = "previous"
MODEL_TYPE = "peft-lora"


class RegistryError(UsageError):
    """An adapter directory cannot be registered (no manifest, files differ from it)."""


def _mlflow(cfg: ProjectConfig):
    """Import mlflow pointed at the project's store, initialised once under a lock."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from filelock import FileLock

    uri = cfg.tracking_uri
    # mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI, which `ProjectConfig.tracking_uri`
    # prefers over the config file: the next config in this process (or any child, e.g. a test's
    # `pipeline register`) would silently use this store. Keep the environment as it was.
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
    if cfg.registry.registry_uri:
        mlflow.set_registry_uri(cfg.registry.registry_uri)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    marker = cfg.state_dir / f".mlflow-init-{_uri_key(uri)}"
    if not marker.exists():
        with FileLock(str(cfg.state_dir / "mlflow-init.lock"), timeout=300):
            if not marker.exists():
                _experiment_id(cfg, mlflow)  # creates the schema and the experiment
                marker.write_text(uri + "\n")
    return mlflow


def _uri_key(uri: str) -> str:
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def _experiment_id(cfg: ProjectConfig, mlflow) -> str:
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(cfg.registry.experiment)
    if exp is not None:
        return exp.experiment_id
    location = artifact_location(cfg)
    if location and location.startswith("file:"):
        cfg.artifact_root.mkdir(parents=True, exist_ok=True)
    try:
        return client.create_experiment(cfg.registry.experiment, artifact_location=location)
    except Exception:  # created concurrently
        return client.get_experiment_by_name(cfg.registry.experiment).experiment_id


def is_server_uri(uri: str) -> bool:
    """True for a tracking server (http[s]://, databricks): it chooses artifact locations itself."""
    return uri.startswith(("http://", "https://", "databricks"))


def artifact_location(cfg: ProjectConfig) -> str | None:
    """Where the experiment keeps artifacts when this process talks to the database directly.

    `registry.artifact_location` (e.g. `s3://bucket/prefix`, credentials and
    `MLFLOW_S3_ENDPOINT_URL` from the environment), else `<state_dir>/mlartifacts` for a
    database URI (sqlite, postgresql, mysql), else None: a server decides.
    """
    if cfg.registry.artifact_location:
        return cfg.registry.artifact_location
    if is_server_uri(cfg.tracking_uri):
        return None
    return cfg.artifact_root.as_uri()


def experiment_id(cfg: ProjectConfig) -> str:
    return _experiment_id(cfg, _mlflow(cfg))


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            s = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
            out[key] = s[:6000]
    return out


# -- training runs --------------------------------------------------------------------------
def start_training_run(cfg: ProjectConfig, run_name: str, params: dict, datasets: list[dict]) -> str:
    """Create the MLflow run for one training; returns its run id.

    `datasets`: [{"name", "path", "sha256", "role"}]; each becomes a run input with its digest.
    """
    mlflow = _mlflow(cfg)
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    client = mlflow.MlflowClient()
    run = client.create_run(_experiment_id(cfg, mlflow), run_name=run_name, tags={"pipeline.stage": "train"})
    rid = run.info.run_id
    flat = _flatten(params)
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
    cfg: ProjectConfig, run_id: str, metrics: dict, artifacts: list[Path], ok: bool
) -> None:
    """Log train's summary (losses, `tokens_per_s`, `mfu`, runtime) and artifacts; end the run.

    `metrics` is `pipeline.train.launch.summarise` output: losses are plain numbers, `tokens_per_s` is
    tokens per second of training wall time, `mfu` a fraction (0-1). `mfu` exists only when the
    accelerator's peak is known (`train.peak_tflops` or a GPU in `train.PEAK_TFLOPS`); without it
    the run gets the tag `mfu.unavailable` saying why, so the UI does not just lack a number.
    Per-step metrics (loss, eval_loss, learning_rate, grad_norm, tokens/train_per_sec_per_gpu)
    are logged by axolotl's own MLflow integration into the same run (MLFLOW_RUN_ID).
    """
    mlflow = _mlflow(cfg)
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
    client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


# -- model versions -------------------------------------------------------------------------
@dataclass
class Registered:
    name: str
    version: int
    model_id: str
    run_id: str | None
    source: str


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _describe(manifest: dict, report: dict) -> str:
    """The version's description: one paragraph a reviewer reads on the version page."""
    base = manifest.get("base_model", {})
    served = manifest.get("served", {})
    m = manifest.get("metrics", {})
    weights = manifest.get("files", {}).get("adapter_model.safetensors", "")
    tps = m.get("tokens_per_s")
    return (
        f"LoRA r={manifest.get('adapter', {}).get('r')} alpha={manifest.get('adapter', {}).get('lora_alpha')} "
        f"on base {base.get('id')} @ {base.get('revision') or 'sha256:' + str(base.get('fingerprint') or '')[:12]}; "
        f"served on {served.get('checkpoint')} @ {served.get('revision') or 'unpinned'}; "
        f"dataset {str(manifest.get('dataset', {}).get('fingerprint', ''))[:16]}; "
        f"eval_loss {_num(m.get('eval_loss'))}, train_loss {_num(m.get('train_loss'))}"
        + (f", {tps:.0f} tokens/s" if isinstance(tps, (int, float)) else "")
        + f"; weights sha256 {weights[:16]}; validation {report.get('verdict', 'unknown')}."
    )[:4900]


def version_tags(cfg: ProjectConfig, manifest: dict, report: dict, run_id: str | None) -> dict[str, str]:
    """Tags every version carries: the description's facts, machine-searchable.

    e.g. `client.search_model_versions("tags.`validation.verdict` = 'pass'")`.
    """
    base = manifest.get("base_model", {})
    m = manifest.get("metrics") or {}
    tags = {
        "base_model": str(base.get("id")),
        "base_revision": str(base.get("revision") or ""),
        "base_fingerprint": str(base.get("fingerprint") or ""),
        "served_checkpoint": cfg.served.checkpoint,
        "served_revision": str(cfg.served.revision or ""),
        "served_model": cfg.served.model,
        "dataset_fingerprint": str(manifest.get("dataset", {}).get("fingerprint", "")),
        "weights_sha256": manifest.get("files", {}).get("adapter_model.safetensors", ""),
        "validation.verdict": report.get("verdict", "unknown"),
        "validation.weights_sha256": str(report.get("weights_sha256")),
        "lora_r": str(manifest.get("adapter", {}).get("r")),
        "lora_alpha": str(manifest.get("adapter", {}).get("lora_alpha")),
        "config_sha256": str(manifest.get("config_sha256") or ""),
        "source_run_id": run_id or "",
    }
    for k in ("eval_loss", "train_loss", "tokens_per_s", "mfu"):
        if isinstance(m.get(k), (int, float)):
            tags[k] = _num(m[k])
    return tags


def _register_with_retry(mlflow, model_uri: str, name: str, tags: dict, attempts: int = 8):
    """`mlflow.register_model`, retried on version-number conflicts.

    MLflow's SQL store computes `max(version) + 1` and retries an IntegrityError only 3 times;
    with several registering processes on PostgreSQL all 3 can lose (sqlite serialises writers
    instead). A conflict means another version was created, so retrying is safe.
    """
    import random
    import time

    from mlflow.exceptions import MlflowException

    for i in range(attempts):
        try:
            return mlflow.register_model(model_uri, name, tags=tags)
        except MlflowException as e:
            transient = "Model Version creation error" in str(e) or "database is locked" in str(e)
            if not transient or i == attempts - 1:
                raise
            time.sleep(random.uniform(0.05, 0.3) * (i + 1))


def register_adapter(cfg: ProjectConfig, adapter_dir: Path, name: str, report: dict) -> Registered:
    """Record `adapter_dir` as a LoggedModel, register it as a version of `name`, alias `candidate`.

    The artifact is exactly the adapter directory (config, safetensors, tokenizer, manifest):
    never base weights. `report` is the validation report dict (verdict, weights_sha256).
    Lineage: dataset (run input, digest) -> run (`manifest.mlflow_run_id`, when it is in this
    store) -> LoggedModel (`source_run_id`) -> model version (`run_id`, source `models:/<id>`).
    The validation report also goes to the run as `validation/<name>/v<N>.json`.
    Safe to call from several processes at once (versions stay contiguous).

    Raises:
        RegistryError: the directory has no manifest.json (train it with `pipeline train`).
    """
    from pipeline.artifacts.manifest import read_manifest, verify_files

    adapter_dir = Path(adapter_dir)
    try:
        manifest = read_manifest(adapter_dir)
    except FileNotFoundError as e:
        raise RegistryError(
            f"{adapter_dir}: no manifest.json; adapters are registered from `pipeline train` output"
        ) from e
    # The lineage on the version is the manifest's: refuse files that are not what it describes.
    problems = verify_files(adapter_dir, manifest.get("files", {}))
    if problems:
        raise RegistryError(
            f"{adapter_dir}: files differ from manifest.json (edited after training?); nothing registered:\n  "
            + "\n  ".join(problems)
        )
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    run_id = manifest.get("mlflow_run_id")
    if run_id:
        try:
            client.get_run(run_id)
        except Exception:
            run_id = None  # trained against another store
    tags = version_tags(cfg, manifest, report, run_id)
    params = _flatten({k: v for k, v in manifest.get("adapter", {}).items()})
    model = mlflow.initialize_logged_model(
        name=name,
        source_run_id=run_id,
        tags=tags,
        params=params,
        model_type=MODEL_TYPE,
        experiment_id=_experiment_id(cfg, mlflow),
    )
    try:
        client.log_model_artifacts(model.model_id, str(adapter_dir))
        if run_id:  # model metrics live in a run; link eval/train loss to their dataset
            files = manifest.get("dataset", {}).get("files") or []
            by_role = {f.get("role"): f for f in files}
            for k, v in (manifest.get("metrics") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    ds = (
                        by_role.get("validation" if k.startswith("eval") else "train")
                        if "loss" in k
                        else None
                    )
                    client.log_metric(
                        run_id,
                        k,
                        float(v),
                        model_id=model.model_id,
                        dataset_name=Path(ds["path"]).name if ds else None,
                        dataset_digest=ds["sha256"][:36] if ds else None,
                    )
        mlflow.finalize_logged_model(model.model_id, "READY")
    except BaseException:
        mlflow.finalize_logged_model(model.model_id, "FAILED")
        raise
    mv = _register_with_retry(mlflow, f"models:/{model.model_id}", name, tags)
    client.update_model_version(name, mv.version, description=_describe(manifest, report))
    client.set_model_version_tag(name, mv.version, "validation.report", json.dumps(_compact(report))[:4900])
    if run_id:
        with tempfile.TemporaryDirectory() as td:
            rp = Path(td) / f"v{mv.version}.json"
            rp.write_text(json.dumps(report, indent=2))
            client.log_artifact(run_id, str(rp), artifact_path=f"validation/{name}")
    client.set_registered_model_alias(name, ALIAS_CANDIDATE, mv.version)
    return Registered(name, int(mv.version), model.model_id, run_id, mv.source)


def _compact(report: dict) -> dict:
    return {
        "verdict": report.get("verdict"),
        "weights_sha256": report.get("weights_sha256"),
        "errors": [c["id"] for c in report.get("checks", []) if c.get("severity") == "error"],
        "warnings": [c["id"] for c in report.get("checks", []) if c.get("severity") == "warning"],
    }


def resolve_version(cfg: ProjectConfig, name: str, version: int | None = None, alias: str | None = None):
    """The ModelVersion for `name` at `version` or `alias`.

    Raises UsageError naming what exists when the model, version or alias does not.
    """
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    from mlflow.exceptions import MlflowException

    if (version is None) == (alias is None):
        raise UsageError("give exactly one of --version N or --alias A")
    try:
        client.get_registered_model(name)
    except MlflowException as e:
        raise UsageError(f"registered model {name!r} not found in {cfg.tracking_uri}") from e
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
        aliases = client.get_registered_model(name).aliases
        what = f"alias {alias!r}" if alias is not None else f"version {version}"
        raise UsageError(f"{name}: {what} not found (versions {versions}, aliases {aliases})") from e


def download_version(cfg: ProjectConfig, mv, dst: Path) -> Path:
    """Download a version's artifact (the adapter directory) into `dst`; returns the directory."""
    mlflow = _mlflow(cfg)
    path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst))
    return Path(path)


def alias_version(cfg: ProjectConfig, name: str, alias: str) -> int | None:
    """The version `alias` points at, or None (no such alias; the model must exist)."""
    from mlflow.exceptions import MlflowException

    client = _mlflow(cfg).MlflowClient()
    try:
        return int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(cfg: ProjectConfig, name: str, alias: str, version: int) -> int | None:
    """Point `alias` at `version`; returns the version it pointed at before (or None)."""
    prev = alias_version(cfg, name, alias)
    _mlflow(cfg).MlflowClient().set_registered_model_alias(name, alias, str(version))
    return prev


def set_version_tags(cfg: ProjectConfig, name: str, version: int, tags: dict[str, str]) -> None:
    client = _mlflow(cfg).MlflowClient()
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))


# -- events: publish, rollout, rollback ------------------------------------------------------------
EVENT_TAG_PREFIX = "event."
# Summary-tag prefix per event type; other types use their own name (`rollout.instances`, ...).
_SUMMARY_PREFIX = {"publish": "published"}
_SUMMARY_FIELDS = ("time", "path", "instances", "from_version", "to_version")


def record_event(cfg: ProjectConfig, name: str, version: int, event: dict) -> dict:
    """Record what happened to version `version` of `name` (publish, rollout, rollback...).

    `event`: a JSON-able dict with `type` (lower-case word: `publish`, `rollout`, `rollback`,
    `rolled_back`, ...) and any facts, by convention `instances` (names of the fleet instances
    that confirmed, list of str), `path` (the published directory), `from_version` /
    `to_version` (ints). `time` (UTC ISO-8601) is added when absent.

    Stored as model-version tags, so the version page shows them and `search_model_versions`
    can filter on them:
      - `event.<UTC yyyymmddThhmmss.ffffff>Z.<type>`: the whole event as JSON, one tag per event
        (unique key: concurrent callers never overwrite each other; keys sort by time);
      - `<type>.<field>` for time/path/instances/from_version/to_version (latest of that type;
        type `publish` uses `published.`, matching `pipeline.release.publish`). Lists are joined with ",".

    Returns the stored event. Raises UsageError: no `type`, or the version does not exist.
    """
    import datetime as dt
    import re

    from mlflow.exceptions import MlflowException

    etype = str(event.get("type") or "")
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", etype):
        raise UsageError(f"record_event: event needs a 'type' like 'publish' or 'rollout' (got {etype!r})")
    now = dt.datetime.now(dt.UTC)
    stored = {"time": now.isoformat(timespec="seconds"), **event}
    client = _mlflow(cfg).MlflowClient()
    try:
        client.get_model_version(name, str(version))
    except MlflowException as e:
        raise UsageError(f"record_event: {name} version {version} not found in {cfg.tracking_uri}") from e
    stamp = now.strftime("%Y%m%dT%H%M%S.%f")
    tags = {f"{EVENT_TAG_PREFIX}{stamp}Z.{etype}": json.dumps(stored, sort_keys=True, default=str)}
    prefix = _SUMMARY_PREFIX.get(etype, etype)
    for f in _SUMMARY_FIELDS:
        if f in stored:
            v = stored[f]
            tags[f"{prefix}.{f}"] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
    set_version_tags(cfg, name, version, tags)
    return stored


def events(mv) -> list[dict]:
    """The events recorded on a ModelVersion, oldest first."""
    out = []
    for k in sorted(mv.tags or {}):
        if k.startswith(EVENT_TAG_PREFIX):
            try:
                out.append(json.loads(mv.tags[k]))
            except json.JSONDecodeError:
                out.append({"type": k.rsplit(".", 1)[-1], "raw": mv.tags[k]})
    return out


def rollback_aliases(
    cfg: ProjectConfig, name: str, to_version: int | None = None, **facts
) -> tuple[int, int]:
    """Move `production` back to `to_version` (default: the `previous` alias); record the events.

    Only the registry: the volume directory must already exist and the fleet is switched by the
    caller (`pipeline rollback`, pipeline/fleet/rollout.py). `previous` then points at the
    version rolled back from, so `previous` is always "what production replaced". Events:
    `rollback` on the target (`from_version`, plus `facts`, e.g. `instances=[...]` that
    confirmed) and `rolled_back` on the version it replaced (`to_version`).

    Returns (from_version, to_version). Raises UsageError: unknown model, no production
    version, no target, or the target is already production.
    """
    if not _model_exists(cfg, name):
        raise UsageError(f"registered model {name!r} not found in {cfg.tracking_uri}")
    current = alias_version(cfg, name, ALIAS_PRODUCTION)
    if current is None:
        raise UsageError(f"{name}: no version has alias {ALIAS_PRODUCTION!r}; nothing to roll back")
    target = to_version if to_version is not None else alias_version(cfg, name, ALIAS_PREVIOUS)
    if target is None:
        raise UsageError(f"{name}: no {ALIAS_PREVIOUS!r} alias; give the version to roll back to")
    target = int(target)
    if target == current:
        raise UsageError(f"{name}: version {target} is already {ALIAS_PRODUCTION!r}")
    resolve_version(cfg, name, version=target)  # UsageError naming the versions that exist
    set_alias(cfg, name, ALIAS_PRODUCTION, target)
    set_alias(cfg, name, ALIAS_PREVIOUS, current)
    record_event(cfg, name, target, {**facts, "type": "rollback", "from_version": current})
    record_event(cfg, name, current, {"type": "rolled_back", "to_version": target})
    return current, target


def _model_exists(cfg: ProjectConfig, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        _mlflow(cfg).MlflowClient().get_registered_model(name)
        return True
    except MlflowException:
        return False


# -- reading the registry ---------------------------------------------------------------------------
def model_names(cfg: ProjectConfig) -> list[str]:
    """Names of all registered models, sorted."""
    client = _mlflow(cfg).MlflowClient()
    return sorted(m.name for m in client.search_registered_models(max_results=1000))


def versions(cfg: ProjectConfig, name: str) -> list:
    """All ModelVersions of `name`, newest first (aliases filled in). UsageError if unknown."""
    if not _model_exists(cfg, name):
        raise UsageError(
            f"registered model {name!r} not found in {cfg.tracking_uri} (have: {model_names(cfg)})"
        )
    client = _mlflow(cfg).MlflowClient()
    out = client.search_model_versions(f"name='{name}'", max_results=10000)
    return sorted(out, key=lambda v: -int(v.version))


def aliases(cfg: ProjectConfig, name: str) -> dict[str, int]:
    """{alias: version} of registered model `name`."""
    rm = _mlflow(cfg).MlflowClient().get_registered_model(name)
    return {a: int(v) for a, v in (rm.aliases or {}).items()}


def reopen_training_run(cfg: ProjectConfig, run_id: str) -> None:
    """Mark an interrupted training run RUNNING again before it resumes (same run, continued metrics)."""
    client = _mlflow(cfg).MlflowClient()
    client.update_run(run_id, status="RUNNING")
