"""`pipeline run`: the unattended retraining job a scheduler calls (cron, systemd, CronJob, Slurm).

Safe to start twice (per-adapter lock: the second exits at once with code 3), safe to kill
at any point: the training directory is keyed by the input fingerprint, so the next run resumes
from the last checkpoint through axolotl's resume support; a finished adapter is registered
once (a version with the same weights is reused); a version registered from these inputs but
never published (killed between register and publish, or gated before) goes through the gates
and publish again instead of being skipped; a publish killed half-way is completed by the
publish transaction (`pipeline.release.transaction`). Skips work that changes nothing (a version
with the same fingerprint that was published: status `skipped`; the config's own checks, which
read no data, come first: the fleet's rules depend on pipeline.yaml and its environment too), and
ships only what passes the gates (validation passed; the predicted MTP acceptance ratio not below
`fleet.min_acceptance_ratio` when that is set (`estimate_speed`, pipeline.validate.acceptance); eval loss not
worse than production's by more than `run.eval_loss_margin`).

Fingerprint: `pipeline.artifacts.fingerprint` (dataset fingerprint, the config's inputs hash,
the base identity): the same value `pipeline train` writes into the manifest and every
registration tags as `run.fingerprint`, so versions from `demo` or `train` + `register` count.
A gated candidate carries the gate's verdict and reason (`gate.verdict`, `gate.reason`, the first
line of its description): `pipeline status` and the MLflow UI show why it stayed.

Stopped by SIGTERM/SIGINT (`pipeline.interrupt`: what systemd and Kubernetes send at a timeout):
training stops (the trainer's process group ends, the MLflow run is marked `KILLED`, the
checkpoints stay for the next run to resume); registration and publishing are completed first
(`shielded`), never cut; the `Interrupted` raised carries the outcome (`status: killed`, the stage
it stopped in, what was registered or published). Progress goes to the `pipeline.jobs.run` logger.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline import registry
from pipeline.artifacts.fingerprint import training_inputs
from pipeline.artifacts.locks import private_lock
from pipeline.artifacts.manifest import MANIFEST, read_adapter_manifest
from pipeline.artifacts.modes import make_dir
from pipeline.artifacts.names import check_name, default_name
from pipeline.canary import canary_version
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, GateFailed, LockedError, UsageError
from pipeline.figures import figure, figures
from pipeline.interrupt import Interrupted, shielded
from pipeline.release.publish import publish
from pipeline.release.transaction import checkpoint
from pipeline.train.config import check_training_config
from pipeline.train.dataset import files_fingerprint
from pipeline.train.launch import check_inputs, train, training_setup
from pipeline.validate import default_base, validate_with_config
from pipeline.validate.acceptance import gate as acceptance_gate
from pipeline.validate.acceptance import summary as acceptance_summary
from pipeline.validate.behaviour import estimate_acceptance
from pipeline.validate.report import FleetRules

FINGERPRINT_TAG = registry.FINGERPRINT_TAG
log = logging.getLogger(__name__)

RunStatus = Literal["skipped", "published", "gated", "failed", "locked", "killed"]
Stage = Literal["check", "train", "validate", "register", "gate", "publish", "done"]


@dataclass
class RunOutcome:
    """The job's result, printed as its last line (README "Exit codes")."""

    status: RunStatus
    name: str
    fingerprint: str
    run_id: str | None = None
    version: int | None = None
    published: str | None = None
    reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    stage: Stage = "check"  # where the run is (where it stopped, for `killed`)
    notes: list[str] = field(default_factory=list)  # e.g. an interrupted publish that was completed

    def to_json(self, exit_code: int | None = None) -> str:
        data = dict(vars(self))
        if exit_code is not None:
            data["exit_code"] = exit_code
        return json.dumps(data, sort_keys=True)


def _versions(cfg: ProjectConfig, name: str) -> list:
    try:
        return registry.versions(cfg, name)
    except UsageError:  # no such model yet
        return []


def _registered_with(cfg: ProjectConfig, name: str, fp: str):
    """The newest version of `name` trained from inputs with fingerprint `fp` (a ModelVersion), or None.

    Any version counts, not only the latest: the same inputs again (e.g. after a manual
    registration in between) would only re-register an identical adapter.
    """
    return next((v for v in _versions(cfg, name) if (v.tags or {}).get(FINGERPRINT_TAG) == fp), None)


