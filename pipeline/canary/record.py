"""Canary results on the MLflow model version (`canary.*` tags), shown by `status` and gated by `publish`."""

from __future__ import annotations

import json
import math

from pipeline import registry
from pipeline.canary.result import CanaryResult
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, UsageError
from pipeline.figures import figures
from pipeline.fleet.client import InstanceClient, InstanceError

TAG = "canary."


REPORT_TAG = "canary.report"


# -- registry: record, show, gate -------------------------------------------------------------------------------------
def _r(x: float | None) -> str:
    """A figure as a tag, exactly (float repr): publish's floors compare these (rounded to 4
    decimals, a speed ratio of 0.79996 passed a floor of 0.8)."""
    return "" if x is None else repr(float(x))


def _positions(rates: list[float] | None) -> str:
    return "" if not rates else ",".join(str(round(x, 4)) for x in rates)


def summary_tags(res: CanaryResult) -> dict[str, str]:
    """The model-version tags of a canary result (`canary.*`); empty values are left out."""
    b, a = res.parity["base"], res.parity["adapter"]
    sb, sa = res.speed["base"], res.speed["adapter"]
    srv = res.served
    tags = {
        "verdict": res.verdict,
        "time": res.time,
        "staging": res.staging,
        "weights_sha256": res.weights_sha256 or "",
        "checkpoint": f"{srv.get('checkpoint')}@{srv.get('revision') or '-'}",
        "engine_model": srv.get("engine_model") or "",
        "engine_root": srv.get("engine_root") or "",
        "vllm_version": srv.get("vllm_version") or "",
        "token_agreement": _r(a.agreement),
        "base_token_agreement": _r(b.agreement),
        "max_logprob_diff": _r(a.max_logprob_diff),
        "base_max_logprob_diff": _r(b.max_logprob_diff),
        "first_divergence": "" if a.first_divergence is None else str(a.first_divergence),
        "acceptance_rate": _r(sa.acceptance_rate),
        "base_acceptance_rate": _r(sb.acceptance_rate),
        "acceptance_length": _r(sa.mean_acceptance_length),
        "base_acceptance_length": _r(sb.mean_acceptance_length),
        "tpot_ms": _r(sa.tpot_s * 1000 if sa.tpot_s is not None else None),
        "base_tpot_ms": _r(sb.tpot_s * 1000 if sb.tpot_s is not None else None),
        "speed_ratio": _r(res.speed_ratio),
        "acceptance_ratio": _r(res.acceptance_ratio),
        "problems": " | ".join(res.problems)[:4900],
        "acceptance_per_position": _positions(sa.acceptance_per_position),
        "base_acceptance_per_position": _positions(sb.acceptance_per_position),
    }
    if res.effect is not None:
        e = res.effect
        tags.update(
            # no retention where the engine gave unusable log-probabilities: it measured part of the tokens
            effect_retention="" if e.engine_unusable else _r(e.retention),
            effect_engine_unusable=str(e.engine_unusable) if e.engine_unusable else "",
            effect_nats=_r(e.engine_nats),
            reference_effect_nats=_r(e.reference_nats),
            effect_correlation=_r(e.correlation),
            base_gap_nats=_r(e.base_gap_nats),
        )
    return {TAG + k: v for k, v in tags.items() if v != ""}


def record(cfg: ProjectConfig, name: str, version: int, res: CanaryResult) -> None:
    """Store the result on model version `name` v`version`: `canary.*` tags, the report JSON
    (tag `canary.report`, trimmed to MLflow's tag size; whole in the training run's artifacts
    as `canary/<name>/v<N>.json` when the version has a run), and a `canary` event.
    Stale tags of an earlier canary (figures this one did not measure) are removed.
    """

    client = registry.client(cfg)
    mv = client.get_model_version(name, str(version))
    tags = summary_tags(res)
    for k in mv.tags or {}:
        if k.startswith(TAG) and k not in tags and k != REPORT_TAG:
            client.delete_model_version_tag(name, str(version), k)
    d = res.to_dict()
    compact = {k: v for k, v in d.items() if k not in ("parity", "notes")}
    compact["parity"] = {k: {f: v for f, v in p.items() if f != "per_prompt"} for k, p in d["parity"].items()}
    tags[REPORT_TAG] = json.dumps(compact, sort_keys=True, default=str)[:4900]
    registry.set_version_tags(cfg, name, version, tags)
    if mv.run_id:
        try:
            client.log_text(mv.run_id, json.dumps(d, indent=2, default=str), f"canary/{name}/v{version}.json")
        except Exception:  # noqa: BLE001 - the run may live in another store; the tags hold the figures
            pass
    registry.record_event(
        cfg,
        name,
        version,
        {
            "type": "canary",
            "verdict": res.verdict,
            "staging": res.staging,
            "checkpoint": tags[TAG + "checkpoint"],
        },
    )


