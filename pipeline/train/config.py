"""Read an axolotl YAML, apply `--set` overrides, and refuse what a hot-loading vLLM fleet cannot serve.

The axolotl schema itself is axolotl's to validate (it does so when training starts); this
module only checks what axolotl allows but the fleet does not (vllm/lora/peft_helper.py and
`--max-lora-rank`), plus the inputs the pipeline must find before starting a trainer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.errors import CheckFailed, UsageError
from pipeline.serving.vllm import EMBEDDING_MODULES, LORA_RANKS

# Check ids that `pipeline train --allow ID` may override, with why the fleet refuses them.
ALLOWABLE = {
    "dora": "DoRA adapters are rejected by vLLM (use_dora)",
    "modules_to_save": "modules_to_save (full copies of modules) are rejected by vLLM",
    "embedding_targets": "embed_tokens/lm_head LoRA needs a fleet that enables them (and 2.5 GB extra per adapter)",
    "rslora": "rsLoRA scales by alpha/sqrt(r); the pipeline folds it into lora_alpha only on request",
    "rank": "lora_r outside vLLM's ranks or above the fleet's max_lora_rank cannot load",
    "qlora": "a QLoRA adapter is trained against a 4-bit base, not the bf16 base the fleet's was quantised from",
    "unpinned_base": "a hub base without base_model_revision can change under you",
    "logits_memory": "the materialised logits plus weights are estimated not to fit the detected GPU",
}


@dataclass
class TrainingConfig:
    """An axolotl config as a dict plus where it came from."""

    path: Path
    data: dict

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.dump().encode()).hexdigest()

    def dump(self) -> str:
        return yaml.safe_dump(self.data, sort_keys=True)

    def dataset_paths(self, key: str) -> list[Path]:
        return [Path(d["path"]) for d in self.data.get(key) or [] if isinstance(d, dict) and "path" in d]


def parse_override(item: str) -> tuple[str, object]:
    """`key=value` (value parsed as YAML, dotted keys for nesting) -> (key, value).

    Raises UsageError when there is no `=`.
    """
    if "=" not in item:
        raise UsageError(f"--set {item!r}: expected key=value, e.g. --set max_steps=20")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw else None
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
        data = yaml.safe_load(path.read_text())
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
    for ov in overlays:
        data = _merge(data, _read_yaml(ov))
    for item in overrides:
        key, value = parse_override(item)
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return TrainingConfig(path=path, data=data)


def servability_problems(
    tc: TrainingConfig, max_lora_rank: int, allow: set[str] = frozenset()
) -> list[tuple[str, str]]:
    """(check id, message) for each setting the fleet cannot serve, minus the allowed ids."""
    d = tc.data
    where = str(tc.path)
    problems: list[tuple[str, str]] = []
    adapter = d.get("adapter")
    if adapter not in ("lora", "qlora"):
        problems.append(
            ("adapter", f"{where}: adapter is {adapter!r}; the fleet hot-loads LoRA: set `adapter: lora`")
        )
    elif adapter == "qlora":
        problems.append(
            ("qlora", f"{where}: adapter: qlora trains against a 4-bit base: use `adapter: lora`")
        )
    if d.get("peft_use_dora"):
        problems.append(("dora", f"{where}: peft_use_dora: true; vLLM rejects DoRA adapters: remove it"))
    if d.get("lora_modules_to_save"):
        problems.append(
            (
                "modules_to_save",
                f"{where}: lora_modules_to_save {d['lora_modules_to_save']} is rejected by vLLM: remove it",
            )
        )
    targets = d.get("lora_target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    emb = sorted(set(targets) & EMBEDDING_MODULES)
    if emb:
        problems.append(
            (
                "embedding_targets",
                f"{where}: lora_target_modules includes {emb}; not servable by a hot-loading fleet",
            )
        )
    if not targets and not d.get("lora_target_linear"):
        problems.append(("targets", f"{where}: no lora_target_modules: list the projections to adapt"))
    if d.get("peft_use_rslora"):
        problems.append(
            ("rslora", f"{where}: peft_use_rslora: true; use plain LoRA scaling (alpha/r) for the fleet")
        )
    r = d.get("lora_r")
    if not isinstance(r, int) or r not in LORA_RANKS or r > max_lora_rank:
        problems.append(
            (
                "rank",
                f"{where}: lora_r {r!r} must be one of vLLM's ranks {LORA_RANKS} and <= the fleet's "
                f"max_lora_rank {max_lora_rank}",
            )
        )
    base = str(d.get("base_model", ""))
    if not base:
        problems.append(("base_model", f"{where}: base_model is missing"))
    elif not Path(base).exists() and not d.get("base_model_revision"):
        problems.append(
            (
                "unpinned_base",
                f"{where}: base_model {base!r} is a hub id without base_model_revision: pin a commit sha",
            )
        )
    return [(cid, msg) for cid, msg in problems if cid not in allow]


def check_training_config(tc: TrainingConfig, max_lora_rank: int, allow: set[str] = frozenset()) -> None:
    """Raise CheckFailed listing every unservable setting and every missing dataset file."""
    unknown = set(allow) - set(ALLOWABLE)
    if unknown:
        raise UsageError(f"--allow {sorted(unknown)}: unknown check id; allowed: {sorted(ALLOWABLE)}")
    for key in ("datasets", "test_datasets"):
        value = tc.data.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(d, dict) and d.get("path") for d in value)
        ):
            raise UsageError(
                f"{tc.path}: {key} must be a list of mappings with a path, e.g. "
                f"--set '{key}=[{{path: data/train.jsonl, ds_type: json, type: chat_template}}]'; got {value!r}"
            )
    msgs = [
        f"{m} (override with --allow {cid})" if cid in ALLOWABLE else m
        for cid, m in servability_problems(tc, max_lora_rank, set(allow))
    ]
    for key in ("datasets", "test_datasets"):
        for p in tc.dataset_paths(key):
            if not p.exists():
                msgs.append(f"{tc.path}: {key} path {p} does not exist")
    if not tc.data.get("datasets"):
        msgs.append(f"{tc.path}: no datasets")
    if msgs:
        raise CheckFailed("training config refused:\n  " + "\n  ".join(msgs))