def _registered_weights(cfg: ProjectConfig, name: str, weights_sha256: str):
    """The newest version of `name` holding exactly these weights, or None (a run killed after register)."""
    if not weights_sha256:
        return None
    return next(
        (v for v in _versions(cfg, name) if (v.tags or {}).get("weights_sha256") == weights_sha256), None
    )


def skip_reason(name: str, version: int, production: int | None) -> str:
    """Why `pipeline run` skipped: the version trained from these inputs, and the one in production
    (they differ after a rollback or a promote of another version)."""
    if production == version:
        return f"inputs unchanged: v{version}, in production, was trained from them (--force retrains)"
    now = f"v{production} is in production" if production is not None else "nothing is in production"
    return (
        f"inputs unchanged: v{version} was trained from them; {now} (`pipeline promote {name} {version}` "
        "ships it again; --force retrains)"
    )


def _shipped(mv) -> bool:
    """The version was published (or rolled back to) at least once."""
    tags = mv.tags or {}
    return "published.time" in tags or any(
        e.get("type") in ("publish", "rollback") for e in registry.events(mv)
    )


def eval_loss_gate(
    candidate: dict[str, str], production: dict[str, str], margin: float, prod_version: int | None
) -> str | None:
    """Why the candidate's eval loss keeps it from replacing production, or None. Tags in, no I/O.

    Both losses are the versions' exact tags (`eval_loss`, float repr), compared only when both
    were measured on the same validation set (`eval_dataset_sha256`): a loss on other data says
    nothing about which adapter is better. `margin` (nats, `run.eval_loss_margin`) is the noise
    allowance: identical retrains differ by up to the measured run-to-run range
    (docs/registry.md, "Gates on the version").
    """
    # A candidate's own non-finite loss is refused first, whatever production has (with no production
    # loss, or no production at all, a NaN candidate shipped). NaN compares false: `nan > x` let it through.
    loss = _tag_float(candidate, "eval_loss")
    if loss is not None and not math.isfinite(loss):
        return f"candidate eval_loss is {loss!r}: training diverged (see the run's train.log and grad_norm)"
    prod_loss = _tag_float(production, "eval_loss")
    if prod_loss is None:
        return None  # nothing to compare with: production predates eval losses
    if loss is None:
        return f"candidate has no eval_loss to compare with production v{prod_version}'s {figure(prod_loss)}"
    if not math.isfinite(prod_loss):
        return None  # production's own loss is no measure: nothing to compare with
    mine, theirs = candidate.get(registry.EVAL_SET_TAG), production.get(registry.EVAL_SET_TAG)
    if mine and theirs and mine != theirs:
        return (
            f"eval_loss not comparable: evaluated on validation set {mine[:12]}, production v{prod_version} "
            f"on {theirs[:12]}; keep the validation files, or ship it by hand (`pipeline promote`)"
        )
    if loss > prod_loss + margin:
        mine_s, theirs_s = figures(loss, prod_loss)  # as many digits as it takes to show them apart
        diff_s, margin_s = figures(loss - prod_loss, margin)
        return (
            f"eval_loss {mine_s} is worse than production v{prod_version}'s {theirs_s} by "
            f"{diff_s}, more than run.eval_loss_margin {margin_s}"
        )
    return None


def _tag_float(tags: dict, key: str) -> float | None:
    """`tags[key]` as a float (NaN and inf kept), None when absent or not a number."""
    try:
        return float(tags[key])
    except (KeyError, TypeError, ValueError):
        return None


def estimate_speed(cfg: ProjectConfig, adapter_dir: Path, stats: dict) -> None:
    """Put the predicted MTP acceptance (`pipeline.validate.acceptance.summary`) into the validation report's
    `stats["acceptance"]`, so registration records it on the version: when the fleet drafts with MTP
    (`fleet.speculative_mtp`) and the base has an MTP layer (a base without one loads nothing)."""
    base = default_base(cfg, adapter_dir)
    if not cfg.fleet.speculative_mtp or base is None or "acceptance" in stats:
        return
    est = estimate_acceptance(adapter_dir, base)
    if "unavailable" in est:
        log.info("MTP acceptance not estimated: %s", est["unavailable"])
        return
    stats["acceptance"] = acceptance_summary(est, cfg.fleet.lora_speed_factor)
    log.info(
        "predicted MTP acceptance length %s with the adapter, %s for the base (decode x%s)",
        est["adapter"]["acceptance_length"],
        est["base"]["acceptance_length"],
        stats["acceptance"]["speed_ratio"],
    )


