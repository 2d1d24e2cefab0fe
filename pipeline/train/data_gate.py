"""The dataset half of `pipeline train`'s checks, shared with `pipeline dataset check --config`.

`dataset_report` reads each data file with its own `datasets` / `test_datasets` entry through
axolotl's chat_template strategy (pipeline.train.dataset: schema, trainable turns, duplicates,
overlap, fingerprint); `dataset_gate` counts what axolotl keeps of them with the run's tokenizer,
template and `sequence_len` (pipeline.train.gate: axolotl's own preprocessing and filters) and
refuses what `train` refuses. `check_config_datasets` is both, as `train` runs them, for a config
that is not trained: the same counts and the same refusals, nothing written but the datasets
library's cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed
from pipeline.train.config import TrainingConfig
from pipeline.train.dataset import DatasetReport, check_datasets
from pipeline.train.datasets_scope import by_content, scoped
from pipeline.train.gate import GateUnavailable, SplitCount, count_kept, gate_problems
from pipeline.train.schema import PLUGIN

log = logging.getLogger("pipeline.train")


def dataset_report(tc: TrainingConfig, allow: set[str] = frozenset()) -> DatasetReport:
    """The dataset checks of `tc`'s files, each read with its own datasets entry (field mappings,
    roles, roles_to_train) and the base's tokenizer when it can be read here (the template's
    message variables); findings whose id is in `allow` are dropped. Raises CheckFailed listing
    the errors (at most 30), FileNotFoundError for a file that is not there."""
    formats = {
        str(Path(d["path"])): d
        for key in ("datasets", "test_datasets")
        for d in tc.data.get(key) or []
        if isinstance(d, dict) and d.get("path")
    }
    report = check_datasets(
        tc.dataset_paths("datasets"),
        tc.dataset_paths("test_datasets"),
        tokenizer=_load_tokenizer(str(tc.data.get("base_model"))),  # the template's message variables
        formats=formats,
        config=tc.data,
    )
    report.findings = [f for f in report.findings if f.id not in allow]  # `--allow dataset.overlap` ...
    if not report.ok:
        shown = "\n  ".join(str(f) for f in report.errors[:30])
        more = f"\n  ... and {len(report.errors) - 30} more" if len(report.errors) > 30 else ""
        raise CheckFailed(f"dataset check failed ({len(report.errors)} errors):\n  {shown}{more}")
    return report


def check_config_datasets(
    cfg: ProjectConfig, tc: TrainingConfig, allow: set[str] = frozenset()
) -> DatasetReport:
    """`dataset_report` and `dataset_gate` of `tc`, as `pipeline train` runs them (its refusals,
    `cfg.train.max_dropped_share`, `allow`), with the report's `kept` filled; the gate reads the
    config's own `dataset_prepared_path` setting and writes nothing there. Raises CheckFailed."""
    report = dataset_report(tc, allow)
    report.kept = [sc.to_dict() for sc in dataset_gate(cfg, tc, allow, None, by_content(report.fingerprint))]
    return report


def _load_tokenizer(base: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base)
    except Exception:  # hub id not cached offline: the length check is skipped
        return None


def axolotl_view(tc: TrainingConfig, prepared: Path | None = None) -> dict:
    """The config as axolotl will read it, minus the run's own settings: absolute paths, the
    pipeline's plugin, `revision_of_model` from `base_model_revision`; `prepared`: the run's keyed
    `dataset_prepared_path` (pipeline.train.prepared)."""
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
    if prepared is not None:
        d["dataset_prepared_path"] = str(prepared)
    elif d.get("dataset_prepared_path"):
        d["dataset_prepared_path"] = str(Path(d["dataset_prepared_path"]).resolve())
    d["plugins"] = list(dict.fromkeys([*(d.get("plugins") or []), PLUGIN]))
    return d


def dataset_gate(
    cfg: ProjectConfig, tc: TrainingConfig, allow: set[str], keyed: Path, cache: Path
) -> list[SplitCount]:
    """What axolotl keeps of the datasets (pipeline.train.gate, axolotl's own tokenisation and
    filters with the run's tokenizer and template), read with the datasets library's cache in
    `cache` (pipeline.train.datasets_scope `by_content`: the files' current bytes, whatever their
    mtime; no progress bars); `keyed`: the run's keyed `dataset_prepared_path`; raises CheckFailed for a split with nothing
    kept, or more than `train.max_dropped_share` dropped (unless --allow dataset.dropped).
    Returns [] when the base's tokenizer or config cannot be read here (a hub id not cached
    offline): axolotl then counts at training time as before."""
    with scoped(cache):
        try:
            counts = count_kept(axolotl_view(tc, keyed))
        except GateUnavailable as e:  # no base config / tokenizer here: axolotl counts at training time
            log.warning("dataset gate skipped (the base cannot be read here: %s)", e)
            return []
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckFailed(f"{tc.path}: axolotl cannot prepare the datasets: {e}") from None
    problems = gate_problems(counts, cfg.train.max_dropped_share, allow)
    if problems:
        raise CheckFailed("dataset gate (what axolotl would keep):\n  " + "\n  ".join(problems))
    for sc in counts:
        if sc.dropped or sc.truncated:
            log.warning(
                "%s: axolotl drops %d of %d conversations (%s)%s",
                sc.split,
                sc.dropped,
                sc.conversations,
                sc.reasons(),
                f", truncates {sc.truncated}" if sc.truncated else "",
            )
    return counts
