"""Read an axolotl YAML, apply `--set` overrides, and refuse what a hot-loading vLLM fleet cannot serve.

The axolotl schema itself is axolotl's to validate (it does so when training starts); what axolotl
allows but the fleet does not is decided by the same rule set `pipeline validate` runs
(`pipeline.validate`, scope "train": vLLM's refusals, ranks, templates, tokens, sample packing on
Gated DeltaNet...), before anything is written; plus the inputs the pipeline must find.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline.artifacts.bounded import MIB, BoundsError, load_yaml_file, loads_yaml
from pipeline.errors import CheckFailed, UsageError

if TYPE_CHECKING:
    from pipeline.validate.report import FleetRules

# Short ids `pipeline train --allow` accepted before the rules were unified, mapped to the rule ids
# (pipeline.validate: one rule set for `train` and `validate`, docs/validation.md).
LEGACY_ALLOW = {
    "dora": "config.dora",
    "modules_to_save": "config.modules_to_save",
    "embedding_targets": "config.embedding_targets",
    "rank": "config.rank",
    "qlora": "train.qlora",
    "unpinned_base": "train.unpinned_base",
    "adapter": "config.peft_type",
    "targets": "config.required",
    "base_model": "train.base_model",
}


def allowable() -> dict[str, str]:
    """Every id `--allow` accepts, with its doc line: every finding id of the catalogue
    (pipeline.validate.catalogue: the rules, dataset.*, fleet.*, canary.*), the legacy short ids, and the GPU
    preflight's memory estimate (pipeline.train.preflight.logits_memory_problem). Also `ALLOWABLE`."""
    # reading a config (and refusing its key typos) must not pay for pipeline.validate's ~0.8 s of imports
    from pipeline.validate.catalogue import catalogue  # lazy: ~0.8 s, see above
    from pipeline.validate.rules import RULES  # lazy: as above

    return (
        {i: e.doc for i, e in catalogue().items()}
        | {k: RULES[v].doc for k, v in LEGACY_ALLOW.items()}
        | {"logits_memory": "the materialised logits plus weights are estimated not to fit the detected GPU"}
        | {
            "dataset.dropped": "axolotl would drop more than train.max_dropped_share of the conversations or "
            "trainable tokens"
        }
    )


def __getattr__(name: str):  # `ALLOWABLE`, computed when first asked for (`allowable`)
    if name == "ALLOWABLE":
        return allowable()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class TrainingConfig:
    """An axolotl config as a dict plus where it came from."""

    path: Path
    data: dict
    # where a top-level or dotted key was last set from, when not the config file itself:
    # an overlay's path or `--set key=value` (error messages name it)
    origins: dict[str, str] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.dump().encode()).hexdigest()

    def dump(self) -> str:
        return yaml.safe_dump(self.data, sort_keys=True)

    def dataset_paths(self, key: str) -> list[Path]:
        return [Path(d["path"]) for d in self.data.get(key) or [] if isinstance(d, dict) and "path" in d]


MAX_YAML_BYTES = 4 * MIB  # an axolotl config (or overlay); pipeline.artifacts.bounded


def parse_override(item: str) -> tuple[str, object]:
    """`key=value` (value parsed as YAML, dotted keys for nesting) -> (key, value).

    Raises UsageError when there is no `=`.
    """
    if "=" not in item:
        raise UsageError(f"--set {item!r}: expected key=value, e.g. --set max_steps=20")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), loads_yaml(raw, f"--set {key.strip()}") if raw else None
    except BoundsError as e:
        raise UsageError(str(e)) from e
    except yaml.YAMLError as e:
        raise UsageError(
            f"--set {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)}); "
            "quote it or fix the brackets"
        ) from e


def _read_yaml(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: axolotl config not found")
    try:
        data = load_yaml_file(path, MAX_YAML_BYTES)
    except BoundsError as e:
        raise UsageError(f"{e}: not an axolotl config") from e
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: not a text file (byte {e.start} is not UTF-8): give an axolotl YAML"
        ) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UsageError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: top level must be a mapping")
    return data


def _merge(base: dict, overlay: dict) -> dict:
    """Deep-merge mappings (overlay wins; lists are replaced, not appended)."""
    out = dict(base)
    for k, v in overlay.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_training_config(path: Path, overrides: list[str] = (), overlays: list[Path] = ()) -> TrainingConfig:
    """Load an axolotl YAML, deep-merge overlay files (e.g. `axolotl_configs/fsdp2.yml`), apply overrides.

    Raises:
        UsageError: a file missing, not YAML, or not a mapping (message names the file and line).
    """
    path = Path(path)
    data = _read_yaml(path)
    origins: dict[str, str] = {}
    for ov in overlays:
        layer = _read_yaml(ov)
        data = _merge(data, layer)
        origins.update(dict.fromkeys(layer, str(ov)))
    for item in overrides:
        key, value = parse_override(item)
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p, {}), dict):
                raise UsageError(f"--set {item!r}: {p!r} is not a mapping in {path}")
            node = node.setdefault(p, {})
        node[leaf] = value
        origins[key] = f"--set {item}"
    return TrainingConfig(path=path, data=data, origins=origins)


def _rules(fleet) -> FleetRules:
    from pipeline.validate.report import FleetRules  # lazy: pipeline.validate costs ~0.8 s (`allowable`)

    return fleet if isinstance(fleet, FleetRules) else FleetRules(max_lora_rank=int(fleet))


