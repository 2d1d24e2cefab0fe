"""The dataset gate: what axolotl will keep of the run's datasets, counted by axolotl itself, before
the model loads.

axolotl tokenizes each dataset entry with its prompt strategy and the run's tokenizer and chat
template, then drops rows outside [`min_sample_len`, `sequence_len`] (`excess_length_strategy:
drop`, its default; `truncate` cuts them instead) and, with sample packing, rows without a
trainable token (axolotl 0.19 `axolotl.utils.data.sft._load_raw_datasets`,
`axolotl.utils.data.utils.handle_long_seq_in_dataset`, `axolotl.utils.trainer.process_datasets_for_packing`).
A dataset it empties this way fails only after the model is loaded (`ValueError: num_samples should
be a positive integer value, but got num_samples=0`, measured with a 52 GB base: 85 s, then a
traceback). `count_kept` runs those same functions on the same config in this process, with
nothing written but the datasets library's cache, and `gate_problems` turns the counts into a
refusal: no sample kept (never allowed), or more than a configured share of the conversations or
of the trainable tokens dropped (`train.max_dropped_share` in pipeline.yaml; `--allow dataset.dropped`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ALLOW_ID = "dataset.dropped"


class GateUnavailable(Exception):
    """The base's config or tokenizer cannot be read here (not a checkpoint, a hub id not cached offline)."""


@dataclass
class SplitCount:
    """One split ("train" or "test") as axolotl processes it: rows, tokens (input ids) and trainable
    tokens (labels != -100), before and after its filters, and why rows were dropped."""

    split: str
    sequence_len: int
    conversations: int = 0
    kept: int = 0
    tokens: int = 0
    kept_tokens: int = 0
    trainable_tokens: int = 0
    kept_trainable_tokens: int = 0
    too_long: int = 0  # > sequence_len (excess_length_strategy drop)
    too_short: int = 0  # < min_sample_len
    no_trainable: int = 0  # every label -100 (dropped with sample packing only)
    truncated: int = 0  # excess_length_strategy truncate: cut to sequence_len, kept
    labelled: bool = False  # the processed rows carry labels (chat_template does): trainable tokens counted
    files: list[dict] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return self.conversations - self.kept

    @property
    def dropped_share(self) -> float:
        return self.dropped / self.conversations if self.conversations else 0.0

    @property
    def dropped_trainable_share(self) -> float:
        t = self.trainable_tokens
        return (t - self.kept_trainable_tokens) / t if t else 0.0

    def reasons(self) -> str:
        parts = [
            f"{n} longer than sequence_len {self.sequence_len}" if (n := self.too_long) else "",
            f"{n} shorter than min_sample_len" if (n := self.too_short) else "",
            f"{n} without a trainable token" if (n := self.no_trainable) else "",
        ]
        return ", ".join(p for p in parts if p) or "none"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(dropped=self.dropped, dropped_share=round(self.dropped_share, 6))
        d["dropped_trainable_share"] = round(self.dropped_trainable_share, 6)
        return d


def axolotl_cfg(data: dict):
    """axolotl's validated, normalised config (DictDefault) for `data`, built the way its CLI's
    `load_cfg` does (plugins, `validate_config`, `normalize_config`, `normalize_cfg_datasets`) minus
    what writes files or sets environment variables (debug log, tracker env)."""
    from axolotl.utils.config import (
        normalize_cfg_datasets,
        normalize_config,
        prepare_plugins,
        validate_config,
    )
    from axolotl.utils.dict import DictDefault

    cfg = DictDefault(json.loads(json.dumps(data)))
    prepare_plugins(cfg)
    cfg = validate_config(cfg)
    normalize_config(cfg)
    normalize_cfg_datasets(cfg)
    return cfg


def _stats(ds) -> tuple[int, int, int, list[int]]:
    lengths = [len(x) for x in ds["input_ids"]]
    trainable = (
        sum(sum(1 for v in lab if v != -100) for lab in ds["labels"]) if "labels" in ds.column_names else 0
    )
    return len(lengths), sum(lengths), trainable, lengths


