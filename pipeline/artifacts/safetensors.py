"""safetensors files, read without loading tensors: the header (8-byte little-endian length + JSON).

Format: https://github.com/huggingface/safetensors (README "Format"). The one place the
project parses a safetensors header; checkpoints, adapters, merge and fingerprints use it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype names -> bytes per element (https://github.com/huggingface/safetensors).
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E8M0": 1,
    "F4": 1,
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors refuses headers above 100 MB too


class HeaderError(ValueError):
    """A safetensors file whose header is truncated, garbage, or inconsistent with its size."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    nbytes: int
    offset: int = 0  # absolute byte offset of the data in the file


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header.

    Returns {tensor name: TensorInfo}; `__metadata__` is dropped.

    Raises:
        HeaderError: file shorter than 8 bytes, header length larger than the file or 100 MB,
            header not JSON, or a tensor whose offsets leave the file or disagree with its
            dtype x shape.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n > size - 8:
            raise HeaderError(
                f"{path}: header length {n} bytes is larger than the file ({size} bytes): truncated or not safetensors"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path}: header is not JSON ({e}): corrupt or not safetensors") from e
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise HeaderError(f"{path}: tensor {name}: malformed header entry {info!r}") from e
        if end > data_len or start > end:
            raise HeaderError(
                f"{path}: tensor {name}: data offsets [{start}, {end}) leave the file ({data_len} data bytes): truncated"
            )
        numel = 1
        for s in shape:
            numel *= s
        per = DTYPE_BYTES.get(dtype)
        if per is not None and dtype != "F4" and numel * per != end - start:
            raise HeaderError(
                f"{path}: tensor {name}: {dtype} {list(shape)} needs {numel * per} bytes, header says {end - start}"
            )
        out[name] = TensorInfo(name, dtype, shape, path.name, end - start, 8 + n + start)
    return out


def raw_header(path: Path) -> tuple[int, dict]:
    """(byte offset where the data section starts, the header as a dict incl. `__metadata__`).

    Call `read_safetensors_header` first when the file is untrusted: this only parses.
    Raises HeaderError for a file too short or a header that is not JSON.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: truncated: no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise HeaderError(f"{path}: header length {n} bytes is over the 100 MB limit")
        raw = f.read(n)
    try:
        return 8 + n, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path}: header is not JSON ({e}): corrupt or not safetensors") from e


def header_bytes(path: Path) -> bytes:
    """The raw JSON header bytes (for fingerprints: identifies names, dtypes, shapes, offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(min(n, MAX_HEADER))
