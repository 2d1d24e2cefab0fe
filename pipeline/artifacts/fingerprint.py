"""The input fingerprint of an adapter: one hex sha256 over what determines its weights.

Computed here and only here, from these parts:

- the dataset fingerprint (`pipeline.train.dataset`: sha256 over each file's bytes and role);
- the *inputs* hash of the axolotl config: the resolved config minus the keys that only say
  where things are or where progress is reported (`LOCATION_KEYS`, each dataset's `path`: its
  bytes are in the dataset fingerprint; `base_model`: in the base identity). So `make demo`
  (which passes an absolute `base_model` and `dataset_prepared_path`) and `pipeline run` on the
  same YAML from the project root agree;
- the base identity: a local base directory by the sha256 of its config and safetensors
  headers (its path does not matter), a hub base by id and pinned revision;
- the tokenizer's bytes: its files in `tokenizer_config` or the local base directory (the chat
  template decides every token the adapter is trained on; a base whose template was fixed in place
  has the same headers). A hub tokenizer adds nothing (its revision is in the base identity);
- which file goes with which dataset entry (`dataset_entries_sha256`): each `datasets` /
  `test_datasets` entry's file sha256, in entry order. The first two parts cannot tell: the config
  inputs keep each entry's options without its path, the dataset fingerprint each file's role and
  bytes, sorted. So two entries with different options (`type`, `roles`, `split`, field mappings)
  whose files were swapped trained differently under the same fingerprint. Only a list with more
  than one entry adds it: one entry per list is paired by role already, and its fingerprint stays
  the value it always was (no retrain after the upgrade for those configs).

`pipeline train` writes the parts and the result into the manifest (`inputs`); every
registration (`pipeline register`, `pipeline run`, `pipeline demo`) copies the result to the
version tag `run.fingerprint`; `pipeline run` skips training when a version carries it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.manifest import AdapterManifest
from pipeline.artifacts.safetensors import header_bytes

# Keys of an axolotl config that do not change the trained weights: locations, bookkeeping,
# experiment tracking. Everything else (hyperparameters, dataset options, seeds) counts.
LOCATION_KEYS = frozenset(
    {
        "base_model",
        "base_model_revision",
        "revision_of_model",
        "model_revision",
        "base_model_config",
        "tokenizer_config",
        "output_dir",
        "dataset_prepared_path",
        "resume_from_checkpoint",
        "plugins",
        "use_mlflow",
        "mlflow_tracking_uri",
        "mlflow_experiment_name",
        "mlflow_run_name",
        "hf_mlflow_log_artifacts",
        "use_wandb",
        "wandb_project",
        "wandb_entity",
        "wandb_name",
        "wandb_mode",
        "wandb_run_id",
        "wandb_watch",
        "wandb_log_model",
        "logging_steps",
        "save_total_limit",
        "hub_model_id",
    }
)
# Tracking prefixes: any key starting with one of these is bookkeeping too.
LOCATION_PREFIXES = ("mlflow_", "wandb_", "comet_", "swanlab_")
DATASET_LISTS = ("datasets", "test_datasets", "pretraining_dataset")


def _is_location(key: str) -> bool:
    return key in LOCATION_KEYS or key.startswith(LOCATION_PREFIXES)


def config_inputs(data: dict) -> dict:
    """The config with location/bookkeeping keys removed (dataset entries without `path`: which file
    goes with which entry is `dataset_entries_sha256`)."""
    out = {}
    for k, v in data.items():
        if _is_location(k):
            continue
        if k in DATASET_LISTS and isinstance(v, list):
            v = [{dk: dv for dk, dv in d.items() if dk != "path"} if isinstance(d, dict) else d for d in v]
        out[k] = v
    return out


def config_inputs_sha256(data: dict) -> str:
    """Hex sha256 of `config_inputs(data)` (canonical JSON, sorted keys)."""
    payload = json.dumps(config_inputs(data), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def base_fingerprint(base: str) -> str | None:
    """sha256 over a local base's config.json, index files and safetensors headers (weights not read).

    None when `base` is not a local directory (a hub id).
    """
    p = Path(base)
    if not p.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.name == "config.json" or f.name.endswith(".json") and "index" in f.name:
            h.update(f.read_bytes())
        elif f.suffix == ".safetensors":
            h.update(header_bytes(f))
    return h.hexdigest()


# Tokenizer and chat-template files of a local base (what transformers' AutoTokenizer reads).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_digest(path: str) -> str | None:
    """Hex sha256 over the tokenizer files (name and bytes) of a local directory; None for a hub id."""
    p = Path(path)
    if not p.is_dir():
        return None
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (p / name).is_file():
            h.update(name.encode() + b"\0" + (p / name).read_bytes())
    return h.hexdigest()


def dataset_entries_sha256(config: dict) -> str | None:
    """Hex sha256 over each `datasets` / `test_datasets` entry's file sha256, in entry order (paths
    not counted: a project moved elsewhere keeps it); None when no list has more than one entry
    (the module docstring says why). An entry whose path is not a file here counts as null (the
    checks refuse it before anything trains). Reads every data file of such a config."""
    lists = {k: config.get(k) for k in ("datasets", "test_datasets") if isinstance(config.get(k), list)}
    if not any(len(v) > 1 for v in lists.values()):
        return None
    shas = {
        k: [
            sha256_file(Path(d["path"]))
            if isinstance(d, dict) and Path(str(d.get("path"))).is_file()
            else None
            for d in v
        ]
        for k, v in lists.items()
    }
    return hashlib.sha256(json.dumps(shas, sort_keys=True).encode()).hexdigest()


def base_identity(model: str | None, revision: str | None, fingerprint: str | None) -> dict:
    """What identifies the base: its local fingerprint, else the hub id and pinned revision."""
    if fingerprint:
        return {"fingerprint": fingerprint}
    return {"id": str(model), "revision": revision}


def inputs_fingerprint(
    dataset_fingerprint: str,
    config_sha256: str,
    base: dict,
    tokenizer: str | None = None,
    entries: str | None = None,
) -> str:
    """Hex sha256 of the inputs that determine the adapter (see the module docstring). Without a
    tokenizer digest (a hub tokenizer, a manifest from before it was recorded) and without `entries`
    (`dataset_entries_sha256`: None for one entry per dataset list) the value is the one the three
    other parts always gave."""
    parts = {"dataset": dataset_fingerprint, "config": config_sha256, "base": base}
    if tokenizer:
        parts["tokenizer"] = tokenizer
    if entries:
        parts["dataset_entries"] = entries
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def training_inputs(dataset_fingerprint: str, config: dict) -> dict:
    """The manifest's `inputs` block for a config about to be trained: its parts and the fingerprint.

    `dataset_fingerprint`: `pipeline.train.dataset` (`check_datasets` or `files_fingerprint`);
    `config`: the training config, its relative paths read from the working directory. Reads the
    base's headers and tokenizer files, and the data files of a list with several entries.
    """
    base = str(config.get("base_model"))
    revision = (
        config.get("base_model_revision") or config.get("revision_of_model") or config.get("model_revision")
    )
    ident = base_identity(base, revision, base_fingerprint(base))
    cfg_sha = config_inputs_sha256(config)
    tok = tokenizer_digest(str(config.get("tokenizer_config") or base))
    entries = dataset_entries_sha256(config)
    return {
        "dataset_fingerprint": dataset_fingerprint,
        "config_inputs_sha256": cfg_sha,
        "base": ident,
        "tokenizer_sha256": tok,
        "dataset_entries_sha256": entries,
        "fingerprint": inputs_fingerprint(dataset_fingerprint, cfg_sha, ident, tok, entries),
    }


def manifest_fingerprint(manifest: AdapterManifest) -> str | None:
    """The input fingerprint an adapter's manifest records (`inputs.fingerprint`).

    A manifest from before the `inputs` block falls back to its dataset fingerprint, raw
    `config_sha256` and base: stable, but it only matches adapters trained from the very same
    config text. None when the manifest lacks the dataset fingerprint.
    """
    if manifest.inputs.fingerprint:
        return manifest.inputs.fingerprint
    if not manifest.dataset.fingerprint:
        return None
    b = manifest.base_model
    ident = base_identity(b.id, b.revision, b.fingerprint)
    return inputs_fingerprint(manifest.dataset.fingerprint, manifest.config_sha256 or "", ident)