def show(tags: dict) -> dict | None:
    """The canary figures `pipeline status` shows, from a version's tags (None: no canary recorded)."""
    if TAG + "verdict" not in tags:
        return None
    keys = (
        "verdict",
        "time",
        "checkpoint",
        "engine_model",
        "token_agreement",
        "base_token_agreement",
        "max_logprob_diff",
        "acceptance_length",
        "base_acceptance_length",
        "speed_ratio",
        "acceptance_ratio",
        "effect_retention",
        "weights_sha256",
    )
    return {k: tags.get(TAG + k) for k in keys}


def gate(cfg: ProjectConfig, mv) -> list[str]:
    """The publish check on a version's recorded canary; returns warnings.


    Raises CheckFailed: the recorded canary failed; its figures fall below the configured
    floors; or `canary.required` and no canary was recorded for the version's weights.
    Warns when the served checkpoint the canary measured differs from the fleet profile
    (`served.checkpoint`/`revision`) or from what a configured fleet instance serves
    (`/v1/models` base card).
    """
    t = mv.tags or {}
    c = cfg.canary
    where = f"{mv.name} v{mv.version}"
    verdict = t.get(TAG + "verdict")
    if verdict is not None and t.get(TAG + "weights_sha256") not in (
        None,
        t.get("validation.weights_sha256"),
    ):
        verdict = None  # measured other weights than the validated artifact
    how = f"run `pipeline canary {mv.name} --version {mv.version} --staging URL`"
    if verdict is None:
        if c.required:
            raise CheckFailed(
                f"{where}: no canary recorded for its weights and canary.required is set: {how}"
            )
        return []
    if verdict != "pass":
        raise CheckFailed(
            f"{where}: canary failed: {t.get(TAG + 'problems', '(no details)')}; fix and re-register, "
            f"then {how}"
        )
    # The floors as configured now (they may be set after the canary ran). A floor is met only by a
    # recorded figure: a missing or non-finite one fails it (it passed before, on no evidence).
    for floor, key, what in (
        (c.min_speed_ratio, "speed_ratio", "canary.min_speed_ratio"),
        (c.min_acceptance_ratio, "acceptance_ratio", "canary.min_acceptance_ratio"),
        (c.min_effect_retention, "effect_retention", "canary.min_effect_retention"),
    ):
        if floor is None:
            continue
        value = _float(t.get(TAG + key))
        if value is None:
            raise CheckFailed(
                f"{where}: {what} is {floor} but the recorded canary has no {key} (not measured, or not "
                f"defined for this adapter: see the canary's notes in `pipeline status`): {how} on an engine that "
                f"measures it, or unset {what}"
            )
        if not value >= floor:
            shown, limit = figures(value, floor)  # 0.7996 against 0.8 printed "0.800 is below 0.8"
            raise CheckFailed(f"{where}: canary {key} {shown} is below {what} {limit}")
    warnings = []
    measured = t.get(TAG + "checkpoint")
    profile = f"{cfg.served.checkpoint}@{cfg.served.revision or '-'}"
    if measured and measured != profile:
        warnings.append(
            f"{where}: the canary measured served checkpoint {measured}, the fleet profile now says "
            f"{profile}: re-run the canary"
        )
    engine = (t.get(TAG + "engine_model"), t.get(TAG + "engine_root"))
    if cfg.fleet.instances and engine[0]:
        for inst in cfg.fleet.instances:
            try:
                with InstanceClient(inst, cfg.fleet.timeout_s) as client:
                    base = next((x for x in client.models() if x.parent is None), None)
            except (InstanceError, UsageError):
                continue  # the rollout reports instances it cannot reach
            if base is not None and (base.id, base.root) != engine:
                warnings.append(
                    f"{where}: fleet instance {inst.name} serves {base.id} ({base.root}), the canary "
                    f"measured {engine[0]} ({engine[1]}) on staging: its figures may not hold there"
                )
    return warnings


def _float(text: str | None) -> float | None:
    """A recorded figure as a finite float; None when absent, unparsable, NaN or infinite."""
    try:
        v = float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None
