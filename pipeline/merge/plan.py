"""What a merge will do, read from headers only: each base tensor's LoRA pair, dtype and place in its shard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.adapter import WEIGHTS_FILE, AdapterConfig, load_adapter_config, parse_key
from pipeline.artifacts.checkpoint import canonical_module, read_checkpoint
from pipeline.artifacts.manifest import MANIFEST
from pipeline.artifacts.safetensors import HeaderError, raw_header, read_safetensors_header
from pipeline.errors import CheckFailed, UsageError

INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20  # fp32 bytes per merge chunk (benchmarks/merge.py: 4-16 MB is fastest)


DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


FLOAT_DTYPES = {"BF16", "F16", "F32"}


# Files in the base directory that are weights in another format: never copied (they would be unmerged).
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")


SKIP_FILES = {INDEX, MANIFEST, "hf_quant_config.json"}


# adapter_config settings whose merge is not W + scale * B @ A on the original base.
UNMERGEABLE_INIT = ("pissa", "olora", "corda", "loftq")


SAVED_BASE = ".base_layer.weight"


class MergeError(UsageError):
    """Unreadable or unsupported input (exit 2)."""


class MergeMismatch(CheckFailed):
    """The adapter's LoRA pairs do not all map onto base weights (exit 1)."""


@dataclass(frozen=True)
class LoraPair:
    module: str  # canonical, e.g. layers.3.self_attn.q_proj
    peft_path: str  # module path inside the PEFT model, e.g. model.layers.3.self_attn.q_proj
    a_key: str
    b_key: str
    rank: int
    scale: float
    embedding: bool
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass
class Entry:
    """One tensor of an output shard."""

    name: str
    dtype: str  # output safetensors dtype
    shape: tuple[int, ...]
    src_offset: int  # absolute byte offset in the source shard
    src_nbytes: int
    pair: LoraPair | None = None
    src_dtype: str = ""

    @property
    def nbytes(self) -> int:
        if self.pair is None:
            return self.src_nbytes
        n = 1
        for s in self.shape:
            n *= s
        return n * _ITEMSIZE[self.dtype]


@dataclass
class ShardPlan:
    src: Path
    entries: list[Entry]
    metadata: dict | None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass
class MergePlan:
    base: Path
    adapter: Path
    dtype: str
    layout: str
    shards: list[ShardPlan]
    pairs: dict[str, LoraPair]
    sharded: bool  # the base has an index file

    @property
    def merged_count(self) -> int:
        return sum(1 for s in self.shards for e in s.entries if e.pair is not None)


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


