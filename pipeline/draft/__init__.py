"""`pipeline draft NAME --version N`: distil an MTP drafter for one model version, check it, record it.

vLLM drafts for an adapter's requests with the base's MTP layer (never LoRA'd: `Qwen3_5MTP` has no LoRA
support and skips an adapter's `mtp.*` keys), fed the adapted target's hidden states; an adapter that
moves the target's argmax loses acceptance (`pipeline.validate.acceptance`). This trains the MTP layer on
the adapted target's own greedy continuations of the adapter's training prompts (`distil`), refuses a
drafter the fleet must not serve (`artifact.check_drafter`), and records it: an MLflow run linked to the
version (`pipeline.registry.speed.start_draft_run`) holding the drafter directory as its `drafter`
artifact, and `drafter.*` tags plus the description's `Speed:` line on the version. docs/drafter.md.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.bounded import MIB, loads_json
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.artifacts.modes import writable_problem
from pipeline.artifacts.peft_model import load_peft
from pipeline.config import ProjectConfig
from pipeline.draft.artifact import (
    DrafterRecord,
    DrafterRefused,
    check_drafter,
    reference_headers,
    write_drafter,
)
from pipeline.draft.distillation import distil
from pipeline.errors import UsageError
from pipeline.registry.speed import finish_draft_run, record_speed, start_draft_run
from pipeline.validate import default_base
from pipeline.validate.acceptance import NoMtpLayer, mtp_tensors

log = logging.getLogger(__name__)
MAX_CONVERSATIONS = 256

__all__ = ["DrafterRefused", "Drafted", "draft_version", "reference_checkpoint"]


@dataclass
class Drafted:
    name: str
    version: int
    run_id: str
    artifact_uri: str
    sha256: str
    before: float | None
    after: float | None
    seconds: float
    out: Path | None


def _conversations(files: list[Path], limit: int = MAX_CONVERSATIONS) -> list[dict]:
    out = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                out.append(loads_json(line, str(f), 16 * MIB))
            if len(out) >= limit:
                return out
    return out


def reference_checkpoint(cfg: ProjectConfig, base: Path) -> Path:
    """The checkpoint a drafter must match: `served.path` when it has `mtp.*` tensors (what the fleet serves),
    else the base."""
    served = cfg.served.path
    if served and Path(served).is_dir():
        try:
            reference_headers(Path(served))
            return Path(served)
        except UsageError:
            pass
    return Path(base)


def _checks(device: str, out: Path | None) -> None:
    """The options' own checks, before the registry is read: a GPU for `cuda`, a creatable `out`."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    if out is not None and (problem := writable_problem("--out", Path(out))):  # a file there, too
        raise UsageError(problem)


def _inputs(cfg: ProjectConfig, name: str, version: int, base_dir: Path | None, td: Path):
    """(adapter dir downloaded into `td`, its manifest, base, the base's `mtp.*` state, training files, validation
    files) of `name` v`version`, after every check made before a drafter trains. Raises UsageError (see
    draft_version)."""
    mv = registry.resolve_version(cfg, name, version=version)
    adapter = registry.download_version(cfg, mv, td / "adapter")
    manifest = read_adapter_manifest(adapter)
    base = Path(base_dir) if base_dir else default_base(cfg, adapter)
    if base is None or not base.is_dir():
        raise UsageError(f"{name} v{version}: no base checkpoint: pass --base DIR or set base.path")
    try:
        state = mtp_tensors(base)
    except NoMtpLayer as e:
        raise UsageError(f"{e}: pass --base with the checkpoint whose MTP layer the fleet drafts with") from e
    files = manifest.dataset.files
    train_files = [Path(f.path) for f in files if f.role == "train"]
    eval_files = [Path(f.path) for f in files if f.role == "validation"]
    missing = [str(f) for f in train_files + eval_files if not f.is_file()]
    if not train_files or missing:
        raise UsageError(
            f"{name} v{version}: the manifest's training files are "
            + (f"not here ({', '.join(missing[:3])})" if missing else "not recorded")
            + ": run `pipeline draft` where the training data is, at the paths manifest.json records"
        )
    return adapter, manifest, base, state, train_files, eval_files


def draft_plan(
    cfg: ProjectConfig, name: str, version: int, *, base_dir: Path | None = None, **params
) -> dict:
    """What `draft_version` would train and record, after the same checks, changing nothing
    (`pipeline draft --dry-run`): {"name", "version", "base", "reference" (the served checkpoint the drafter is
    checked against), "train_files", "validation_files", "mtp_tensors", "params"}. Raises as draft_version
    does before it trains (UsageError)."""
    _checks(params.get("device", "cpu"), params.get("out"))
    with tempfile.TemporaryDirectory(prefix="pipeline-draft.") as td:
        _, _, base, state, train_files, eval_files = _inputs(cfg, name, version, base_dir, Path(td))
    out = params.get("out")
    return {"name": name, "version": int(version), "base": str(base), "reference": str(reference_checkpoint(cfg, base)),
            "train_files": [str(f) for f in train_files], "validation_files": [str(f) for f in eval_files],
            "mtp_tensors": len(state), "replaces": str(out) if out and Path(out).exists() else None,
            "params": params}  # fmt: skip