def acceptance_reason(cfg: ProjectConfig, tags: dict) -> str | None:
    """Why the version's predicted MTP acceptance keeps it back (`fleet.min_acceptance_ratio` set), or None."""
    minimum = cfg.fleet.min_acceptance_ratio
    if minimum is None or not cfg.fleet.speculative_mtp:
        return None
    verdict = acceptance_gate(_tag_float(tags, "acceptance.ratio"), minimum)
    return verdict[1] if verdict and verdict[0] == "error" else None


def _gate(cfg: ProjectConfig, name: str, version: int, report_verdict: str) -> str | None:
    """Why the candidate must not ship, or None when it may: validation, the predicted MTP acceptance
    (`fleet.min_acceptance_ratio`), then eval loss against production (a non-finite eval loss of the candidate
    holds it back also when nothing is in production)."""
    if report_verdict != "pass":
        return f"validation verdict {report_verdict!r}"
    candidate = registry.resolve_version(cfg, name, version=version).tags or {}
    why = acceptance_reason(cfg, candidate)
    if why:
        return why
    prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
    if prod == version:
        return None
    production = (registry.resolve_version(cfg, name, version=prod).tags or {}) if prod is not None else {}
    return eval_loss_gate(candidate, production, cfg.run.eval_loss_margin, prod)


def _ship(
    cfg: ProjectConfig,
    name: str,
    version: int,
    verdict: str,
    out: RunOutcome,
    seconds: dict[str, float],
) -> RunOutcome:
    """Gate `version` (validation, eval loss, canary), then publish it. Raises GateFailed when held back.

    Publishing and recording the gate are shielded from SIGTERM/SIGINT: they complete, then the
    stop is raised (`Interrupted`, with `out.published` set).
    """
    out.stage = "gate"
    why = _gate(cfg, name, version, verdict)
    if not why and cfg.canary.staging_url:
        # Behaviour on the engine (parity with PEFT, spec-decode speed): recorded on the
        # version; publish's canary gate then reads it (pipeline/canary).
        t = time.time()
        _, res = canary_version(cfg, name, version=version)
        seconds["canary"] = time.time() - t
        if res.verdict != "pass":
            why = "canary failed: " + "; ".join(res.problems)[:500]
    if why:
        out.status, out.reason = "gated", why
        registry.record_gate(cfg, name, version, "gated", why)
        raise GateFailed(f"{name} v{version} stays `candidate`: {why}", outcome=out)
    t = time.time()
    out.stage = "publish"
    with shielded():
        try:
            pub = publish(cfg, name, version=version)
        except CheckFailed as e:  # publish's own gates (validation for these weights, canary floors)
            out.status, out.reason = "gated", str(e)
            registry.record_gate(cfg, name, version, "gated", str(e))
            raise GateFailed(f"{name} v{version} stays `candidate`: {e}", outcome=out) from None
        out.published = str(pub.path)
        for w in pub.warnings:  # e.g. "completed an interrupted publish of ..." (a killed run before)
            log.warning("%s", w)
            out.notes.append(w)
        registry.record_gate(cfg, name, version, "pass", None)
    seconds["publish"] = time.time() - t
    out.status, out.stage = "published", "done"
    return out