def count_kept(data: dict, tokenizer=None) -> list[SplitCount]:
    """SplitCount per split of an axolotl config (`datasets`, and `test_datasets` when given).

    `data`: the config as `pipeline train` will run it (dataset paths resolvable from here);
    `tokenizer`: the run's tokenizer (default: axolotl's `load_tokenizer(cfg)`).
    Raises GateUnavailable when the base's config or tokenizer cannot be loaded, else what axolotl
    raises on a dataset (ValueError, KeyError, OSError...).
    """
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data.sft import _load_and_process_single_dataset
    from axolotl.utils.data.shared import datasets_with_name_generator
    from axolotl.utils.data.utils import handle_long_seq_in_dataset
    from axolotl.utils.trainer import process_datasets_for_packing

    try:
        cfg = axolotl_cfg(data)
        tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    except (OSError, ValueError) as e:  # transformers: no config.json / model_type / tokenizer files
        raise GateUnavailable(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    out = []
    for split, key in (("train", "datasets"), ("test", "test_datasets")):
        if not cfg.get(key):
            continue
        seq = cfg.eval_sequence_len if split == "test" and cfg.eval_sequence_len else cfg.sequence_len
        packed = cfg.sample_packing if split == "train" else cfg.eval_sample_packing
        truncate = (cfg.excess_length_strategy or "drop").lower() == "truncate"
        lo = cfg.min_sample_len or 2
        sc = SplitCount(split, int(seq))
        for dcfg in datasets_with_name_generator(cfg[key]):
            ds, _ = _load_and_process_single_dataset(
                dataset_config=dcfg, cfg=cfg, tokenizer=tok, split=split, seed=cfg.seed
            )
            n, tokens, trainable, lengths = _stats(ds)
            sc.labelled = sc.labelled or "labels" in ds.column_names
            kept = handle_long_seq_in_dataset(ds, seq, cfg)
            if packed and len(kept):
                kept, _ = process_datasets_for_packing(cfg, kept, None)
            kn, ktokens, ktrainable, _ = _stats(kept) if len(kept) else (0, 0, 0, [])
            long_ = sum(1 for x in lengths if x > seq)
            short = sum(1 for x in lengths if x < lo)
            f = {
                "path": str(dcfg.get("path")),
                "conversations": n,
                "kept": kn,
                "tokens": tokens,
                "kept_tokens": ktokens,
            }
            sc.files.append(f)
            sc.conversations += n
            sc.kept += kn
            sc.tokens += tokens
            sc.kept_tokens += ktokens
            sc.trainable_tokens += trainable
            sc.kept_trainable_tokens += ktrainable
            sc.too_short += short
            if truncate:
                sc.truncated += long_
            else:
                sc.too_long += long_
            sc.no_trainable += max(0, (n - kn) - short - (0 if truncate else long_))
        out.append(sc)
    return out


def gate_problems(counts: list[SplitCount], max_share: float, allow: set[str] = frozenset()) -> list[str]:
    """Refusals for the counted splits: nothing kept, or nothing trainable kept (always), or more than
    `max_share` of a split's conversations or trainable tokens dropped (unless `dataset.dropped` is allowed)."""
    out = []
    name = {"train": "datasets", "test": "test_datasets"}
    for sc in counts:
        where = f"{name[sc.split]} ({', '.join(f['path'] for f in sc.files)})"
        if sc.kept == 0:
            out.append(
                f"{where}: axolotl keeps none of the {sc.conversations} conversations "
                f"(dropped: {sc.reasons()}), so training would fail after loading the model. Shorten the "
                f"conversations, raise sequence_len, or set excess_length_strategy: truncate"
            )
        elif sc.labelled and sc.kept_trainable_tokens == 0:
            # rows kept but every label -100 (unpacked rows are not dropped for it): training learns
            # nothing, and an eval split gives a NaN eval loss that the gates downstream cannot compare
            out.append(
                f"{where}: axolotl keeps {sc.kept} of {sc.conversations} conversations but none has a trainable "
                f"token (every label -100): check roles_to_train / train_on_inputs and that the conversations "
                f"have assistant turns the chat template marks"
            )
        elif ALLOW_ID not in allow and (
            sc.dropped_share > max_share or sc.dropped_trainable_share > max_share
        ):
            out.append(
                f"{where}: axolotl drops {sc.dropped} of {sc.conversations} conversations "
                f"({100 * sc.dropped_share:.1f}%) and {sc.trainable_tokens - sc.kept_trainable_tokens} of "
                f"{sc.trainable_tokens} trainable tokens ({100 * sc.dropped_trainable_share:.1f}%), more than "
                f"train.max_dropped_share {max_share:g}; dropped: {sc.reasons()}. Fix the data or sequence_len, "
                f"raise train.max_dropped_share in pipeline.yaml, or accept it with --allow {ALLOW_ID}"
            )
    return out


KEPT_PARAMS = (
    "conversations",
    "kept",
    "dropped",
    "tokens",
    "kept_tokens",
    "trainable_tokens",
    "kept_trainable_tokens",
)


def kept_metrics(kept: list[dict]) -> dict[str, float]:
    """MLflow metrics from `SplitCount.to_dict()` records: dataset.<split>.<count>."""
    return {f"dataset.{k['split']}.{n}": float(k[n]) for k in kept for n in KEPT_PARAMS}