def draft_version(
    cfg: ProjectConfig,
    name: str,
    version: int,
    *,
    base_dir: Path | None = None,
    budget_s: float = 60.0,
    max_steps: int | None = None,
    lr: float = 1e-4,
    device: str = "cpu",
    seed: int = 0,
    out: Path | None = None,
) -> Drafted:
    """Distil, check and record a drafter for `name` version `version`.

    Args:
        base_dir: the bf16 base with its `mtp.*` tensors (default: `base.path`, else the manifest's local base).
        budget_s: seconds of the training loop; max_steps: optimizer steps at most; lr: AdamW learning rate; device: "cpu" or "cuda"; seed.
        out: also keep the drafter directory here (it is always logged to the run).
    Raises UsageError (exit 2): unknown version, no base or no MTP layer in it, training files missing.
    DrafterRefused (exit 1): the drafter fails `check_drafter` (the run ends FAILED; the version is untouched).
    """
    _checks(device, out)
    with tempfile.TemporaryDirectory(prefix="pipeline-draft.") as td:
        adapter, manifest, base, state, train_files, eval_files = _inputs(
            cfg, name, version, base_dir, Path(td)
        )
        reference = reference_checkpoint(cfg, base)
        params = {"base": str(base), "reference": str(reference), "budget_s": budget_s, "max_steps": max_steps, "lr": lr,
                  "device": device, "seed": seed}  # fmt: skip
        run_id = start_draft_run(cfg, name, version, params)
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(base))
            model = load_peft(base, adapter, "bfloat16" if device == "cuda" else "float32", device)
            try:
                state, rep = distil(
                    model, tok, _conversations(train_files), _conversations(eval_files), state,
                    budget_s=budget_s, max_steps=max_steps, lr=lr, seed=seed,
                )  # fmt: skip
            except ValueError as e:  # no continuation to learn from: the data's problem, said as such
                raise UsageError(
                    f"{name} v{version}: {e}; the drafter learns from the adapter's answers to its training "
                    "prompts: give the version more (or longer) training conversations"
                ) from e
            record = DrafterRecord(
                name=name,
                version=int(version),
                base=str(base),
                reference=str(reference),
                adapter_weights_sha256=manifest.weights_sha256,
                sha256="",
                acceptance_before=rep["before"],
                acceptance_after=rep["after"],
                data_sha256=rep["data_sha256"],
                eval_data_sha256=rep["eval_data_sha256"],
                train={
                    k: rep[k]
                    for k in (
                        "steps",
                        "kept",
                        "train_s",
                        "seconds",
                        "lr",
                        "seed",
                        "prompts",
                        "eval_prompts",
                        "new_tokens",
                    )
                }
                | {"device": device},  # fmt: skip
                mlflow_run_id=run_id,
            )
            d = write_drafter(Path(td) / "drafter", state, record)
            metrics = {
                "acceptance_length_before": rep["before"]["acceptance_length"],
                "acceptance_length_after": rep["after"]["acceptance_length"],
                "steps": rep["steps"],
                "train_s": rep["train_s"],
            }
            for k, a in enumerate(rep["after"]["acceptance"] or []):
                metrics[f"acceptance_after_{k + 1}"] = a
            check_drafter(d, reference)
        except DrafterRefused as e:
            finish_draft_run(cfg, run_id, metrics, ok=False, reason=str(e))
            raise
        except BaseException:
            finish_draft_run(cfg, run_id, {}, ok=False, reason="failed before the drafter was written")
            raise
        uri = finish_draft_run(cfg, run_id, metrics, d)
        record_speed(
            cfg,
            name,
            int(version),
            {
                "drafter.run_id": run_id,
                "drafter.artifact_uri": uri or "",
                "drafter.sha256": record.sha256,
                "drafter.length_before": repr(float(rep["before"]["acceptance_length"])),
                "drafter.length_after": repr(float(rep["after"]["acceptance_length"])),
                "drafter.data_sha256": rep["data_sha256"],
            },
        )
        kept = None
        if out is not None:
            import shutil

            if Path(out).exists():
                shutil.rmtree(out)
            kept = Path(shutil.copytree(d, out))
        return Drafted(name, int(version), run_id, uri or "", record.sha256, rep["before"]["acceptance_length"],
                       rep["after"]["acceptance_length"], rep["seconds"], kept)  # fmt: skip
