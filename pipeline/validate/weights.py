"""The adapter directory and its weights file: untrusted input, read only as regular files.

safetensors rules are the loader's own (`pipeline.artifacts.safetensors`); pickle files are never
loaded (they can run code).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from pipeline.artifacts.adapter import PICKLE_WEIGHTS, WEIGHTS_FILE
from pipeline.serving.vllm import ALLOWED_DTYPES
from pipeline.validate.facts import AdapterFacts
from pipeline.validate.rules import Issue, Unavailable, check, grouped
from pipeline.validate.values import OTHER_FILES_BYTES, SIZE_BAND


@check("adapter.missing", "error", "the adapter directory does not exist")
def adapter_missing(ctx: AdapterFacts):
    if not ctx.adapter_dir.is_dir():
        what = (
            "is a file, not an adapter directory: give the directory holding adapter_config.json"
            if ctx.adapter_dir.exists()
            else "adapter directory not found: check the path"
        )
        yield Issue(what, str(ctx.adapter_dir))


@check(
    "adapter.unsafe_file",
    "error",
    "a symlink or special file (FIFO, socket, device) in the adapter directory: "
    "never read, copied or registered",
)
def unsafe_file(ctx: AdapterFacts):
    for p, what in ctx.scan.unsafe:
        yield Issue(
            f"{what} in the adapter directory: only regular files are read, copied or registered (a symlink can expose "
            "files from outside the directory); replace it with the file it points to, or remove it",
            str(p),
        )


# Files that hold model weights (safetensors, torch pickles, GGUF, NumPy, Keras/Flax, ONNX): an adapter
# directory holds one, `adapter_model.safetensors` (the pickle forms have their own checks, weights.pickle).
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".npz",
    ".npy",
    ".h5",
    ".msgpack",
    ".onnx",
)


def weights_format(p: Path) -> str | None:
    """Why `p` holds weights: its name (a weights suffix, any case), or its first bytes whatever its name
    (safetensors' 8-byte header length then `{`, a torch.save zip archive, a pickle, GGUF, NumPy); None if neither."""
    if p.name.lower().endswith(WEIGHT_SUFFIXES):
        return "by its name"
    try:
        with open(p, "rb") as f:
            head = f.read(16)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < size:
        return "a safetensors file by its content"
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(p) as z:
                if any(n.endswith("data.pkl") for n in z.namelist()[:4096]):
                    return "a torch.save archive by its content"
        except (zipfile.BadZipFile, OSError, ValueError):
            return None
        return None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle by its content"
    if head.startswith((b"GGUF", b"\x93NUMPY")):
        return "a GGUF/NumPy file by its content"
    return None


@check(
    "adapter.extra_weights",
    "error",
    "the adapter directory carries weight files besides `adapter_model.safetensors` (a base model's "
    "`model.safetensors`, shards, MLflow's `persist_pretrained_model` layout...), listed in the manifest or not; "
    "known by name (any case) or by content (safetensors, torch.save, pickle, GGUF, NumPy under another name)",
)
def extra_weights(ctx: AdapterFacts):
    own = {ctx.adapter_dir / WEIGHTS_FILE} | {ctx.adapter_dir / p for p in PICKLE_WEIGHTS}
    extra = [(p, what) for p in ctx.scan.files if p not in own and (what := weights_format(p))]
    for p, what in extra:
        rel = p.relative_to(ctx.adapter_dir)
        yield Issue(
            f"{rel} ({p.stat().st_size:,} bytes, {what}) is a weights file, and an adapter directory carries one: "
            f"{WEIGHTS_FILE}. Register and publish would copy it to the registry and every instance's volume "
            "(a base model's weights are tens of GB); move it out of the adapter directory",
            str(p),
        )


@check(
    "adapter.size",
    "error",
    "the adapter directory is larger than its weights (bounded by r, the modules and the base's shapes: "
    "`values.size_band`) plus what its other files may hold",
)
def artifact_size(ctx: AdapterFacts):
    expected = ctx.expected_weights_bytes
    if not expected:
        return
    total = sum(p.stat().st_size for p in ctx.scan.files)
    try:  # peft's copies of the base embedding inside the weights file (keys.base_copy says what they are)
        copies = sum(i.nbytes for i in ctx.base_copies.values())
    except Unavailable:
        copies = 0
    bound = int(expected * SIZE_BAND[1]) + copies + OTHER_FILES_BYTES
    if total > bound:
        biggest = sorted(ctx.scan.files, key=lambda p: p.stat().st_size, reverse=True)[:3]
        yield Issue(
            f"the adapter directory holds {total:,} bytes; r, target_modules and the base's shapes imply {expected:,} "
            f"bytes of weights, so at most {bound:,} in all ({SIZE_BAND[1]:g}x the weights + {OTHER_FILES_BYTES >> 20} "
            f"MiB of config, tokenizer and manifest): largest files {[str(p.relative_to(ctx.adapter_dir)) for p in biggest]}; "
            "remove what is not the adapter",
            str(ctx.adapter_dir),
        )


@check(
    "base.missing",
    "error",
    "no base checkpoint to validate against (register/run/validate need one)",
    option="require_base",
)
def base_missing(ctx: AdapterFacts):
    if ctx.base_dir is None:
        why = ""
        if ctx.manifest_problem:  # the base would have come from the manifest: say why it did not
            why = f" (the base named in the manifest is unknown: {ctx.manifest_problem})"
        elif ctx.manifest and ctx.manifest.base_model.id:
            why = f" (the manifest's base_model {ctx.manifest.base_model.id!r} is not a local directory)"
        yield Issue(
            f"no base checkpoint to validate against{why}: pass --base DIR or set base.path in pipeline.yaml",
            str(ctx.adapter_dir),
        )


@check(
    "base.unreadable", "error", "the base checkpoint cannot be read (no config.json, corrupt shard header)"
)
def base_unreadable(ctx: AdapterFacts):
    err = ctx.base_fact.missing
    if err:
        yield Issue(f"{err}: pass --base with the bf16 checkpoint directory", str(ctx.base_dir))


def _state(ctx: AdapterFacts, name):
    if not ctx.adapter_dir.is_dir():
        return
    ws = ctx.weights_state
    if ws.state == name:
        yield ws.detail


@check("weights.missing", "error", f"no `{WEIGHTS_FILE}`")
def weights_missing(ctx: AdapterFacts):
    for _ in _state(ctx, "missing"):
        yield Issue(f"{WEIGHTS_FILE} is missing: copy it from the training output_dir", str(ctx.adapter_dir))


@check("weights.not_file", "error", f"`{WEIGHTS_FILE}` is a directory, symlink or special file")
def weights_not_file(ctx: AdapterFacts):
    for kind in _state(ctx, "not_file"):
        yield Issue(
            f"{WEIGHTS_FILE} is {kind}, not a regular file: copy the real weights file from the training output_dir",
            str(ctx.wfile),
        )


@check("weights.pickle", "error", "only a pickle weights file (`adapter_model.bin`...): can run code on load")
def weights_pickle(ctx: AdapterFacts):
    for p in _state(ctx, "pickle"):
        yield Issue(
            f"{p} is a pickle file (can run code on load; the pipeline verifies safetensors only): re-save with "
            "save_pretrained(safe_serialization=True)",
            str(ctx.adapter_dir / p),
        )


@check("weights.ambiguous", "error", "both safetensors and a pickle weights file")
def weights_ambiguous(ctx: AdapterFacts):
    for p in _state(ctx, "ambiguous"):
        yield Issue(
            f"both {WEIGHTS_FILE} and {p} present: which one loads depends on the loader; delete the pickle file",
            str(ctx.adapter_dir),
        )


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # a Git LFS pointer file's first line


@check(
    "weights.header",
    "error",
    "the safetensors loader would refuse the file: truncated, not JSON, header too "
    "long, offsets overlapping/gapped/out of bounds, size vs dtype x shape, trailing bytes",
)
def weights_header(ctx: AdapterFacts):
    for detail in _state(ctx, "header"):
        try:
            with open(ctx.wfile, "rb") as f:
                lfs = f.read(len(LFS_POINTER)) == LFS_POINTER
        except OSError:
            lfs = False
        if lfs:
            yield Issue(
                f"{ctx.wfile.name} is a Git LFS pointer (a few lines of text naming the real file), not the weights: "
                "the repository was cloned or copied without `git lfs pull`; fetch the LFS objects and re-copy",
                str(ctx.wfile),
            )
            continue
        yield Issue(f"{detail}; re-copy the file from the training output (or re-save it)", str(ctx.wfile))
    for detail in _state(ctx, "unreadable"):
        yield Issue(f"{detail}: check permissions and re-copy the file", str(ctx.wfile))


@check("weights.empty", "error", "no tensors in the weights file")
def weights_empty(ctx: AdapterFacts):
    for _ in _state(ctx, "empty"):
        yield Issue("no tensors in the weights file: re-save the adapter", str(ctx.wfile))


@check("weights.dtype", "error", "a tensor is not bf16/fp16/fp32")
def weights_dtype(ctx: AdapterFacts):
    yield from grouped(
        Issue(
            f"dtype {info.dtype}; vLLM loads bf16/fp16/fp32 LoRA weights: re-save in bf16",
            f"{ctx.wfile}:{name}",
        )
        for name, info in ctx.header.items()
        if info.dtype not in ALLOWED_DTYPES
    )


@check(
    "weights.metadata",
    "warning",
    'no `__metadata__` or its `format` is not `pt` (some loaders need `{"format": "pt"}`; publish writes it)',
    severity_doc="warning (error on a published directory)",
)
def weights_metadata(ctx: AdapterFacts):
    meta = ctx.metadata
    fmt = (meta or {}).get("format")
    if fmt == "pt":
        return
    what = "has no __metadata__" if meta is None else f"has __metadata__ format {fmt!r}"
    if ctx.published:
        yield Issue(
            f"{what}; transformers' loader needs {{'format': 'pt'}}: re-publish the version",
            str(ctx.wfile),
            "error",
        )
    else:
        yield Issue(
            f"{what}; transformers/PEFT's loader needs {{'format': 'pt'}}: `pipeline publish` writes it (tensor bytes "
            "unchanged; recorded in the manifest)",
            str(ctx.wfile),
        )
