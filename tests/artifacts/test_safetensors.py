"""safetensors headers are validated exactly as the safetensors loader validates them (its Rust crate)."""

import json
import struct

import pytest

from pipeline.artifacts.safetensors import HeaderError, read_safetensors_header, write_safetensors


def _file(tmp_path, header: dict, data: bytes, name="t.safetensors", pad=b""):
    hb = json.dumps(header).encode() + pad
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    return p


def _loader_refuses(p) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:  # noqa: BLE001 - whatever the loader raises
        return True
    return False


GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
}
BAD = {
    "overlap": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        bytes(12),
        "overlaps",
    ),
    "gap": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
        },
        bytes(20),
        "gap",
    ),
    "not_from_zero": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "gap"),
    "out_of_bounds": (
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        bytes(8),
        "leave the file",
    ),
    "trailing": (
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        bytes(12),
        "MetadataIncomplete",
    ),
    "size_vs_dtype": ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "needs"),
    "unknown_dtype": (
        {"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}},
        bytes(8),
        "unknown dtype",
    ),
    "negative_shape": (
        {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
        bytes(8),
        "non-negative",
    ),
    "end_before_start": (
        {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
        bytes(8),
        "before it starts",
    ),
    "misaligned_f4": ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2), "needs"),
    "bad_metadata": ({"__metadata__": {"format": 1}, **GOOD}, bytes(16), "strings"),
}


def test_good_file_reads(tmp_path):
    infos = read_safetensors_header(_file(tmp_path, GOOD, bytes(16)))
    assert list(infos) == ["a", "b"] and infos["b"].offset > infos["a"].offset


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_the_loader_refuses_is_refused(tmp_path, case):
    header, data, words = BAD[case]
    p = _file(tmp_path, header, data)
    with pytest.raises(HeaderError, match=words):
        read_safetensors_header(p)
    assert _loader_refuses(p), f"{case}: the safetensors loader accepts it, so must we"


def test_header_must_start_with_brace(tmp_path):
    p = _file(tmp_path, GOOD, bytes(16))
    raw = bytearray(p.read_bytes())
    raw[8:9] = b" "
    p.write_bytes(bytes(raw[:8]) + b" " + bytes(raw[9:]))
    with pytest.raises(HeaderError):
        read_safetensors_header(p)


def test_writer_output_loads(tmp_path):
    p = tmp_path / "w.safetensors"
    write_safetensors(p, {"x": ("F32", (2,), bytes(8)), "y": ("BF16", (3,), bytes(6))}, {"format": "pt"})
    assert set(read_safetensors_header(p)) == {"x", "y"} and not _loader_refuses(p)


def test_a_failed_write_leaves_no_partial_copy(tmp_path, monkeypatch):
    """A full disk during the write left `<file>.tmp` (the whole size) beside the file, and the pattern fold's
    sibling copy with it; the file itself is as it was."""
    import os

    path = tmp_path / "adapter_model.safetensors"
    write_safetensors(path, {"a": ("F32", (1,), b"\0\0\0\0")})
    before = path.read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(path, {"a": ("F32", (2,), b"\0" * 8)})
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_bytes() == before
