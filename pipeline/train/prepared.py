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
tokenized the same rows (`pipeline.train.gate`). Both read the rows through the datasets
library's cache, which keys a local file by its path and mtime, not its bytes: a file rewritten
with its old mtime (`cp -p`, `rsync -a`) gave the old rows. So both run with that cache in a
directory named by the data files' bytes (`pipeline.train.datasets_scope.by_content`): it can only
hold the current bytes' rows, the second pass is cheap, and runs on the same data share it. Each split is built by axolotl's own functions in the
order `_load_raw_datasets` applies them; its rows must number what the gate kept (else
CheckFailed: the files changed between the two); it is saved into a temporary directory and
renamed into place, so a directory that exists is complete. The trainer finds it and tokenizes
nothing (on a real dataset, one tokenization instead of two; on the tiny CPU config ~7 s per
training, most of it the process pool that `Dataset.save_to_disk` starts even for `num_proc=1`
(datasets 4.8 `arrow_dataset.py`), which a save from here does not use).

A temporary directory is `.<md5>.<random>`, its writer holding the lock file `<it>.lock` (a
`filelock` flock, which the kernel releases when the writer dies, SIGKILL too); a write first
removes those whose lock is free, what a killed writer left, never a live writer's.

`root` is the config's `dataset_prepared_path` (a relative one from the project root, as
pipeline.yaml's own paths: it is where the pipeline keeps things, not an input read from where
the user stands) or `<state_dir>/prepared`; `prepared_dir` creates the key directory and refuses
one this user cannot write (VolumeError, exit 2) before a run directory or MLflow run exists;
`prune` keeps the newest `KEEP` keys there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from pipeline.artifacts.fingerprint import training_inputs
from pipeline.artifacts.locks import private_lock, try_lock
from pipeline.errors import CheckFailed, VolumeError
from pipeline.train.datasets_scope import cache_dir, scoped
from pipeline.train.gate import axolotl_cfg

log = logging.getLogger("pipeline.train")

KEEP = 4  # prepared keys kept under one root (the newest by modification time)
# The packages whose code turns rows into token ids.
TOKENIZING_PACKAGES = ("axolotl", "datasets", "transformers", "tokenizers")
KEY = re.compile(r"[0-9a-f]{16}")  # a keyed directory's name (axolotl's own are 32 digits)
COMPLETE = "state.json"  # Dataset.save_to_disk writes it after the data and dataset_info.json
# A writer's temporary split directory `.<md5>.<random>`, or its lock file `<it>.lock` (module doc);
# `tempfile.mkdtemp`'s names (`[a-z0-9_]`, before the locks) match too.
TEMP = re.compile(r"(\.[0-9a-f]{32}\.[a-z0-9_]+)(\.lock)?")


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


def prepared_root(config: dict, state_dir: Path, project_root: Path | None = None) -> Path:
    """Where keyed prepared datasets go (absolute): the config's `dataset_prepared_path`, a relative
    one taken from `project_root` (the directory of pipeline.yaml, `ProjectConfig.root`; None: the
    working directory) as pipeline.yaml's own paths are; else `<state_dir>/prepared` (axolotl's own
    default, `last_run_prepared` in the working directory, would be shared by every project started
    there)."""
    given = config.get("dataset_prepared_path")
    if not given:
        return Path(state_dir).resolve() / "prepared"
    path = Path(given)
    return (path if path.is_absolute() else Path(project_root or Path.cwd()) / path).resolve()


def prepared_dir(
    config: dict, dataset_fingerprint: str, state_dir: Path, project_root: Path | None = None
) -> Path:
    """The run's keyed `dataset_prepared_path`, `prepared_root(...)/prepared_key(...)`, created.

    Raises VolumeError (exit 2) naming it and the setting to change when this user cannot create
    it or write in it (a file in the way, permissions, a read-only or full filesystem)."""
    keyed = prepared_root(config, state_dir, project_root) / prepared_key(dataset_fingerprint, config)
    try:
        keyed.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=keyed):
            pass
    except OSError as e:
        if config.get("dataset_prepared_path"):
            what = f"dataset_prepared_path {keyed.parent}"
            fix = (
                "set dataset_prepared_path (in the training config, or --set dataset_prepared_path=DIR) to "
                "a directory this user can write, or leave it out to use <state_dir>/prepared"
            )
        else:
            what = f"the prepared datasets' directory {keyed.parent} (<state_dir>/prepared)"
            fix = "set state_dir in pipeline.yaml (or $PIPELINE_STATE_DIR) to a directory this user can write"
        raise VolumeError(
            f"{what}: cannot write the prepared datasets there "
            f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); {fix}"
        ) from None
    return keyed


