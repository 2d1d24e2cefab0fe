"""Writing merged shards: byte-range copies of untouched tensors, chunked W + scale * B @ A for adapted ones.

Where the time goes (benchmarks/merge.py, 2 cores): torch's start-up, the sha256 of every output
byte (~1 GB/s on one core), and the arithmetic (~1.5 GB/s of bf16 per core with 16 MB chunks);
the bytes themselves move in the kernel (`copy_file_range` for untouched tensors, the page cache
for the source). So: the source is read in place through a mapping (no copy), untouched tensors
are copied in the kernel even when hashing (the hash reads the source's mapping), and compute,
write and hash run on three threads.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.artifacts.hashing import sha256_file
from pipeline.merge.plan import CHUNK_BYTES, SKIP_FILES, SKIP_SUFFIXES, Entry, MergeError, ShardPlan

COPY_BYTES = 64 << 20
PAGE = mmap.PAGESIZE


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


def _write_all(fd: int, buf) -> None:
    mv = memoryview(buf).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    """Copy `length` bytes at `offset` of src to dst's current position, in the kernel (`copy_file_range`)."""
    done = 0
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


def _drop(mm: mmap.mmap, start: int, end: int) -> None:
    """Unmap pages of the source that are done (page cache keeps them): RSS stays a few chunks."""
    lo, hi = start - start % PAGE, end - end % PAGE
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _hash_range(h, mm: mmap.mmap, start: int, length: int) -> None:
    """sha256 of bytes the kernel copied, read from the source's mapping (never from the output)."""
    view = memoryview(mm)
    try:
        for off in range(start, start + length, COPY_BYTES):
            end = min(off + COPY_BYTES, start + length)
            h.update(view[off:end])
            _drop(mm, off, end)
    finally:
        view.release()


