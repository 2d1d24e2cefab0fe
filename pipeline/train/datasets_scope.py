"""The datasets library's cache, scoped to a prepared-datasets key, so rows come from the files' bytes.

axolotl 0.19 loads a local data file with `datasets.load_dataset(<ds_type>, data_files=<path>)`
and no `cache_dir` (`axolotl.utils.data.shared._load_from_local_path`). datasets 4.8 caches the
loaded rows under `$HF_DATASETS_CACHE` in a directory named by the builder's `config_id`, a hash of
the data files' paths and "origin metadata", which for a local file is its mtime and nothing else
(`datasets.data_files._get_single_origin_metadata`, `datasets.builder.BuilderConfig.create_config_id`);
every `Dataset.map` after it (axolotl's tokenization) caches beside those rows, fingerprinted from
them. A file rewritten with other rows but its old mtime (`cp -p`, `rsync -a`, `touch -r`) so
loaded the old rows: measured, the gate counted 15519 tokens for a rewrite that holds 29590 and
the new key's prepared dataset held the old rows.

The one setting that reaches every load and map of the run is the cache's location: the builder
reads it when it is made (`DatasetBuilder.__init__`: `cache_dir or config.HF_DATASETS_CACHE`),
from `$HF_DATASETS_CACHE` at import. `scoped(where)` sets it in this process while the gate counts
and `write_prepared` writes; as `$HF_DATASETS_CACHE` it reaches the trainer (which tokenizes only
when nothing was prepared here). `where` is `by_content(fingerprint)`: a directory of the library's
own cache named by the data files' bytes (`DatasetReport.fingerprint`), so it can only hold rows of
those bytes, and runs and projects reading the same bytes share it (a second pass, the next
training on unchanged data, the test suite's many trainings on the shipped files: tokenized once).
`cache_dir(keyed)` (under a prepared key) is the fallback where no fingerprint is at hand.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CACHE = "hf-datasets"  # under a keyed dataset_prepared_path; axolotl reads only its <md5> directories


def cache_dir(keyed: Path) -> Path:
    """The datasets library's cache directory for the key directory `keyed`."""
    return Path(keyed) / CACHE


def by_content(dataset_fingerprint: str) -> Path:
    """`<the datasets library's cache ($HF_DATASETS_CACHE)>/pipeline-by-content/<first 16 hex digits
    of dataset_fingerprint>` (`DatasetReport.fingerprint`: every data file's bytes and role). Not
    created here; call it outside `scoped` (which moves the library's cache)."""
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "pipeline-by-content" / dataset_fingerprint[:16]


@contextlib.contextmanager
def scoped(where: Path):
    """For the block: the datasets library caches under `where` (created; `by_content` or
    `cache_dir`) and shows no progress bars (they would go to the CLI's stderr); both settings are
    restored after. Raises OSError when the directory cannot be created."""
    import datasets
    from datasets import config

    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    was_cache, was_bars = config.HF_DATASETS_CACHE, datasets.is_progress_bar_enabled()
    config.HF_DATASETS_CACHE = where
    datasets.disable_progress_bars()
    try:
        yield where
    finally:
        config.HF_DATASETS_CACHE = was_cache
        if was_bars:
            datasets.enable_progress_bars()
