"""Writing merged shards: byte-range copies of untouched tensors, chunked W + scale * B @ A for adapted ones."""

from __future__ import annotations

import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.artifacts.hashing import sha256_file
from pipeline.merge.plan import CHUNK_BYTES, SKIP_FILES, SKIP_SUFFIXES, Entry, MergeError, ShardPlan

COPY_BYTES = 64 << 20


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


def write_shard(
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
