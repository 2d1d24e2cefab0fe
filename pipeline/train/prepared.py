"""axolotl's prepared (tokenized) datasets: keyed by what they are made of, written once, whole.

axolotl caches each split's tokenized dataset under `dataset_prepared_path/<md5>` and loads it on
the next run whenever that directory is not empty. The md5 covers the dataset entries' options,
`sequence_len`, packing and the tokenizer's *name*, not the bytes of the data files or of the
tokenizer, nor options such as `excess_length_strategy`, `min_sample_len` or `eval_sequence_len`
(axolotl 0.19 `axolotl.utils.data.shared.generate_dataset_hash_from_config` and
`load_preprocessed_dataset`). Measured: 60 rows appended to a training file, `pipeline train`
again: the trainer loaded the 120-row copy from the first run while the manifest recorded the new
file's sha256 and 180 rows kept; the adapter's lineage named data it was never trained on. A
trainer killed while saving leaves a part-written directory that every later run loads too.

So the pipeline gives each run a `dataset_prepared_path` of its own content: `<root>/<key>`, where
the key covers the dataset files' bytes, the whole training config (minus locations), the base,
its tokenizer files' bytes and the versions of the packages that tokenize. Then it writes
axolotl's prepared datasets there itself, in this process, right after the dataset gate has
tokenized the same rows (`pipeline.train.gate`: the datasets library's cache makes the second pass
cheap): each split is built by axolotl's own functions in the order `_load_raw_datasets` applies
them, saved into a temporary directory and renamed into place, so a directory that exists is
complete. The trainer finds it and tokenizes nothing (on a real dataset, one tokenization instead
of two; on the tiny CPU config ~7 s per training, most of it the process pool that
`Dataset.save_to_disk` starts even for `num_proc=1` (datasets 4.8 `arrow_dataset.py`), which a
save from here does not use).

`root` is the config's `dataset_prepared_path` or `<state_dir>/prepared`; `prune` keeps the newest
`KEEP` keys there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from pipeline.artifacts.fingerprint import training_inputs
from pipeline.train.gate import axolotl_cfg

log = logging.getLogger("pipeline.train")

KEEP = 4  # prepared keys kept under one root (the newest by modification time)
# The packages whose code turns rows into token ids.
TOKENIZING_PACKAGES = ("axolotl", "datasets", "transformers", "tokenizers")
KEY = re.compile(r"[0-9a-f]{16}")  # a keyed directory's name (axolotl's own are 32 digits)
COMPLETE = "state.json"  # Dataset.save_to_disk writes it after the data and dataset_info.json


def prepared_key(dataset_fingerprint: str, config: dict) -> str:
    """Hex sha256 (first 16 digits) of what axolotl's prepared datasets are made of.

    `dataset_fingerprint`: `DatasetReport.fingerprint` (every data file's bytes); `config`: the
    training config (`TrainingConfig.data`).
    """
    parts = {
        "inputs": training_inputs(dataset_fingerprint, config)["fingerprint"],  # tokenizer bytes too
        "packages": {p: _version(p) for p in TOKENIZING_PACKAGES},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def prepared_root(config: dict, state_dir: Path) -> Path:
    """Where keyed prepared datasets go: the config's `dataset_prepared_path` (absolute), else
    `<state_dir>/prepared` (axolotl's own default, `last_run_prepared` in the working directory,
    would be shared by every project started there)."""
    given = config.get("dataset_prepared_path")
    return Path(given).resolve() if given else Path(state_dir).resolve() / "prepared"


def write_prepared(data: dict, tokenizer=None) -> list[Path]:
    """Write axolotl's prepared dataset of each split of `data` (the config as axolotl reads it, with
    its `dataset_prepared_path` already keyed) where axolotl's trainer looks for it; returns the
    split directories. A complete one already there is kept (same key, same content).

    Nothing is written when axolotl would not load a prepared dataset (`skip_prepare_dataset`,
    streaming, pretraining datasets) or would look on the hub first (`push_dataset_to_hub`).
    Raises what axolotl raises on a dataset (the gate ran the same functions before, so in practice
    nothing) and OSError when the directory cannot be written.
    """
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data.sft import _load_and_process_single_dataset
    from axolotl.utils.data.shared import (
        datasets_with_name_generator,
        generate_dataset_hash_from_config,
        merge_datasets,
    )
    from axolotl.utils.data.utils import deduplicate_and_log_datasets, handle_long_seq_in_dataset
    from axolotl.utils.trainer import process_datasets_for_packing

    cfg = axolotl_cfg(data)
    if cfg.skip_prepare_dataset or cfg.streaming or cfg.pretraining_dataset or cfg.push_dataset_to_hub:
        return []
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    root = Path(cfg.dataset_prepared_path)
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)  # in use: `prune` keeps the newest
    out = []
    for split, key in (("train", "datasets"), ("test", "test_datasets")):
        if not cfg.get(key):
            continue
        final = root / generate_dataset_hash_from_config(cfg, cfg[key], tok.name_or_path)
        out.append(final)
        if (final / COMPLETE).is_file():
            continue
        # axolotl 0.19 `_load_raw_datasets`: load and wrap each entry, merge (shuffled by seed), drop or
        # cut by length, pack, de-duplicate; tests/train/test_prepared.py compares with it.
        parts = [
            _load_and_process_single_dataset(
                dataset_config=d, cfg=cfg, tokenizer=tok, split=split, seed=cfg.seed
            )[0]
            for d in datasets_with_name_generator(cfg[key])
        ]
        ds = merge_datasets(parts, cfg)
        seq = cfg.eval_sequence_len if split == "test" and cfg.eval_sequence_len else cfg.sequence_len
        ds = handle_long_seq_in_dataset(ds, seq, cfg)
        if (split == "train" and cfg.sample_packing) or (split == "test" and cfg.eval_sample_packing):
            ds, _ = process_datasets_for_packing(cfg, ds, None)
        if cfg.dataset_exact_deduplication:
            ds, _ = deduplicate_and_log_datasets(dataset=ds)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            ds.save_to_disk(str(tmp))  # one process: no pool (see the module docstring)
            if final.exists():  # part-written by a trainer killed while saving, or another run's
                if (final / COMPLETE).is_file():
                    continue
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prune(root: Path, current: Path, keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` newest keyed directories under `root` (never `current`); returns them.

    A trainer still reading a removed one is not disturbed (its files stay open); a run that needs it
    again writes it again."""
    keyed = [p for p in Path(root).iterdir() if p.is_dir() and KEY.fullmatch(p.name) and p != current]
    keyed.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    gone = keyed[max(0, keep - 1) :]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
