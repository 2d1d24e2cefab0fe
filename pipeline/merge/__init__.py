"""Merge a PEFT LoRA into a safetensors base, shard by shard, without instantiating a model.

For every LoRA pair the base weight W [out, in] becomes `W + scale * (B @ A)` computed in fp32
and cast once to the output dtype (B [out, r], A [r, in]; embeddings: `(B @ A).T`, as peft's
`get_delta_weight`). Scale: `alpha / r` or `alpha / sqrt(r)` (rsLoRA) with `rank_pattern` /
`alpha_pattern` resolved by `AdapterConfig.scale_for` against the module's PEFT path, exactly as
peft matches them. Every other tensor (`mtp.*`, `model.visual.*`, norms, embeddings, lm_head) is
copied byte for byte with `copy_file_range` (no data passes through Python).

Memory: each output shard is written as it goes (header first, then tensors in order), merged
weights in row chunks of ~`CHUNK_BYTES` fp32, so peak RSS is the adapter plus a few chunks,
independent of the shard size. `safetensors.torch.save_file` would need a whole shard in memory,
hence the small streaming writer below (format: 8-byte little-endian header length, JSON header
padded with spaces to 8 bytes, raw little-endian data; https://github.com/huggingface/safetensors).

Atomicity: everything is written into `<out>.partial-XXXX` next to `out`, fsynced, the manifest
goes in last, then one `rename`. A crash leaves only a `.partial-` directory, never `out`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.adapter import WEIGHTS_FILE, AdapterConfig, load_adapter_config, parse_key
from pipeline.artifacts.atomic import fsync_dir, write_json_atomic
from pipeline.artifacts.checkpoint import canonical_module, read_checkpoint
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.manifest import MANIFEST
from pipeline.artifacts.safetensors import HeaderError, raw_header, read_safetensors_header
from pipeline.errors import CheckFailed, UsageError

INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20  # fp32 bytes per merge chunk (benchmarks/merge.py: 4-16 MB is fastest)
COPY_BYTES = 64 << 20
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


@dataclass
class MergeResult:
    out: Path
    manifest: dict
    seconds: float  # merge and write, without `finalize` (parity)
    bytes_written: int
    merged: list[str] = field(default_factory=list)


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
    if raw.get("fan_in_fan_out"):
        raise MergeError(
            f"{where}: fan_in_fan_out is true (Conv1D layout); Qwen linears are nn.Linear: retrain"
        )
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
            f"{base_dir}: quantized checkpoint; merge into the bf16 base, then requantise (docs/merge.md)"
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


# -- writing ----------------------------------------------------------------------------------------
def _header_bytes(entries: list[Entry], metadata: dict | None) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, buf, h=None) -> None:
    mv = memoryview(buf).cast("B")
    if h is not None:
        h.update(mv)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int, h=None) -> None:
    """Copy `length` bytes at `offset` of src to dst's current position.

    In-kernel (`copy_file_range`) unless the bytes must be hashed (`h`): then through a buffer,
    so that the output is never read back for its sha256 (re-reading it from disk doubled the
    merge time in benchmarks/merge.py once the page cache had evicted it).
    """
    done = 0
    if h is not None:
        while done < length:
            chunk = os.pread(src_fd, min(COPY_BYTES, length - done), offset + done)
            if not chunk:
                raise OSError(f"source ended {length - done} bytes early")
            _write_all(dst_fd, chunk, h)
            done += len(chunk)
        return
    try:
        while done < length:
            n = os.copy_file_range(src_fd, dst_fd, min(length - done, 1 << 30), offset + done)
            if n == 0:
                raise OSError(f"source ended {length - done} bytes early")
            done += n
        return
    except OSError as e:
        if done or getattr(e, "errno", None) is None:
            raise
    while done < length:  # filesystems without copy_file_range (EXDEV/ENOSYS/EINVAL)
        chunk = os.pread(src_fd, min(COPY_BYTES, length - done), offset + done)
        if not chunk:
            raise OSError(f"source ended {length - done} bytes early")
        _write_all(dst_fd, chunk)
        done += len(chunk)


def _write_merged(src_fd: int, entry: Entry, a, b, advance, write) -> None:
    """W + scale * (B @ A) in fp32, in row chunks, cast once; each chunk handed to `write`.

    W's raw bytes are read with `preadv` straight into a reused buffer (safetensors data is
    little-endian, offsets validated by the header check): no per-chunk allocations, no mmap
    pages left in RSS. Two output buffers alternate so that chunk i is written (and hashed) by
    the writer thread while chunk i+1 is computed; `write(array)` returns a future.
    a, b: fp32 A [r, in] and B [out, r] (embedding: A [r, vocab], B [dim, r]).
    """
    import torch

    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    pair = entry.pair
    rows, cols = entry.shape
    step = max(1, CHUNK_BYTES // (4 * cols))
    src_buf = torch.empty(step, cols, dtype=dt[entry.src_dtype])
    acc = torch.empty(step, cols, dtype=torch.float32)
    out_bufs = [torch.empty(step, cols, dtype=dt[entry.dtype]) for _ in range(2)]
    pending = [None, None]
    row_bytes = cols * src_buf.element_size()
    for k, r0 in enumerate(range(0, rows, step)):
        n = min(step, rows - r0)
        raw = src_buf[:n].view(torch.uint8).numpy()
        if os.preadv(src_fd, [raw], entry.src_offset + r0 * row_bytes) != raw.nbytes:
            raise MergeError(f"{entry.name}: short read at row {r0}: the base shard changed or is truncated")
        w = acc[:n]
        w.copy_(src_buf[:n])
        if pair.embedding:  # (B [dim, r] @ A [r, vocab]).T rows r0:r0+n = A[:, rows].T @ B.T
            w.addmm_(a[:, r0 : r0 + n].T, b.T, alpha=pair.scale)
        else:
            w.addmm_(b[r0 : r0 + n], a, alpha=pair.scale)
        if pending[k % 2] is not None:
            pending[k % 2].result()  # the writer is done with this buffer
        out = out_bufs[k % 2][:n]
        out.copy_(w)
        pending[k % 2] = write(out.view(torch.uint8).numpy())
        advance(out.numel() * out.element_size())
    for f in pending:
        if f is not None:
            f.result()


def _write_shard(
    plan_shard: ShardPlan, dst: Path, lora: dict, advance, hash_file: bool
) -> tuple[list[str], str | None]:
    """Write one output shard (not yet fsynced); returns (merged tensor names, sha256 or None).

    All writes to the file go through one writer thread, in order; the main thread reads and
    computes ahead of it.
    """
    import hashlib

    import torch

    h = hashlib.sha256() if hash_file else None
    merged = []
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    src_fd = os.open(plan_shard.src, os.O_RDONLY)
    futures = []
    try:
        with ThreadPoolExecutor(max_workers=1) as writer:

            def submit(fn, *args):
                futures.append(writer.submit(fn, *args))
                return futures[-1]

            submit(_write_all, fd, _header_bytes(plan_shard.entries, plan_shard.metadata), h)
            for e in plan_shard.entries:
                if e.pair is None:
                    submit(_copy_range, src_fd, fd, e.src_offset, e.src_nbytes, h)
                    advance(e.src_nbytes)
                else:
                    a = lora[e.pair.a_key].to(torch.float32)
                    b = lora[e.pair.b_key].to(torch.float32)
                    _write_merged(src_fd, e, a, b, advance, lambda arr: submit(_write_all, fd, arr, h))
                    merged.append(e.name)
                    futures[:] = [f for f in futures if not f.done() or f.exception()]
        for f in futures:
            f.result()  # re-raise the first write error
    finally:
        os.close(src_fd)
        os.close(fd)
    return merged, h.hexdigest() if h else None


def _seal(path: Path, digest: str | None = None, hash_file: bool = False) -> str | None:
    """fsync a finished file (in a thread, overlapping the next shard); returns its sha256."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sha256_file(path) if hash_file and digest is None else digest


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _copy_side_files(base: Path, out: Path) -> list[str]:
    """Copy config, tokenizer, generation and other non-weight top-level files; returns their names."""
    copied = []
    for p in sorted(base.iterdir()):
        if (
            not p.is_file()
            or p.name.startswith(".")
            or p.name in SKIP_FILES
            or p.name.endswith(SKIP_SUFFIXES)
        ):
            continue
        shutil.copy2(p, out / p.name)
        copied.append(p.name)
    return copied


