"""A version's speed figures in the registry: the predicted MTP acceptance (`pipeline validate --behaviour`,
`pipeline run`) and its drafter (`pipeline draft`), as version tags, a `Speed:` line of the description, and
the drafter's MLflow run.

Tags (numbers exact, `repr` of the float; per-position lists comma-separated, draft position 1 first):
`acceptance.length_base`, `acceptance.length_adapter` (mean acceptance length, vLLM's `1 + accepted /
drafts`), `acceptance.ratio` (adapter / base), `acceptance.speed_ratio` (predicted decode tok/s adapter /
base: the ratio x `acceptance.lora_speed_factor`), `acceptance.per_position_base|adapter`,
`acceptance.prompts`, `acceptance.data_sha256`; `drafter.run_id`, `drafter.artifact_uri`, `drafter.sha256`,
`drafter.length_before`, `drafter.length_after`, `drafter.data_sha256`.
"""

from __future__ import annotations

from pipeline.config import ProjectConfig
from pipeline.registry.presentation import body, describe
from pipeline.registry.store import ensure_experiment, mlflow_for

ACCEPTANCE = "acceptance."
DRAFTER = "drafter."
SPEED_LINE = "Speed: "
# summary key (pipeline.validate.acceptance.summary) -> tag
SUMMARY_TAGS = {
    "acceptance_length_base": "acceptance.length_base",
    "acceptance_length_adapter": "acceptance.length_adapter",
    "acceptance_ratio": "acceptance.ratio",
    "speed_ratio": "acceptance.speed_ratio",
    "lora_speed_factor": "acceptance.lora_speed_factor",
    "acceptance_base": "acceptance.per_position_base",
    "acceptance_adapter": "acceptance.per_position_adapter",
    "prompts": "acceptance.prompts",
    "data_sha256": "acceptance.data_sha256",
}
TEXT_TAGS = (
    "acceptance.data_sha256",
    "drafter.run_id",
    "drafter.artifact_uri",
    "drafter.sha256",
    "drafter.data_sha256",
)


def _text(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_text(x) for x in v)
    return repr(float(v)) if isinstance(v, float) else str(v)


def acceptance_tags(figures: dict | None) -> dict[str, str]:
    """Version tags of an estimate's summary (`pipeline.validate.acceptance.summary`); {} for None or a summary
    without figures."""
    if not figures or figures.get("acceptance_length_base") is None:
        return {}
    return {tag: _text(figures[k]) for k, tag in SUMMARY_TAGS.items() if figures.get(k) is not None}


def _num(v: str | None):
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None


def show(tags: dict[str, str]) -> dict | None:
    """The speed figures of a version's tags as data (numbers as numbers, lists as lists), None without any."""
    keys = {k: v for k, v in tags.items() if k.startswith((ACCEPTANCE, DRAFTER))}
    if not keys:
        return None
    out: dict = {}
    for k, v in sorted(keys.items()):
        if k in TEXT_TAGS:
            out[k] = v
        elif "per_position" in k:
            out[k] = [_num(x) for x in v.split(",") if x]
        else:
            out[k] = _num(v)
    return out


def speed_line(tags: dict[str, str]) -> str | None:
    """The description's `Speed:` line from the tags, None without figures."""
    parts = []
    if tags.get("acceptance.length_base"):
        parts.append(
            f"MTP acceptance length {float(tags['acceptance.length_base']):.3g} base, "
            f"{float(tags['acceptance.length_adapter']):.3g} with the adapter (predicted on "
            f"{tags.get('acceptance.prompts', '?')} validation prompts, ratio {tags.get('acceptance.ratio', '?')}; "
            f"decode {tags.get('acceptance.speed_ratio', '?')}x the base's at LoRA factor "
            f"{tags.get('acceptance.lora_speed_factor', '?')})"
        )
    if tags.get("drafter.sha256"):
        parts.append(
            f"drafter {tags['drafter.sha256'][:12]} (run {tags.get('drafter.run_id', '?')}): acceptance length "
            f"{tags.get('drafter.length_before', '?')} -> {tags.get('drafter.length_after', '?')}"
        )
    return SPEED_LINE + "; ".join(parts) + "." if parts else None


def with_speed_line(description: str, tags: dict[str, str]) -> str:
    """`description` (a body, no headline) with its `Speed:` line replaced by the tags' one."""
    lines = [ln for ln in (description or "").splitlines() if not ln.startswith(SPEED_LINE)]
    line = speed_line(tags)
    return "\n".join([*lines, *([line] if line else [])])


def record_speed(cfg: ProjectConfig, name: str, version: int, tags: dict[str, str]) -> None:
    """Set speed tags on a version and rewrite its description's `Speed:` line (the headline kept)."""
    client = mlflow_for(cfg).MlflowClient()
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, v)
    mv = client.get_model_version(name, str(version))
    merged = {**(mv.tags or {}), **tags}
    text = describe(merged, with_speed_line(body(mv.description), merged))
    if text != (mv.description or ""):
        client.update_model_version(name, str(version), description=text)


def start_draft_run(cfg: ProjectConfig, name: str, version: int, params: dict) -> str:
    """The MLflow run of one drafter distillation, linked to the version (tags `pipeline.stage` draft,
    `model_version` NAME/N, `model_name`, `model_version_number`); returns its id."""
    mlflow = mlflow_for(cfg)
    client = mlflow.MlflowClient()
    run = client.create_run(
        ensure_experiment(cfg, mlflow),
        run_name=f"draft-{name}-v{version}",
        tags={
            "pipeline.stage": "draft",
            "model_version": f"{name}/{version}",
            "model_name": name,
            "model_version_number": str(version),
        },
    )
    for k, v in sorted(params.items()):
        client.log_param(run.info.run_id, k, str(v)[:500])
    return run.info.run_id


def finish_draft_run(
    cfg: ProjectConfig,
    run_id: str,
    metrics: dict,
    artifact_dir=None,
    ok: bool = True,
    reason: str | None = None,
) -> str | None:
    """Log metrics and the drafter directory (artifact path `drafter`), end the run; returns the artifact URI
    (`runs:/<id>/drafter`) when a directory was logged. A refused drafter ends FAILED with tag `draft.refused`."""
    client = mlflow_for(cfg).MlflowClient()
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            client.log_metric(run_id, k, float(v))
    uri = None
    if artifact_dir is not None and ok:
        client.log_artifacts(run_id, str(artifact_dir), artifact_path="drafter")
        uri = f"runs:/{run_id}/drafter"
    if reason:
        client.set_tag(run_id, "draft.refused", reason[:4900])
    client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
    return uri