# -- reading -----------------------------------------------------------------------------------------
def lora_pairs(
    adapter_dir: Path, cfg: AdapterConfig
) -> tuple[dict[str, LoraPair], dict[str, str], list[str]]:
    """Pair the adapter's A/B tensors by canonical module.


    Returns ({module: LoraPair}, {module: saved base-layer key}, problems) where problems name
    unpaired, non-LoRA or mis-shaped keys. Saved base layers are the full `embed_tokens` /
    `lm_head` weights peft writes next to embedding LoRAs (`save_embedding_layers`), e.g.
    `base_model.model.model.embed_tokens.base_layer.weight`. Raises MergeError for an
    unreadable weights file.
    """
    wfile = Path(adapter_dir) / WEIGHTS_FILE
    if not wfile.is_file():
        raise MergeError(
            f"{wfile}: missing; merge reads PEFT safetensors adapters (save_pretrained writes it)"
        )
    try:
        header = read_safetensors_header(wfile)
    except HeaderError as e:
        raise MergeError(str(e)) from e
    found: dict[str, dict[str, str]] = {}
    paths: dict[str, str] = {}
    emb: dict[str, bool] = {}
    problems: list[str] = []
    saved: dict[str, str] = {}
    for name in header:
        key = parse_key(name)
        if key is None and name.endswith(SAVED_BASE):
            cm = canonical_module(name.removeprefix("base_model.model.")[: -len(SAVED_BASE)] + ".weight")
            saved[cm[0]] = name
            continue
        if key is None:
            problems.append(
                f"{name}: not a LoRA A/B tensor (modules_to_save, bias or DoRA magnitude cannot be merged)"
            )
            continue
        found.setdefault(key.module, {})[key.kind] = name
        emb[key.module] = key.embedding
        # The module path inside the PEFT model: what peft matches rank/alpha patterns against.
        stem = name.removeprefix("base_model.model.")
        paths[key.module] = stem[: stem.index(".lora_")]
    pairs: dict[str, LoraPair] = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            problems.append(f"{next(iter(ab.values()))}: lora_{missing} for module {module} is missing")
            continue
        a, b = header[ab["A"]], header[ab["B"]]
        if len(a.shape) != 2 or len(b.shape) != 2:
            problems.append(
                f"{ab['A']}: shapes A {list(a.shape)} / B {list(b.shape)} are not 2-D (conv LoRA cannot be merged)"
            )
            continue
        rank = a.shape[0]  # A is [r, in] (embedding: [r, vocab]); B is [out, r] (embedding: [dim, r])
        if b.shape[1] != rank:
            problems.append(f"{ab['B']}: B {list(b.shape)} and A {list(a.shape)} disagree on the rank")
            continue
        want = cfg.rank_for(paths[module])
        if want != rank:
            problems.append(
                f"{ab['A']}: rank {rank} in the tensors but {want} in adapter_config.json (r / rank_pattern): "
                "the scale would be wrong"
            )
            continue
        pairs[module] = LoraPair(
            module,
            paths[module],
            ab["A"],
            ab["B"],
            rank,
            cfg.scale_for(paths[module]),
            emb[module],
            a.shape,
            b.shape,
        )
    return pairs, saved, problems


def _check_config(cfg: AdapterConfig) -> None:
    raw = cfg.raw
    where = str(cfg.path)
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise MergeError(f"{where}: peft_type {raw.get('peft_type')!r}; only LORA adapters can be merged")
    if raw.get("use_dora"):
        raise MergeError(f"{where}: use_dora is true; DoRA rescales by a weight norm and is not merged here")
    if raw.get("lora_bias"):
        raise MergeError(f"{where}: lora_bias is true; the LoRA bias is not merged here")
    if raw.get("modules_to_save"):
        raise MergeError(
            f"{where}: modules_to_save {raw['modules_to_save']} replaces whole modules; not merged here"
        )
    # fan_in_fan_out is not refused: on an nn.Linear target peft warns and applies it as false (lora/model.py
    # _create_new_module), vLLM ignores it and validate passes it; a Conv1D-layout (transposed) adapter fails the
    # shape check of each pair (_check_target).
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(UNMERGEABLE_INIT):
        raise MergeError(
            f"{where}: init_lora_weights={init!r} changes the base weights; convert the adapter first"
        )


