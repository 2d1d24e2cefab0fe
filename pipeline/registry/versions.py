"""Registered versions: an adapter as a LoggedModel + model version, its tags, aliases, lookups."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.adapter_files import copy_adapter
from pipeline.artifacts.fingerprint import manifest_fingerprint
from pipeline.artifacts.manifest import AdapterManifest, read_adapter_manifest, verify_files
from pipeline.artifacts.names import check_name
from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.interrupt import shielded
from pipeline.registry.presentation import file_experiment
from pipeline.registry.presentation import refresh as refresh_ui
from pipeline.registry.speed import acceptance_tags, with_speed_line
from pipeline.registry.store import ensure_experiment, flatten_params, mlflow_for
from pipeline.registry.tags import (  # noqa: F401 - the registry's names, also as registry.versions.X
    ALIAS_CANDIDATE,
    ALIAS_PREVIOUS,
    ALIAS_PRODUCTION,
    EVAL_SET_TAG,
    FINGERPRINT_TAG,
    GATE_REASON_TAG,
    GATE_VERDICT_TAG,
    METRIC_TAGS,
    GateVerdict,
)

MODEL_TYPE = "peft-lora"


class RegistryError(UsageError):
    """An adapter directory cannot be registered (no manifest, files differ from it)."""


# -- model versions -------------------------------------------------------------------------
@dataclass
class Registered:
    name: str
    version: int
    model_id: str
    run_id: str | None
    source: str


def _num(v) -> str:
    """A number for people (the description): 4 significant digits."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def exact(v: float | int) -> str:
    """A metric as a tag: `repr` of the float, which reads back as the same float (no rounding)."""
    return repr(float(v)) if isinstance(v, float) else str(v)


def eval_set_digest(manifest: AdapterManifest) -> str:
    """sha256 over the sorted sha256s of the manifest's validation files; "" when it names none."""
    import hashlib

    shas = sorted(str(f.sha256) for f in manifest.dataset.files if f.role == "validation")
    return hashlib.sha256("\n".join(shas).encode()).hexdigest() if shas else ""


def _describe(manifest: AdapterManifest, report: dict) -> str:
    """The version's description: one paragraph a reviewer reads on the version page."""
    base, served, m = manifest.base_model, manifest.served, manifest.metrics
    text = (
        f"LoRA r={manifest.adapter.r} alpha={manifest.adapter.lora_alpha} "
        f"on base {base.id} @ {base.revision or 'sha256:' + (base.fingerprint or '')[:12]}; "
        f"served on {served.checkpoint} @ {served.revision or 'unpinned'}; "
        f"dataset {(manifest.dataset.fingerprint or '')[:16]}; "
        f"eval_loss {_num(m.eval_loss)}, train_loss {_num(m.train_loss)}"
        + (f", {m.tokens_per_s:.0f} tokens/s" if m.tokens_per_s is not None else "")
        + f"; weights sha256 {manifest.weights_sha256[:16]}; validation {report.get('verdict', 'unknown')}."
    )[:4900]
    # the predicted MTP acceptance when validation measured it (`--behaviour`, `pipeline run`): its own line
    return with_speed_line(text, acceptance_tags((report.get("stats") or {}).get("acceptance")))