def _allowed(allow) -> set[str]:
    return {LEGACY_ALLOW.get(a, a) for a in allow}


def training_findings(
    tc: TrainingConfig, fleet, allow: set[str] = frozenset(), served_dir: Path | None = None, packing=None
):
    """Findings of the shared rule set (`pipeline.validate`, scope "train") on the config, minus allowed ids.

    `fleet` is a `FleetRules` (or, as before, just the fleet's max_lora_rank). `packing`: the GPU preflight's
    sample-packing problems (`pipeline.train.preflight.packing_problems`), reported as `train.sample_packing`.
    """
    from pipeline.validate.train_checks import check_training  # lazy: as in `allowable`

    rules = _rules(fleet)
    return check_training(
        tc.data, str(tc.path), rules, served_dir or rules.served_path, _allowed(allow), packing=packing
    ).findings


def servability_problems(
    tc: TrainingConfig, max_lora_rank, allow: set[str] = frozenset()
) -> list[tuple[str, str]]:
    """(check id, message) for each error the fleet's rules find in the config, minus the allowed ids."""
    return [
        (f.id, f"{f.where}: {f.message}")
        for f in training_findings(tc, max_lora_rank, allow)
        if f.severity == "error"
    ]


def _hub_id(name: str) -> bool:
    """Whether `name` can be a Hugging Face repo id (`org/name`; not `/abs`, `./rel`, `a/b/c`, `~/x`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _relative_note(p: Path) -> str:
    return "" if p.is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _where(tc: TrainingConfig, key: str) -> str:
    """Where top-level `key` was set: the config file, an overlay, or `<config> (--set key)`."""
    origin = tc.origins.get(key)
    if origin is None:
        return str(tc.path)
    return f"{tc.path} ({origin.split('=', 1)[0]})" if origin.startswith("--set ") else origin


def missing_inputs(tc: TrainingConfig) -> list[str]:
    """One message per input the config names that is not here, [] when all are; no file is read.

    - each `datasets` / `test_datasets` entry's `path` that does not exist, named by the entry
      (`datasets[1]`), where it was set (the config file, an overlay or `--set`) and its `type`;
    - a `base_model` that is no directory here and cannot be a hub id (an absolute or `./`
      path, more than one `/`): a base directory that was moved or deleted. (`org/name` is read as
      a hub id; `train.unpinned_base` then says what it needs.)
    """
    msgs = []
    base = str(tc.data.get("base_model") or "")
    if base and not Path(base).exists() and not _hub_id(base):
        msgs.append(
            f"{_where(tc, 'base_model')}: base_model {base} does not exist{_relative_note(Path(base))}: "
            "the base model directory was moved or deleted (a path, not a hub id); point base_model at the "
            "directory that holds its config.json and safetensors (edit the config, or --set base_model=DIR)"
        )
    for key in ("datasets", "test_datasets"):
        for i, entry in enumerate(tc.data.get(key) or []):
            p = Path(entry["path"])
            if not p.exists():
                kind = f" (type {entry['type']})" if entry.get("type") else ""
                msgs.append(
                    f"{_where(tc, key)}: {key}[{i}]{kind} path {p} does not exist"
                    f"{_relative_note(p)}: restore the file or point this entry's path at it"
                )
    return msgs


def check_dataset_entries(tc: TrainingConfig) -> None:
    """Raise UsageError unless `datasets` / `test_datasets` are lists of mappings with a `path`."""
    for key in ("datasets", "test_datasets"):
        value = tc.data.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(d, dict) and d.get("path") for d in value)
        ):
            raise UsageError(
                f"{tc.path}: {key} must be a list of mappings with a path, e.g. "
                f"--set '{key}=[{{path: data/train.jsonl, ds_type: json, type: chat_template}}]'; got {value!r}"
            )


def check_training_config(
    tc: TrainingConfig, max_lora_rank, allow: set[str] = frozenset(), packing: list[str] | None = None
) -> list:
    """Raise CheckFailed listing every unservable setting. Reads no data file: milliseconds (the base's
    config and tokenizer at most).

    `max_lora_rank` is the fleet's `FleetRules` (or its max rank); `packing` the GPU preflight's packing
    problems (`pipeline.train.preflight.packing_problems`). Returns the warnings (e.g.
    `config.patterns_ignored`: publish will fold the patterns) for the caller to print.

    Raises:
        UsageError (exit 2): an unknown `--allow` id, a malformed `datasets` list, or an input that is
            not there (`missing_inputs`: a data file, a moved base directory), before any rule runs.
        CheckFailed (exit 1): a rule's error, or no `datasets`.
    """
    allowed = allowable()
    unknown = set(allow) - set(allowed)
    if unknown:
        raise UsageError(f"--allow {sorted(unknown)}: unknown check id; allowed: {sorted(allowed)}")
    check_dataset_entries(tc)
    if missing := missing_inputs(tc):
        raise UsageError("\n  ".join(missing))  # the first line (`pipeline run`'s JSON reason) names one
    findings = training_findings(tc, max_lora_rank, set(allow), packing=packing)
    msgs = [
        f"{f.where}: {f.message} [{f.id}] (override with --allow {f.id})"
        for f in findings
        if f.severity == "error"
    ]
    if not tc.data.get("datasets"):
        msgs.append(f"{tc.path}: no datasets")
    if msgs:
        raise CheckFailed("training config refused:\n  " + "\n  ".join(msgs))
    return [f for f in findings if f.severity != "error"]