def merge_adapter(
    adapter_dir: Path,
    base_dir: Path,
    out_dir: Path,
    dtype: str = "bfloat16",
    progress: bool = False,
    hash_files: bool = True,
    extra_manifest: dict | None = None,
    finalize=None,
    threads: int | None = 1,
) -> MergeResult:
    """Merge `adapter_dir` into `base_dir`, writing a complete checkpoint at `out_dir`.

    Args:
        dtype: output dtype of the merged weights (`bfloat16`, `float16`, `float32`); all other
            tensors keep their dtype and bytes.
        progress: show a rich progress bar per shard on stderr.
        hash_files: record the sha256 of every output file in the manifest (shards are hashed
            as they are written; untouched tensors then pass through a buffer instead of
            `copy_file_range`).
        extra_manifest: merged into `manifest.json` (e.g. provenance from the caller).
        finalize: optional callable(partial_dir, manifest) run before the manifest is written and
            the directory renamed (the parity gate); it may add keys to `manifest` or raise to abort.
        threads: torch intra-op threads while merging (None: torch's default). The merge is
            memory-bound; on 2 shared cores 1 thread ran at ~800 MB/s and 2 threads at ~160-280
            MB/s (OpenMP spinning; benchmarks/merge.py).

    Returns: MergeResult with the manifest written to `out_dir/manifest.json`.

    Raises:
        MergeError: `out_dir` exists, bad inputs (see `plan_merge`).
        MergeMismatch: LoRA pairs that match no base weight, or (a bug) a merged count that
            differs from the number of pairs.
        Whatever `finalize` raises. In every failure case `out_dir` is not created and the
        partial directory is removed.
    """
    from safetensors.torch import load_file

    t0 = time.time()
    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    if out_dir.exists():
        raise MergeError(f"{out_dir} exists; merge writes a new directory (remove it or pick another --out)")
    plan = plan_merge(adapter_dir, base_dir, dtype)
    # The adapter is small: ~233 MB bf16 for the 27B at r=16 on all text linears.
    lora = load_file(str(adapter_dir / WEIGHTS_FILE))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-", dir=out_dir.parent))
    os.chmod(partial, 0o755)  # mkdtemp makes 0700; servers may run as another user
    merged: list[str] = []
    written = 0
    import torch

    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        side = _copy_side_files(base_dir, partial)
        hashes: dict[str, object] = {}
        with ThreadPoolExecutor(max_workers=1) as pool, _progress(progress) as bar:
            for shard in plan.shards:
                name = shard.src.name
                task = bar.add_task(name, total=shard.nbytes)
                names, digest = _write_shard(
                    shard, partial / name, lora, lambda n, t=task: bar.advance(t, n), hash_files
                )
                merged += names
                written += shard.nbytes
                hashes[name] = pool.submit(_seal, partial / name, digest)
            if plan.merged_count != len(plan.pairs) or len(merged) != len(plan.pairs):
                raise MergeMismatch(
                    f"merged {len(merged)} modules but the adapter has {len(plan.pairs)} LoRA pairs"
                )
            if plan.sharded:
                weight_map = {e.name: s.src.name for s in plan.shards for e in s.entries}
                index = {
                    "metadata": {"total_size": sum(s.nbytes for s in plan.shards)},
                    "weight_map": weight_map,
                }
                write_json_atomic(partial / INDEX, index)
            files = {n: f.result() for n, f in hashes.items()}
        files.update(
            {n: _seal(partial / n, hash_file=hash_files) for n in side + ([INDEX] if plan.sharded else [])}
        )
        manifest = _manifest(plan, merged, files if hash_files else None, time.time() - t0, written)
        manifest.update(extra_manifest or {})
        seconds = time.time() - t0
        torch.set_num_threads(threads_before)  # the gate picks its own
        if finalize is not None:
            finalize(partial, manifest)
        write_json_atomic(partial / MANIFEST, manifest)
        fsync_dir(partial)
        os.rename(partial, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return MergeResult(out_dir, manifest, seconds, written, merged)


def _manifest(plan: MergePlan, merged: list[str], files: dict | None, seconds: float, written: int) -> dict:
    from pipeline.artifacts.manifest import package_versions, read_manifest
    from pipeline.train.launch import base_fingerprint

    try:
        amani = read_manifest(plan.adapter)
    except (FileNotFoundError, ValueError):
        amani = {}
    acfg = load_adapter_config(plan.adapter).raw
    scales: dict[str, int] = {}
    for p in plan.pairs.values():
        scales[f"{p.scale:g}"] = scales.get(f"{p.scale:g}", 0) + 1
    return {
        "schema": 1,
        "kind": "merged-lora",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "files": files,
        "base": {
            "path": str(plan.base.resolve()),
            "layout": plan.layout,
            "fingerprint": base_fingerprint(str(plan.base)),
        },
        "adapter": {
            "path": str(plan.adapter.resolve()),
            "name": amani.get("name"),
            "weights_sha256": sha256_file(plan.adapter / WEIGHTS_FILE),
            "manifest_base_model": amani.get("base_model"),
            "registered": registered_version(amani),
            "config": {
                k: acfg.get(k)
                for k in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules")
            },
        },
        "merge": {
            "dtype": plan.dtype,
            "lora_pairs": len(plan.pairs),
            "merged_modules": len(merged),
            "copied_tensors": sum(1 for s in plan.shards for e in s.entries if e.pair is None),
            "scales": scales,
            "bytes": written,
            "seconds": round(seconds, 2),
        },
        "requantisation": {
            "status": "pending",
            "target": "NVFP4 (ModelOpt format) for the MTP fleet",
            "keep_bf16": ["lm_head", "mtp.*", "model.visual.*"],
            "recipe": "docs/merge.md",
        },
        "versions": package_versions(("peft", "transformers", "torch", "safetensors", "lora-pipeline")),
    }


def registered_version(adapter_manifest: dict) -> dict | None:
    """{name, version} of the registry version an adapter manifest names (publish writes `published`)."""
    for key in ("published", "registered"):
        d = adapter_manifest.get(key) or {}
        if d.get("name") and d.get("version") is not None:
            return {"name": str(d["name"]), "version": int(d["version"])}
    return None