def plan_merge(adapter_dir: Path, base_dir: Path, dtype: str = "bfloat16") -> MergePlan:
    """Map every LoRA pair onto a base weight and lay out the output shards (headers only).


    Raises:
        MergeError: missing/corrupt inputs, a quantized base, unsupported adapter settings,
            a target weight that is not float or whose shape disagrees with A/B.
        MergeMismatch: LoRA pairs that match no base weight (all listed), unpaired or
            non-LoRA adapter tensors.
    """
    adapter_dir, base_dir = Path(adapter_dir), Path(base_dir)
    if dtype not in DTYPES:
        raise MergeError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    try:
        cfg = load_adapter_config(adapter_dir)
        ckpt = read_checkpoint(base_dir)
    except (ValueError, HeaderError) as e:
        raise MergeError(str(e)) from e
    if ckpt.is_quantized:
        raise MergeError(
            f"{base_dir}: quantized checkpoint; merge into the bf16 base, then requantize (docs/merge.md)"
        )
    _check_config(cfg)
    pairs, saved, problems = lora_pairs(adapter_dir, cfg)

    # canonical module -> base tensor name of its `.weight`
    targets: dict[str, str] = {}
    for name in ckpt.tensors:
        cm = canonical_module(name)
        if cm and cm[1] == ".weight":
            targets[cm[0]] = name
    unmatched = [
        f"{p.a_key}: no base tensor for module {m} (looked for {m}.weight in {ckpt.layout} layout)"
        for m, p in pairs.items()
        if m not in targets
    ]
    for m, key in saved.items():
        if m not in targets:
            unmatched.append(f"{key}: no base tensor for module {m}")
        elif not _same_as_base(
            adapter_dir / WEIGHTS_FILE, key, base_dir / ckpt.tensors[targets[m]].file, targets[m]
        ):
            problems.append(
                f"{key}: the adapter carries its own {m} weights that differ from the base's {targets[m]} "
                "(resized vocabulary or trained embeddings?): merging those is not supported"
            )
    if problems or unmatched:
        raise MergeMismatch(
            f"{adapter_dir}: {len(pairs) - len(unmatched)} of {len(pairs)} LoRA pairs match {base_dir}; "
            f"{len(problems) + len(unmatched)} adapter keys cannot be merged:\n  "
            + "\n  ".join(problems + unmatched)
        )
    by_tensor = {targets[m]: p for m, p in pairs.items()}

    index = base_dir / INDEX
    files = sorted({t.file for t in ckpt.tensors.values()})
    out_dtype = DTYPES[dtype]
    shards = []
    for fname in files:
        src = base_dir / fname
        start, header = raw_header(src)
        entries = []
        for name, info in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        ):
            shape = tuple(info["shape"])
            s, e = info["data_offsets"]
            pair = by_tensor.get(name)
            if pair is not None:
                _check_target(name, info["dtype"], shape, pair, src)
            entries.append(
                Entry(
                    name, out_dtype if pair else info["dtype"], shape, start + s, e - s, pair, info["dtype"]
                )
            )
        shards.append(ShardPlan(src, entries, header.get("__metadata__")))
    return MergePlan(base_dir, adapter_dir, dtype, ckpt.layout, shards, pairs, index.is_file())


def _same_as_base(adapter_file: Path, key: str, base_file: Path, name: str) -> bool:
    """Whether a saved base layer equals the base tensor once cast to its dtype (row chunks)."""
    from safetensors import safe_open

    with safe_open(str(adapter_file), framework="pt") as fa, safe_open(str(base_file), framework="pt") as fb:
        sa, sb = fa.get_slice(key), fb.get_slice(name)
        if list(sa.get_shape()) != list(sb.get_shape()):
            return False
        rows, cols = sb.get_shape()[0], max(1, sb.get_shape()[-1])
        step = max(1, CHUNK_BYTES // (4 * cols))
        for r0 in range(0, rows, step):
            wb = sb[r0 : r0 + step]
            if not bool((sa[r0 : r0 + step].to(wb.dtype) == wb).all()):
                return False
    return True


def _check_target(name: str, dtype: str, shape: tuple, pair: LoraPair, src: Path) -> None:
    if dtype not in FLOAT_DTYPES or len(shape) != 2:
        raise MergeError(
            f"{src}:{name}: {dtype} {list(shape)} is not a 2-D float weight; cannot merge {pair.a_key}"
        )
    # Linear: B [out, r] @ A [r, in] = W [out, in]; embedding: (B [dim, r] @ A [r, vocab]).T = W [vocab, dim]
    a, b = pair.a_shape, pair.b_shape
    want = (a[1], b[0]) if pair.embedding else (b[0], a[1])
    if want != shape:
        raise MergeError(
            f"{src}:{name}: base weight {list(shape)} but {pair.a_key} {list(a)} / {pair.b_key} "
            f"{list(b)} give {list(want)}: the adapter was trained on another base"
        )