def run_plan(
    cfg: ProjectConfig,
    config_path: Path,
    *,
    name: str | None = None,
    force: bool = False,
    overrides: list[str] = (),
    overlays: list[Path] = (),
    allow: set[str] = frozenset(),
    gpus: int = 1,
    launcher: str | None = None,
    launcher_args: list[str] = (),
    strategy: str = "auto",
) -> dict:
    """What `run` with these arguments would do now (`pipeline run --dry-run`), as a JSON-ready dict.

    The same option handling and config checks as `run` before its lock, then the skip decision from
    the files' fingerprint: `plan` is `skip` (with the reason `run` would give), `ship` (a version
    registered from these inputs and never published: gate and publish it), or `train` (then
    validate, register as `version`, gate against `production`, publish). Takes no lock, writes
    nothing, creates no store. Raises what `run` raises before its lock (UsageError, CheckFailed).
    """
    name = check_name(
        name or default_name(Path(config_path).stem),
        "adapter name (--name, default: from the config file name)",
    )
    tc, plan = training_setup(
        Path(config_path), list(overrides), list(overlays), gpus, launcher, list(launcher_args), strategy
    )
    check_training_config(tc, FleetRules.from_config(cfg), set(allow))
    known = cfg.store_exists() and registry.model_exists(cfg, name)
    prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION) if known else None
    out = {"dry_run": True, "action": "run", "name": name, "production": prod, "version": None}
    quick = files_fingerprint(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets"))
    same = None
    if quick is not None and not force and known:
        same = _registered_with(cfg, name, training_inputs(quick, tc.data)["fingerprint"])
    if same is not None and _shipped(same):
        return {
            **out,
            "plan": "skip",
            "version": int(same.version),
            "reason": skip_reason(name, int(same.version), prod),
        }
    if same is not None:
        return {
            **out,
            "plan": "ship",
            "version": int(same.version),
            "reason": f"v{same.version} was registered from these inputs but never published: gate and publish it",
        }
    nxt = max((int(v.version) for v in _versions(cfg, name)), default=0) + 1 if known else 1
    why = "--force" if force else ("the inputs changed" if known else f"no version of {name} yet")
    return {
        **out,
        "plan": "train",
        "version": nxt,
        "reason": f"{why}: train ({plan.world} process(es), launcher {plan.launcher}), validate, register as "
        f"v{nxt}, gate against production ({f'v{prod}' if prod is not None else 'none'}), publish",
    }


def run(
    cfg: ProjectConfig,
    config_path: Path,
    *,
    name: str | None = None,
    force: bool = False,
    overrides: list[str] = (),
    overlays: list[Path] = (),
    allow: set[str] = frozenset(),
    gpus: int = 1,
    launcher: str | None = None,
    launcher_args: list[str] = (),
    strategy: str = "auto",
    show_progress: bool = False,
) -> RunOutcome:
    """Fingerprint, lock, train (or resume), validate, register, gate, publish.

    `gpus`, `launcher`, `launcher_args` (the arguments after `--`) and `strategy` mean what they mean
    to `pipeline train` (pipeline.train.launch.training_setup), so a schedule that reserves N GPUs
    trains on N; a worker node of a multi-node run is `pipeline train`'s job, not this one's.

    Raises:
        LockedError (exit 3): another run for this adapter holds the lock.
        GateFailed (exit 5): the candidate was registered (alias `candidate`) but not shipped.
        CheckFailed / UsageError / TrainError: bad inputs or training failure (nothing registered).
        Interrupted (exit 128 + signal): SIGTERM/SIGINT; `.outcome` is the `killed` RunOutcome.
    """
    from filelock import Timeout

    t0 = time.time()
    seconds: dict[str, float] = {}
    name = check_name(
        name or default_name(Path(config_path).stem),
        "adapter name (--name, default: from the config file name)",
        served=cfg.served_base_names,
    )
    tc, plan = training_setup(
        Path(config_path), list(overrides), list(overlays), gpus, launcher, list(launcher_args), strategy
    )
    if plan.node_rank > 0:
        raise UsageError(
            f"node rank {plan.node_rank}: run the worker nodes of a multi-node training with `pipeline train`; "
            "`pipeline run` belongs on node 0, which registers and publishes"
        )
    # The lock comes first, so a second concurrent run exits at once, before any slow check.
    lock_dir = cfg.state_dir / "locks"
    make_dir(lock_dir)  # 0755 whatever the umask (the lock files in it are 0600)
    lock = private_lock(lock_dir / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise LockedError(f"another `pipeline run` for {name!r} holds {lock.lock_file}; exiting") from None
    out = RunOutcome("failed", name, "", seconds=seconds)
    try:
        registry.check_store(cfg)  # a store that cannot be used fails now, before training
        # The config's own checks read no data (milliseconds) and depend on more than the fingerprint:
        # pipeline.yaml and its environment (the fleet's rules) and the files still being there. A fleet
        # that can no longer serve what this job trains fails the run even when the inputs are unchanged.
        # (The GPU preflight's packing facts are for training: `check_inputs` adds them.)
        check_training_config(tc, FleetRules.from_config(cfg), set(allow))
        # Unchanged inputs are known from the files' bytes, the config and the base: a run that ships
        # nothing skips the other checks and the dataset gate (axolotl's import, a tokenization of every row).
        quick = files_fingerprint(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets"))
        if quick is not None and not force:
            out.fingerprint = training_inputs(quick, tc.data)["fingerprint"]
            same = _registered_with(cfg, name, out.fingerprint)
            if same is not None and _shipped(same):
                seconds["check"] = time.time() - t0
                out.status, out.version, out.stage = "skipped", int(same.version), "done"
                prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
                out.reason = skip_reason(name, int(same.version), prod)
                return out
        ds = check_inputs(cfg, tc, set(allow), world=plan.world)
        fp = training_inputs(ds.fingerprint, tc.data)["fingerprint"]
        seconds["check"] = time.time() - t0
        out.fingerprint = fp
        same = None if force else _registered_with(cfg, name, fp)
        if same is not None:
            # Registered from these inputs, never published: a run killed between register and
            # publish, or a candidate a gate held back. Gate and publish it now; never skip it.
            tags = same.tags or {}
            log.info(
                "v%s was registered from these inputs but never published: gating and publishing it",
                same.version,
            )
            out.version, out.run_id = int(same.version), same.run_id
            return _ship(
                cfg, name, int(same.version), tags.get("validation.verdict", "unknown"), out, seconds
            )
        run_dir = cfg.train.runs_dir / f"{name}-{fp[:12]}"
        t = time.time()
        out.stage = "train"
        if (run_dir / "adapter" / MANIFEST).exists() and not force:
            adapter_dir = run_dir / "adapter"  # trained before a crash in a later stage
            log.info("reusing finished training in %s", run_dir)
        else:
            if force and (run_dir / "adapter").exists():
                run_dir = cfg.train.runs_dir / f"{name}-{fp[:12]}-{int(time.time())}"
            adapter_dir = train(
                cfg,
                config_path,
                overrides=list(overrides),
                overlays=list(overlays),
                allow=set(allow),
                name=name,
                gpus=gpus,
                launcher=launcher,
                launcher_args=list(launcher_args),
                strategy=strategy,
                show_progress=show_progress,
                run_dir=run_dir,
            ).adapter_dir
        seconds["train"] = time.time() - t
        manifest = read_adapter_manifest(adapter_dir)
        out.run_id = manifest.mlflow_run_id

        t = time.time()
        out.stage = "validate"
        report = validate_with_config(cfg, adapter_dir)
        if report.passed:
            estimate_speed(cfg, adapter_dir, report.stats)  # recorded on the version; `_gate` reads it
        seconds["validate"] = time.time() - t

        t = time.time()
        out.stage = "register"
        again = _registered_weights(cfg, name, manifest.weights_sha256)
        if again is not None and force:  # a forced retrain that reproduced a version bit for bit
            log.warning(
                "%s v%s holds these very weights (sha256 %s): registering them again as a new version (--force)",
                name,
                again.version,
                manifest.weights_sha256[:16],
            )
            again = None
        with shielded():  # a registration is completed (version, tags), never cut half-way
            if again is not None:  # registered by a run killed before it could tag the fingerprint
                version = int(again.version)
                log.info("reusing v%s: already registered with these weights", version)
            else:
                version = registry.register_adapter(
                    cfg, adapter_dir, name, report.to_dict()
                ).version  # tags run.fingerprint
            out.version = version
            checkpoint("run-after-register")
            registry.set_version_tags(cfg, name, version, {FINGERPRINT_TAG: fp})  # also on a reused version
            checkpoint("run-after-tag")
        seconds["register"] = time.time() - t
        return _ship(cfg, name, version, report.verdict, out, seconds)
    except Interrupted as e:
        out.status = "killed"
        e.outcome = out
        raise
    finally:
        seconds["total"] = time.time() - t0
        lock.release()