def write_prepared(
    data: dict, tokenizer=None, kept: dict[str, int] | None = None, cache: Path | None = None
) -> list[Path]:
    """Write axolotl's prepared dataset of each split of `data` (the config as axolotl reads it, with
    its `dataset_prepared_path` already keyed) where axolotl's trainer looks for it; returns the
    split directories. A complete one already there is kept (same key, same content). The rows are
    read from the files' bytes, whatever their mtime (the module doc), without progress bars;
    temporary directories of dead writers are removed first.

    `cache`: the datasets library's cache for the rows (`datasets_scope.by_content`; default
    `datasets_scope.cache_dir` of the key). `kept`: rows the dataset gate kept per split ("train", "test"; `SplitCount.kept`), checked
    before de-duplication. Nothing is written when axolotl would not load a prepared dataset
    (`skip_prepare_dataset`, streaming, pretraining datasets) or would look on the hub first
    (`push_dataset_to_hub`). Raises CheckFailed when a split's rows differ from `kept` (nothing
    written for it), what axolotl raises on a dataset (the gate ran the same functions before, so
    in practice nothing) and OSError when the directory cannot be written.
    """
    from axolotl.loaders import load_tokenizer

    cfg = axolotl_cfg(data)
    if cfg.skip_prepare_dataset or cfg.streaming or cfg.pretraining_dataset or cfg.push_dataset_to_hub:
        return []
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    root = Path(cfg.dataset_prepared_path)
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)  # in use: `prune` keeps the newest
    for gone in remove_stale(root):
        log.debug("removed %s, left by a writer that died", gone)
    out = []
    with scoped(cache or cache_dir(root)):
        for split, key in (("train", "datasets"), ("test", "test_datasets")):
            if cfg.get(key):
                out.append(_write_split(cfg, tok, root, split, key, (kept or {}).get(split)))
    return out


def _write_split(cfg, tok, root: Path, split: str, key: str, kept: int | None) -> Path:
    from axolotl.utils.data.sft import _load_and_process_single_dataset
    from axolotl.utils.data.shared import (
        datasets_with_name_generator,
        generate_dataset_hash_from_config,
        merge_datasets,
    )
    from axolotl.utils.data.utils import deduplicate_and_log_datasets, handle_long_seq_in_dataset
    from axolotl.utils.trainer import process_datasets_for_packing

    final = root / generate_dataset_hash_from_config(cfg, cfg[key], tok.name_or_path)
    if (final / COMPLETE).is_file():
        return final
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
    if kept is not None and len(ds) != kept:
        raise CheckFailed(
            f"{key} ({', '.join(str(d.get('path')) for d in cfg[key])}): the prepared {split} split has "
            f"{len(ds)} rows where the dataset gate kept {kept}: the data files changed after they were "
            "checked? Run again once nothing writes them"
        )
    if cfg.dataset_exact_deduplication:
        ds, _ = deduplicate_and_log_datasets(dataset=ds)
    with _temporary(root, final.name) as tmp:
        ds.save_to_disk(str(tmp))  # one process: no pool (see the module docstring)
        if final.exists():  # part-written by a trainer killed while saving, or another run's
            if (final / COMPLETE).is_file():
                return final
            shutil.rmtree(final)
        os.rename(tmp, final)
    return final


def _lock_of(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")


@contextlib.contextmanager
def _temporary(root: Path, name: str):
    """A new directory `root/.<name>.<random>`, its lock file held until the block ends (module
    doc); both removed then, the directory unless renamed away."""
    tmp = root / f".{name}.{secrets.token_hex(4)}"
    lock = private_lock(_lock_of(tmp))
    lock.acquire(timeout=0)  # a new name: nobody else holds it
    try:
        tmp.mkdir()
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _lock_of(tmp).unlink(missing_ok=True)
        lock.release()


def remove_stale(root: Path) -> list[Path]:
    """Remove the temporary directories (and lock files) under `root` whose writer is gone: its lock
    is free (the kernel released it when the writer died); returns them. A live writer's stay."""
    gone = []
    for p in sorted(Path(root).iterdir()):
        m = TEMP.fullmatch(p.name)
        if not m or (m[2] and p.with_name(m[1]).exists()):  # a lock file beside its directory: with it
            continue
        tmp = p.with_name(m[1])
        with try_lock(_lock_of(tmp)) as free:
            if free:
                shutil.rmtree(tmp, ignore_errors=True)
                _lock_of(tmp).unlink(missing_ok=True)
                gone.append(p)
    return gone


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
