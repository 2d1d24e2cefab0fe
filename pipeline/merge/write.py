"""Writing merged shards: byte-range copies of untouched tensors, chunked W + scale * B @ A for adapted ones.

Where the time goes (benchmarks/merge.py, 2 cores): torch's start-up, the sha256 of every output
byte (~1.8 GB/s on one core), and the arithmetic (in fp32 chunks, `_write_merged`); the bytes move in the
kernel (`preadv` from the page cache straight into page-aligned staging buffers, `O_DIRECT` writes
out of them). So: no Python-level copies, W is read into the buffer the merged rows are written
from, and compute, write and hash run on three threads per shard.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import re
import shutil
import socket
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.artifacts.hashing import sha256_file
from pipeline.merge.plan import CHUNK_BYTES, SKIP_FILES, SKIP_SUFFIXES, Entry, MergeError, ShardPlan

log = logging.getLogger("pipeline.merge")


# -- work directories next to the output: `<out>.partial.<pid>@<host>.<random>`, `<out>.bf16.<...>` ------
def work_dir(out_dir: Path, kind: str) -> Path:
    """A new directory next to `out_dir` (same filesystem: the last step is a rename), mode 0755, named
    after this process so that a later merge can tell when its writer is gone (`clear_killed_work`)."""
    out_dir = Path(out_dir)
    d = Path(
        tempfile.mkdtemp(
            prefix=f"{out_dir.name}.{kind}.{os.getpid()}@{socket.gethostname()}.", dir=out_dir.parent
        )
    )
    os.chmod(d, 0o755)  # mkdtemp makes 0700; servers may run as another user
    return d


def clear_killed_work(out_dir: Path) -> list[Path]:
    """Remove the work directories a killed merge to `out_dir` left (SIGKILL, the OOM killer: SIGTERM
    and errors clean up themselves); returns them.

    A merge writes gigabytes into `<out>.partial...` before its one rename; killed, that stayed for
    ever, and the next merge to the same `--out` neither said nor removed it. A directory of this
    host whose process is gone is removed; one of a live process or another host is left alone; one
    of an older pipeline (`<out>.partial-XXXX`, no process in its name) is named in a warning.
    """
    out_dir = Path(out_dir)
    mine = re.compile(rf"{re.escape(out_dir.name)}\.(partial|bf16)\.(?P<pid>\d+)@(?P<host>.+)\.[^.]+\Z")
    older = re.compile(rf"{re.escape(out_dir.name)}\.(partial|bf16)-[^.]+\Z")
    removed = []
    try:
        entries = list(os.scandir(out_dir.parent))
    except OSError:
        return removed
    for e in entries:
        if not e.is_dir(follow_symlinks=False):
            continue
        m = mine.match(e.name)
        if m and m["host"] == socket.gethostname() and not _alive(int(m["pid"])):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
            log.warning("removed %s: the work directory of a merge that was killed", e.path)
        elif older.match(e.name):
            log.warning("%s: the work directory of a killed merge? remove it if no merge is running", e.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


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


class StagedWriter:
    """A shard written sequentially through a few page-aligned staging buffers, with `O_DIRECT` where the
    filesystem has it.

    Why: writing 6 GB through the page cache cost the merge more CPU than anything else on the shared
    2-core machine (allocating and reclaiming page cache under the team's memory pressure: ~8 of ~16
    CPU-s in benchmarks/merge.py), while `O_DIRECT` writes of 8 MB aligned buffers took ~0.1 CPU-s per
    GB at the disk's full speed, and leave nothing for `fsync` to flush. The producer computes or reads
    straight into the staging buffer (`space`/`commit`: no extra copy); a full buffer is written by one
    thread and hashed (sha256, in order) by another while the producer fills the next. The last partial
    block is written without `O_DIRECT` (its length is not a multiple of the block size).
    """

    BUF = 8 << 20
    NBUF = 3

    def __init__(self, path: Path, h, writer, hasher):
        self.h, self.writer, self.hasher = h, writer, hasher
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.path = path
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
            self.fd, self.direct = os.open(path, flags, 0o644), False
        self.bufs = [mmap.mmap(-1, self.BUF) for _ in range(self.NBUF)]  # anonymous maps are page-aligned
        self.busy: list[tuple] = [() for _ in self.bufs]
        self.i = 0  # current buffer
        self.fill = 0  # bytes in it
        self.offset = 0  # file offset of the current buffer
        self.futures: list = []

    def _flush(self) -> None:
        buf, n, off = self.bufs[self.i], self.fill, self.offset
        if n == 0:
            return
        fs = []
        if self.h is not None:
            fs.append(self.hasher.submit(self._hash, memoryview(buf)[:n]))
        fs.append(self.writer.submit(self._pwrite, memoryview(buf)[:n], off))
        self.busy[self.i] = tuple(fs)
        self.futures += fs
        self.i = (self.i + 1) % len(self.bufs)
        for f in self.busy[self.i]:
            f.result()  # the writer and the hasher are done with the next buffer
        self.busy[self.i] = ()
        self.offset += n
        self.fill = 0

    def _hash(self, view) -> None:
        self.h.update(view)
        view.release()

    def _pwrite(self, view, off: int) -> None:
        n = len(view)
        aligned = n - n % 4096 if self.direct else n
        done = 0
        while done < aligned:
            try:
                done += os.pwrite(self.fd, view[done:aligned], off + done)
            except OSError as e:  # a filesystem that takes the flag but not the write: buffered from here on
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                os.close(self.fd)
                self.fd, self.direct, aligned = os.open(self.path, os.O_WRONLY), False, n
        if done < n:  # O_DIRECT needs block-aligned lengths: the tail through a buffered descriptor
            fd = os.open(self.path, os.O_WRONLY)
            try:
                while done < n:
                    done += os.pwrite(fd, view[done:], off + done)
            finally:
                os.close(fd)
        view.release()

    def space(self, want: int) -> memoryview:
        """A writable view of up to `want` bytes at the current position (at least 1 byte)."""
        if self.fill == self.BUF:
            self._flush()
        return memoryview(self.bufs[self.i])[self.fill : self.fill + min(want, self.BUF - self.fill)]

    def commit(self, n: int) -> None:
        self.fill += n

    def put(self, data) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            sp = self.space(len(mv))
            sp[:] = mv[: len(sp)]
            k = len(sp)
            sp.release()
            self.commit(k)
            mv = mv[k:]

    def copy_from(self, src_fd: int, offset: int, length: int) -> None:
        """`length` bytes at `offset` of the source, read straight into the staging buffers."""
        done = 0
        while done < length:
            sp = self.space(length - done)
            got = os.preadv(src_fd, [sp], offset + done)
            sp.release()
            if got <= 0:
                raise OSError(f"source ended {length - done} bytes early")
            self.commit(got)
            done += got

    def close(self) -> None:
        """Write what is left and wait for every write; raises the first write or hash error."""
        try:
            if self.fill:
                self._flush()
            for f in self.futures:
                f.result()
        finally:
            os.close(self.fd)
            for b in self.bufs:
                b.close()

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        for f in self.futures:
            if not f.cancelled():
                f.exception()
        os.close(self.fd)


def _read_into(src_fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the source's bytes at `offset` (`preadv`: page cache -> buffer, one kernel copy)."""
    done = 0
    while done < len(view):
        got = os.preadv(src_fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"source ended {len(view) - done} bytes early")
        done += got