def version_tags(
    cfg: ProjectConfig, manifest: AdapterManifest, report: dict, run_id: str | None
) -> dict[str, str]:
    """Tags every version carries: the description's facts, machine-searchable.

    e.g. `client.search_model_versions("tags.`validation.verdict` = 'pass'")`. In the order an
    operator reads them: the MLflow UI lists a version's tags in the order they were set, and its
    versions table shows only the first few (the verdict and the loss, then the lineage).
    """
    base, m = manifest.base_model, manifest.metrics
    figures = m.figures()
    tags = {"validation.verdict": report.get("verdict", "unknown")}
    for k in METRIC_TAGS:
        if isinstance(figures.get(k), (int, float)) and not isinstance(figures.get(k), bool):
            tags[k] = exact(figures[k])
    tags |= {
        "base_model": str(base.id),
        "base_revision": base.revision or "",
        "base_fingerprint": base.fingerprint or "",
        "served_checkpoint": cfg.served.checkpoint,
        "served_revision": str(cfg.served.revision or ""),
        "served_model": cfg.served.model,
        "dataset_fingerprint": manifest.dataset.fingerprint or "",
        "weights_sha256": manifest.weights_sha256,
        "validation.weights_sha256": str(report.get("weights_sha256")),
        "lora_r": str(manifest.adapter.r),
        "lora_alpha": str(manifest.adapter.lora_alpha),
        "config_sha256": manifest.config_sha256 or "",
        "source_run_id": run_id or "",
    }
    fp = manifest_fingerprint(manifest)
    if fp:
        tags[FINGERPRINT_TAG] = fp
    if eval_set_digest(manifest):
        tags[EVAL_SET_TAG] = eval_set_digest(manifest)
    # the predicted MTP acceptance (pipeline.registry.speed) when validation measured it
    tags |= acceptance_tags((report.get("stats") or {}).get("acceptance"))
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


    The artifact is exactly the adapter directory (config, safetensors, tokenizer, manifest), as
    copied by `pipeline.artifacts.adapter_files.copy_adapter`: never base weights. `report` is the
    validation report dict (verdict, weights_sha256).
    Lineage: dataset (run input, digest) -> run (`manifest.mlflow_run_id`, when it is in this
    store) -> LoggedModel (`source_run_id`) -> model version (`run_id`, source `models:/<id>`).
    The validation report also goes to the run as `validation/<name>/v<N>.json`.
    Safe to call from several processes at once (versions stay contiguous).


    Raises:
        RegistryError: the directory has no manifest.json (train it with `pipeline train`), or its
            files differ from it.
        UnsafeAdapterError: the directory holds something an adapter does not, a hard link, a file
            of another user or a secret one (`pipeline.artifacts.adapter_files`); nothing is written.
    """

    check_name(name, served=cfg.served_base_names)  # the grammar, the base's names (exit 2) before any work
    adapter_dir = Path(adapter_dir)
    with tempfile.TemporaryDirectory(prefix="pipeline-register.") as td:
        # What goes to the artifact store is this private copy: allowed names and sizes, no links,
        # nothing secret (pipeline.artifacts.adapter_files); the manifest is checked against it.
        copy = Path(td) / "adapter"
        copy_adapter(adapter_dir, copy)
        try:
            manifest = read_adapter_manifest(copy)
        except FileNotFoundError as e:
            raise RegistryError(
                f"{adapter_dir}: no manifest.json; adapters are registered from `pipeline train` output"
            ) from e
        except (ValueError, OSError) as e:  # not JSON, not a manifest, unreadable
            shown = str(e).replace(
                str(copy), str(adapter_dir)
            )  # the operator's directory, not the private copy
            raise RegistryError(f"{adapter_dir}: unusable manifest.json ({shown}); nothing registered") from e
        # The lineage on the version is the manifest's: refuse files that are not what it describes.
        problems = verify_files(copy, manifest.files)
        if problems:
            raise RegistryError(
                f"{adapter_dir}: files differ from manifest.json (edited after training?); nothing registered:\n  "
                + "\n  ".join(problems).replace(str(copy), str(adapter_dir))
            )
        with shielded():  # SIGTERM/SIGINT wait for the version, its tags and alias (pipeline/interrupt.py)
            return _register(cfg, copy, name, report, manifest)


def _register(cfg: ProjectConfig, adapter_dir: Path, name: str, report: dict, manifest: dict) -> Registered:
    mlflow = mlflow_for(cfg)
    client = mlflow.MlflowClient()
    run_id = manifest.mlflow_run_id
    if run_id:
        try:
            client.get_run(run_id)
        except Exception:
            run_id = None  # trained against another store
    tags = version_tags(cfg, manifest, report, run_id)
    params = flatten_params(manifest.adapter.model_dump(exclude_unset=True))
    experiment = ensure_experiment(cfg, mlflow)
    file_experiment(client, experiment)
    model = mlflow.initialize_logged_model(
        name=name,
        source_run_id=run_id,
        tags=tags,
        params=params,
        model_type=MODEL_TYPE,
        experiment_id=experiment,
    )
    try:
        client.log_model_artifacts(model.model_id, str(adapter_dir))
        if run_id:  # model metrics live in a run; link eval/train loss to their dataset
            by_role = {f.role: f for f in manifest.dataset.files}
            for k, v in manifest.metrics.figures().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    ds = (
                        by_role.get("validation" if k.startswith("eval") else "train")
                        if "loss" in k
                        else None
                    )
                    client.log_metric(  # `final_<k>`: not a point of the trainer's per-step curve `k`
                        run_id,
                        f"final_{k}",
                        float(v),
                        step=int(manifest.metrics.steps or 0),
                        model_id=model.model_id,
                        dataset_name=Path(ds.path).name if ds else None,
                        dataset_digest=(ds.sha256 or "")[:36] if ds else None,
                    )
        mlflow.finalize_logged_model(model.model_id, "READY")
    except BaseException:
        mlflow.finalize_logged_model(model.model_id, "FAILED")
        raise
    # the verdict's binding goes with the version in one write: a register killed after it leaves
    # no version that publish would have to re-validate for want of it
    tags["validation.report"] = json.dumps(_compact(report))[:4900]
    mv = _register_with_retry(mlflow, f"models:/{model.model_id}", name, tags)
    client.update_model_version(name, mv.version, description=_describe(manifest, report))
    if run_id:
        with tempfile.TemporaryDirectory() as td:
            rp = Path(td) / f"v{mv.version}.json"
            rp.write_text(json.dumps(report, indent=2))
            client.log_artifact(run_id, str(rp), artifact_path=f"validation/{name}")
    client.set_registered_model_alias(name, ALIAS_CANDIDATE, mv.version)
    refresh_ui(cfg, name, [int(mv.version)])  # the headline and the model's summary
    return Registered(name, int(mv.version), model.model_id, run_id, mv.source)


def _compact(report: dict) -> dict:
    return {
        "verdict": report.get("verdict"),
        "weights_sha256": report.get("weights_sha256"),
        "errors": [c["id"] for c in report.get("checks", []) if c.get("severity") == "error"],
        "warnings": [c["id"] for c in report.get("checks", []) if c.get("severity") == "warning"],
        "bound": report.get("bound") or {},  # what the verdict checked: publish re-checks when it differs
    }


def resolve_version(cfg: ProjectConfig, name: str, version: int | None = None, alias: str | None = None):
    """The ModelVersion for `name` at `version` or `alias`.


    Raises UsageError naming what exists when the model, version or alias does not.
    """
    mlflow = mlflow_for(cfg)
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
    mlflow = mlflow_for(cfg)
    path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst))
    return Path(path)


def alias_version(cfg: ProjectConfig, name: str, alias: str) -> int | None:
    """The version `alias` points at, or None (no such alias; the model must exist)."""
    from mlflow.exceptions import MlflowException

    client = mlflow_for(cfg).MlflowClient()
    try:
        return int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(cfg: ProjectConfig, name: str, alias: str, version: int) -> int | None:
    """Point `alias` at `version`; returns the version it pointed at before (or None)."""
    prev = alias_version(cfg, name, alias)
    mlflow_for(cfg).MlflowClient().set_registered_model_alias(name, alias, str(version))
    return prev


def set_version_tags(cfg: ProjectConfig, name: str, version: int, tags: dict[str, str]) -> None:
    client = mlflow_for(cfg).MlflowClient()
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))


def record_gate(
    cfg: ProjectConfig, name: str, version: int, verdict: GateVerdict, reason: str | None
) -> None:
    """Put a gate's outcome on the version: tags `gate.verdict` / `gate.reason`, and the UI's summaries.

    `verdict` is "pass" or "gated"; `reason` says why it was gated (None when it passed). The
    version description's first line then says `GATED, stays candidate: <reason>` and the model's
    `candidate` tag `vN gated` (`pipeline.registry.presentation`), so the MLflow UI shows it
    without opening the tags.
    """
    client = mlflow_for(cfg).MlflowClient()
    tags = {GATE_VERDICT_TAG: verdict, GATE_REASON_TAG: (reason or "")[:4900]}
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, v)
    refresh_ui(cfg, name, [version])


def same_weights(cfg: ProjectConfig, name: str, weights_sha256: str):
    """The newest version of `name` whose weights have sha256 `weights_sha256` (a ModelVersion), or None.

    None also when `name` is not registered yet or `weights_sha256` is empty. Reads the versions'
    `weights_sha256` tags (set at registration), so it costs one search, no download.
    """
    if not weights_sha256 or not model_exists(cfg, name):
        return None
    client = mlflow_for(cfg).MlflowClient()
    found = client.search_model_versions(
        f"name='{name}' and tags.`weights_sha256` = '{weights_sha256}'", max_results=1000
    )
    return max(found, key=lambda v: int(v.version), default=None)


def model_exists(cfg: ProjectConfig, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_for(cfg).MlflowClient().get_registered_model(name)
        return True
    except MlflowException:
        return False


# -- reading the registry ---------------------------------------------------------------------------
def model_names(cfg: ProjectConfig) -> list[str]:
    """Names of all registered models, sorted."""
    client = mlflow_for(cfg).MlflowClient()
    return sorted(m.name for m in client.search_registered_models(max_results=1000))


def versions(cfg: ProjectConfig, name: str) -> list:
    """All ModelVersions of `name`, newest first (aliases filled in). UsageError if unknown."""
    if not model_exists(cfg, name):
        raise UsageError(
            f"registered model {name!r} not found in {cfg.tracking_uri} (have: {model_names(cfg)})"
        )
    client = mlflow_for(cfg).MlflowClient()
    out = client.search_model_versions(f"name='{name}'", max_results=10000)
    return sorted(out, key=lambda v: -int(v.version))


def aliases(cfg: ProjectConfig, name: str) -> dict[str, int]:
    """{alias: version} of registered model `name`."""
    rm = mlflow_for(cfg).MlflowClient().get_registered_model(name)
    return {a: int(v) for a, v in (rm.aliases or {}).items()}
