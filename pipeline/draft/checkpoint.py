"""A served checkpoint with a version's drafter in place of its MTP layer: what vLLM is given as the draft model.

vLLM 0.25.1 drafts with `speculative_config.model` when it is set (`vllm/config/speculative.py`:
`draft_model_config = ModelConfig(model=self.model, ...)`), else with the target's own checkpoint; for MTP
methods it then shares the target's embedding and lm_head with the draft (`vllm/v1/spec_decode/
llm_base_proposer.py` `_maybe_share_embeddings`, seen on the H200: "Detected MTP model. Sharing target model
embedding weights"). The draft model class (`Qwen3_5MTP.load_weights`, `vllm/model_executor/models/
qwen3_5_mtp.py`) reads only the `mtp.*`, `embed_tokens` and `lm_head` tensors of the files it is given.

`drafter_checkpoint` builds that directory from the served checkpoint without copying what does not change:
every file is hard-linked (copied where the filesystem cannot link), except the safetensors shards that hold
`mtp.*` tensors, which are rewritten with the drafter's values (same names, shapes and dtypes, checked by
`pipeline.draft.artifact.check_drafter` first). Shard names and `model.safetensors.index.json` stay as they
are, so the index still names every tensor once. A 27B NVFP4 checkpoint keeps its 15 `mtp.*` tensors in bf16
(modelopt's recipe excludes `mtp*`, `pipeline.merge.quantize`): only the shard(s) holding them are written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.safetensors import read_safetensors_header
from pipeline.errors import UsageError
from pipeline.validate.acceptance import MTP_PREFIX, checkpoint_shards

from .artifact import TENSORS_FILE, check_drafter

MARKER = "drafter-of.json"  # written last: which drafter this checkpoint carries (its sha256)


def _link_or_copy(src: Path, dst: Path) -> str:
    try:
        os.link(src, dst)
        return "linked"
    except OSError:  # another filesystem, or links refused
        shutil.copy2(src, dst)
        return "copied"


def drafter_checkpoint(served: Path, drafter: Path, out: Path) -> dict:
    """Write OUT: `served` with its `mtp.*` tensors replaced by the drafter's.

    Args:
        served: the checkpoint the fleet serves (NVFP4 or bf16), with `mtp.*` tensors.
        drafter: a drafter directory (`mtp.safetensors` + `drafter.json`, `pipeline draft`); it must pass
            `check_drafter(drafter, served)`.
        out: a new directory (or one this function wrote before: replaced whole). Written as `OUT.partial`
            and renamed when complete, so a failure leaves OUT as it was.
    Returns {"out", "rewritten": [shard names], "linked": n, "copied": n, "bytes_written": bytes of the
    rewritten shards, "drafter_sha256"}.
    Raises UsageError (exit 2): `served` has no `mtp.*` tensors or is not a directory, OUT exists and is not
    a drafter checkpoint. DrafterRefused (exit 1): the drafter does not match `served` (see `check_drafter`).
    """
    import torch  # noqa: F401  (safetensors' torch backend)
    from safetensors import safe_open
    from safetensors.torch import save_file

    served, drafter, out = Path(served), Path(drafter), Path(out)
    if not served.is_dir():
        raise UsageError(f"{served}: not a checkpoint directory")
    if out.exists() and not (out / MARKER).is_file():
        raise UsageError(
            f"{out} exists and is not a drafter checkpoint ({MARKER} missing): give a new directory"
        )
    record = check_drafter(drafter, served)
    holders = [
        f
        for f in checkpoint_shards(served)
        if any(k.startswith(MTP_PREFIX) for k in read_safetensors_header(f))
    ]
    if not holders:
        raise UsageError(
            f"{served}: no {MTP_PREFIX}* tensors: the fleet's checkpoint has no MTP layer to replace"
        )
    with safe_open(str(drafter / TENSORS_FILE), "pt") as sf:
        new = {k: sf.get_tensor(k) for k in sf.keys()}
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    res = {"out": str(out), "rewritten": [], "linked": 0, "copied": 0, "bytes_written": 0,
           "drafter_sha256": record.sha256}  # fmt: skip
    try:
        for src in sorted(served.rglob("*")):
            rel = src.relative_to(served)
            dst = partial / rel
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src in holders:
                with safe_open(str(src), "pt") as sf:
                    meta = sf.metadata() or {"format": "pt"}
                    tensors = {
                        k: (new[k] if k.startswith(MTP_PREFIX) else sf.get_tensor(k)) for k in sf.keys()
                    }
                save_file(tensors, str(dst), metadata=meta)
                res["rewritten"].append(str(rel))
                res["bytes_written"] += dst.stat().st_size
            else:
                res[_link_or_copy(src, dst)] += 1
        write_json_atomic(partial / MARKER, {"served": str(served), "drafter": str(drafter)} | res)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return res