def _write_merged(src_fd: int, entry: Entry, a, b, advance, w: StagedWriter, device) -> None:
    """W + scale * (B @ A) computed in fp32, in row chunks, rounded once to the output dtype, straight into
    `w`'s buffers.

    Each chunk of W is read (`preadv`) into the staging buffer (into a scratch tensor when W's dtype is
    not the output's), upcast (exactly) into an fp32 work tensor where `addmm_` adds scale * B @ A with
    the factors upcast once, and one cast (round to nearest even) writes the chunk back into the
    buffer; `StagedWriter`'s threads write and hash it while the next chunk is computed. A row that
    straddles two staging buffers goes through a small bounce buffer.

    Why fp32 and not one bf16 `addmm_` in place (which also accumulates in fp32 and rounds once): on a
    CPU without bf16 instructions (AVX2 only: no AVX512_BF16 / AMX) oneDNN's bf16 GEMM is emulated,
    1.38 s for a 5120x17408 weight at r=16 against 0.27 s upcast-add-cast (issue 41 item 4;
    benchmarks/RESULTS.md gives both kinds of CPU), and the fp32 path is as exact: W and the factors
    widen exactly, B @ A and the sum are rounded in fp32, the result once to bf16 (tests/merge
    `test_fp32_chunks_are_as_exact_as_a_bf16_gemm`). Why `preadv` and not the source's mapping:
    reading 6 GB through a mapping cost its page faults and torch's copy, ~0.25 CPU-s per GB on 3
    concurrent shards, against ~0.18 for the kernel's copy (benchmarks/merge.py, 2 cores).
    a, b: A [r, in] and B [out, r] as the adapter stores them (embedding: A [r, vocab], B [dim, r]),
    on `device`; with a GPU the chunk is computed there (host -> device, addmm, back to the buffer).
    """
    import torch

    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    pair = entry.pair
    rows, cols = entry.shape
    if entry.src_offset + entry.src_nbytes > os.fstat(src_fd).st_size:
        raise MergeError(f"{entry.name}: the base shard ends before this tensor: it changed or is truncated")
    src_dtype, out_dtype = dt[entry.src_dtype], dt[entry.dtype]
    a32, b32 = a.float(), b.float()  # exact for bf16/fp16 factors; once per tensor, not per chunk
    out_row = cols * torch.empty((), dtype=out_dtype).element_size()
    row_bytes = cols * torch.empty((), dtype=src_dtype).element_size()
    max_rows = max(1, CHUNK_BYTES // (4 * cols))
    bounce = torch.empty(1, cols, dtype=out_dtype)
    work = torch.empty(min(max_rows, rows), cols, dtype=torch.float32, device=device)
    scratch = None if src_dtype == out_dtype else torch.empty(min(max_rows, rows), cols, dtype=src_dtype)
    r0 = 0
    while r0 < rows:
        sp = w.space(min(max_rows, rows - r0) * out_row)
        fits = len(sp) // out_row  # whole rows that fit in the staging buffer
        target = torch.frombuffer(sp, dtype=out_dtype, count=fits * cols).view(fits, cols) if fits else bounce
        n = max(fits, 1)
        m1, m2 = (a32[:, r0 : r0 + n].T, b32.T) if pair.embedding else (b32[r0 : r0 + n], a32)
        w_rows = target if scratch is None else scratch[:n]  # W's rows: straight into the output buffer
        _read_into(
            src_fd, memoryview(w_rows.view(torch.uint8).numpy()).cast("B"), entry.src_offset + r0 * row_bytes
        )
        x = work[:n]
        x.copy_(w_rows)  # widen (and, with a GPU, host -> device)
        x.addmm_(m1, m2, alpha=pair.scale)
        target.copy_(x)  # the one rounding to the output dtype
        del target, w_rows  # drops torch's export of `sp`
        sp.release()
        if fits:
            w.commit(n * out_row)
        else:  # the row straddles two staging buffers: through the bounce buffer
            w.put(bounce.view(torch.uint8).numpy())
        advance(n * out_row)
        r0 += n


def write_shard(
    plan_shard: ShardPlan, dst: Path, lora: dict, advance, hash_file: bool, device=None
) -> tuple[list[str], str | None]:
    """Write one output shard (not yet fsynced); returns (merged tensor names, sha256 or None).

    Everything goes through `StagedWriter` in file order: the header, untouched tensors read from
    the source into the staging buffers, merged tensors computed into them. One thread writes, one
    hashes, the main thread computes ahead of both. `device`: torch device for the arithmetic
    (default CPU).
    """
    import hashlib

    import torch

    device = torch.device(device or "cpu")
    h = hashlib.sha256() if hash_file else None
    merged = []
    src_fd = os.open(plan_shard.src, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=1) as writer, ThreadPoolExecutor(max_workers=1) as hasher:
            w = StagedWriter(dst, h, writer, hasher)
            try:
                w.put(_header_bytes(plan_shard.entries, plan_shard.metadata))
                for e in plan_shard.entries:
                    if e.pair is None:
                        w.copy_from(src_fd, e.src_offset, e.src_nbytes)
                        advance(e.src_nbytes)
                    else:
                        a = lora[e.pair.a_key].to(device=device)
                        b = lora[e.pair.b_key].to(device=device)
                        _write_merged(src_fd, e, a, b, advance, w, device)
                        merged.append(e.name)
            except BaseException:
                w.abort()
                raise
            w.close()
    finally:
        os.close(src_fd)
    return merged, h.hexdigest() if h else None


def seal_output(path: Path, digest: str | None = None, hash_file: bool = False) -> str | None:
    """fsync a finished file (in a thread, overlapping the next shard); returns its sha256."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sha256_file(path) if hash_file and digest is None else digest


class _NoProgress(contextlib.AbstractContextManager):
    """The few `rich.progress.Progress` calls `merge_adapter` makes, doing nothing (rich not imported)."""

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, *args, **kwargs) -> int:
        return 0

    def advance(self, task: int, n: int) -> None:
        pass


def progress_bar(enabled: bool):
    """A rich progress bar on stderr, or (disabled) a stand-in: importing rich costs ~0.1 s."""
    if not enabled:
        return _NoProgress()
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
