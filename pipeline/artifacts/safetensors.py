"""safetensors files, read without loading tensors: the header (8-byte little-endian length + JSON).

Format: https://github.com/huggingface/safetensors (README "Format"). The one place the
project parses a safetensors header; checkpoints, adapters, merge and fingerprints use it.

`read_safetensors_header` enforces exactly what the safetensors loader enforces (the Rust crate,
`safetensors/src/tensor.rs`: `SafeTensors::read_metadata` and `Metadata::validate`), so a file that
passes here also loads in vLLM, PEFT and transformers:
- at least 8 bytes; header length N <= 100,000,000 and 8 + N <= file size (HeaderTooLarge,
  InvalidHeaderLength); the header is UTF-8 JSON starting with `{` (InvalidHeaderStart);
- `__metadata__`, when present, maps strings to strings;
- every tensor has a known dtype, a shape of non-negative integers and `data_offsets` [start, end];
- sorted by offsets, tensors tile the data section: each starts where the previous ended (from 0),
  end >= start (InvalidOffset: gaps and overlaps), and end - start equals elements x dtype bits / 8
  (TensorInvalidInfo, MisalignedSlice);
- the last tensor ends exactly at the end of the file (MetadataIncompleteBuffer).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.bounded import BoundsError, loads_json
from pipeline.errors import UsageError

# safetensors dtype names -> bits per element (safetensors/src/tensor.rs `Dtype::bitsize`).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# bytes per element for whole-byte dtypes (sub-byte dtypes count as 1 for size estimates)
DTYPE_BYTES = {k: max(1, v // 8) for k, v in DTYPE_BITS.items()}
MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE


class HeaderError(UsageError, ValueError):
    """A safetensors file the safetensors loader would refuse: truncated, garbage, or inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    nbytes: int
    offset: int = 0  # absolute byte offset of the data in the file


def _read_raw(path: Path) -> tuple[int, int, bytes]:
    """(file size, header length N, header bytes); raises HeaderError for the size rules."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise HeaderError(f"{path}: header length {n} bytes is over safetensors' 100 MB limit")
        if n > size - 8:
            raise HeaderError(
                f"{path}: header length {n} bytes is larger than the file ({size} bytes): truncated or not safetensors"
            )
        return size, n, f.read(n)


def _parse(path: Path, raw: bytes) -> dict:
    if not raw.startswith(b"{"):
        raise HeaderError(
            f"{path}: header is not JSON (does not start with '{{'): corrupt or not safetensors"
        )
    try:  # size, depth and number bounds before and while parsing (pipeline.artifacts.bounded)
        header = loads_json(raw.decode("utf-8"), f"{path}: header", MAX_HEADER)
    except BoundsError as e:
        raise HeaderError(f"{e}: corrupt or not safetensors") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path}: header is not JSON ({e}): corrupt or not safetensors") from e
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    return header


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (no tensor data read).

    Returns {tensor name: TensorInfo} in offset order; `__metadata__` is dropped (see `file_metadata`).

    Raises:
        HeaderError: any rule of the module docstring broken; the message names the file and tensor.
        OSError: the file cannot be read (IsADirectoryError, PermissionError...).
    """
    path = Path(path)
    size, n, raw = _read_raw(path)
    header = _parse(path, raw)
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.200}")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise HeaderError(f"{path}: tensor {name}: malformed header entry {info!r:.200}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise HeaderError(
                f"{path}: tensor {name}: unknown dtype {dtype!r} (safetensors knows {sorted(DTYPE_BITS)})"
            )
        if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
            raise HeaderError(
                f"{path}: tensor {name}: shape {shape!r} is not a list of non-negative integers"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
            raise HeaderError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [start, end]")
        entries.append((tuple(offsets), name, dtype, tuple(shape)))
    entries.sort()
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    pos = 0
    for (start, end), name, dtype, shape in entries:
        if start != pos or end < start:
            what = "overlaps the previous tensor" if start < pos else "leaves a gap after the previous tensor"
            if end < start:
                what = "ends before it starts"
            raise HeaderError(
                f"{path}: tensor {name}: data offsets [{start}, {end}) {what} (expected to start at {pos}): "
                "the safetensors loader refuses it (InvalidOffset)"
            )
        if end > data_len:
            raise HeaderError(
                f"{path}: tensor {name}: data offsets [{start}, {end}) leave the file ({data_len} data bytes): truncated"
            )
        numel = 1
        for s in shape:
            numel *= s
        bits = numel * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - start:
            raise HeaderError(
                f"{path}: tensor {name}: {dtype} {list(shape)} needs {bits / 8:g} bytes, header says {end - start}"
            )
        out[name] = TensorInfo(name, dtype, shape, path.name, end - start, 8 + n + start)
        pos = end
    if pos != data_len:
        raise HeaderError(
            f"{path}: tensors cover {pos} of {data_len} data bytes: truncated or trailing garbage "
            "(the safetensors loader refuses it: MetadataIncompleteBuffer)"
        )
    return out


def file_metadata(path: Path) -> dict[str, str] | None:
    """The header's `__metadata__` (None when absent). Call `read_safetensors_header` first on untrusted files."""
    _, _, raw = _read_raw(Path(path))
    return _parse(Path(path), raw).get("__metadata__")


def raw_header(path: Path) -> tuple[int, dict]:
    """(byte offset where the data section starts, the header as a dict incl. `__metadata__`).

    Call `read_safetensors_header` first when the file is untrusted: this only parses.
    Raises HeaderError for a file too short or a header that is not JSON.
    """
    _, n, raw = _read_raw(Path(path))
    return 8 + n, _parse(Path(path), raw)


def header_bytes(path: Path) -> bytes:
    """The raw JSON header bytes (for fingerprints: identifies names, dtypes, shapes, offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(min(n, MAX_HEADER))


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None
) -> None:
    """Write a safetensors file: {name: (dtype, shape, raw little-endian bytes)} in the given order.

    The header is padded with spaces to a multiple of 8 bytes, as the safetensors writer does;
    `metadata` becomes `__metadata__` (strings only). Written to `path` + `.tmp`, fsynced, renamed; the
    `.tmp` is removed when the write fails.
    Raises HeaderError if a tensor's byte count disagrees with its dtype and shape.
    """
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for name, (dtype, shape, data) in tensors.items():
        numel = 1
        for s in shape:
            numel *= s
        if numel * DTYPE_BITS[dtype] != len(data) * 8:
            raise HeaderError(
                f"{path}: tensor {name}: {dtype} {list(shape)} does not match {len(data)} bytes"
            )
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, _, data in tensors.values():
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or an interrupt leaves no partial copy next to the file
        tmp.unlink(missing_ok=True)
        raise