def _write_merged(src: mmap.mmap, entry: Entry, a, b, advance, out, device) -> None:
    """W + scale * (B @ A) in fp32, in row chunks, cast once; each chunk handed to `out` (write + sha256).

    W is read in place from the source's mapping (`torch.frombuffer`: no copy into Python buffers,
    pages unmapped as they are done). Two output buffers alternate so that chunk i is written and
    hashed by the writer threads while chunk i+1 is computed; `out(array)` returns the futures.
    a, b: A [r, in] and B [out, r] as the adapter stores them (embedding: A [r, vocab], B [dim, r]),
    on `device`; with a GPU the chunk is computed there (host -> device, addmm, back into pinned memory).
    """
    import torch

    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    pair = entry.pair
    rows, cols = entry.shape
    if entry.src_offset + entry.src_nbytes > len(src):
        raise MergeError(f"{entry.name}: the base shard ends before this tensor: it changed or is truncated")
    w_all = torch.frombuffer(src, dtype=torch.uint8, count=entry.src_nbytes, offset=entry.src_offset)
    w_all = w_all.view(dt[entry.src_dtype]).view(rows, cols)
    out_dtype = dt[entry.dtype]
    # One GEMM per chunk when W, A, B and the output share a dtype: `addmm` accumulates B @ A in fp32,
    # adds W in fp32 and rounds once (oneDNN / cuBLAS with fp32 compute), i.e. the fp32 path's result
    # without its two casting passes (benchmarks/merge.py: ~1.4x faster; 1.5e-7 of the elements
    # differ from the fp32 path by summation order, both as close to the exactly rounded value).
    direct = a.dtype == b.dtype == w_all.dtype == out_dtype
    step = max(1, CHUNK_BYTES // ((2 if direct else 4) * cols))
    acc = None if direct else torch.empty(step, cols, dtype=torch.float32, device=device)
    on_gpu = device.type == "cuda"
    out_bufs = [torch.empty(step, cols, dtype=out_dtype, pin_memory=on_gpu) for _ in range(2)]
    res = torch.empty(step, cols, dtype=out_dtype, device=device) if on_gpu and direct else None
    pending: list = [(), ()]
    row_bytes = cols * w_all.element_size()
    try:
        for k, r0 in enumerate(range(0, rows, step)):
            n = min(step, rows - r0)
            # (B [dim, r] @ A [r, vocab]).T rows r0:r0+n = A[:, rows].T @ B.T for embeddings
            m1, m2 = (a[:, r0 : r0 + n].T, b.T) if pair.embedding else (b[r0 : r0 + n], a)
            for f in pending[k % 2]:
                f.result()  # the writer and the hasher are done with this buffer
            o = out_bufs[k % 2][:n]
            w = w_all[r0 : r0 + n]
            if direct and not on_gpu:
                torch.addmm(w, m1, m2, alpha=pair.scale, out=o)
            elif direct:
                torch.addmm(w.to(device, non_blocking=True), m1, m2, alpha=pair.scale, out=res[:n])
                o.copy_(res[:n])
            else:
                x = acc[:n]
                x.copy_(w)
                x.addmm_(m1.float(), m2.float(), alpha=pair.scale)
                o.copy_(x)
            pending[k % 2] = out(o.view(torch.uint8).numpy())
            _drop(src, entry.src_offset + r0 * row_bytes, entry.src_offset + (r0 + n) * row_bytes)
            advance(o.numel() * o.element_size())
    finally:
        for fs in pending:
            for f in fs:
                f.result()
        del w_all  # the mapping must not be exported when the shard closes it


def write_shard(
    plan_shard: ShardPlan, dst: Path, lora: dict, advance, hash_file: bool, device=None
) -> tuple[list[str], str | None]:
    """Write one output shard (not yet fsynced); returns (merged tensor names, sha256 or None).

    All writes to the file go through one writer thread, in order; the sha256 is computed by a
    second thread over the same bytes, in order (merged chunks from the output buffers, copied
    tensors from the source's mapping while the kernel copies them), so neither waits for the
    other; the main thread computes ahead of both. `device`: torch device for the arithmetic
    (default CPU).
    """
    import hashlib

    import torch

    device = torch.device(device or "cpu")
    h = hashlib.sha256() if hash_file else None
    merged = []
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    src_fd = os.open(plan_shard.src, os.O_RDONLY)
    futures = []
    try:
        src = mmap.mmap(
            src_fd, 0, access=mmap.ACCESS_COPY
        )  # private + writable: torch.frombuffer; never written
        with ThreadPoolExecutor(max_workers=1) as writer, ThreadPoolExecutor(max_workers=1) as hasher:

            def submit(pool, fn, *args):
                futures.append(pool.submit(fn, *args))
                return futures[-1]

            def out(arr):
                fs = (submit(writer, _write_all, fd, arr),)
                return fs + ((submit(hasher, h.update, arr),) if h is not None else ())

            out(_header_bytes(plan_shard.entries, plan_shard.metadata))
            for e in plan_shard.entries:
                if e.pair is None:
                    submit(writer, _copy_range, src_fd, fd, e.src_offset, e.src_nbytes)
                    if h is not None:
                        submit(hasher, _hash_range, h, src, e.src_offset, e.src_nbytes)
                    advance(e.src_nbytes)
                else:
                    a = lora[e.pair.a_key].to(device=device)
                    b = lora[e.pair.b_key].to(device=device)
                    _write_merged(src, e, a, b, advance, out, device)
                    merged.append(e.name)
                futures[:] = [f for f in futures if not f.done() or f.exception()]
        for f in futures:
            f.result()  # re-raise the first write error
        src.close()
    finally:
        os.close(src_fd)
        os.close(fd)
    return merged, h.hexdigest() if h else None


def seal_output(path: Path, digest: str | None = None, hash_file: bool = False) -> str | None:
    """fsync a finished file (in a thread, overlapping the next shard); returns its sha256."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sha256_file(path) if hash_file and digest is None else digest


def progress_bar(enabled: bool):
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


def copy_side_files(base: Path, out: Path) -> list[str]:
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
