"""The fleet's served checkpoint built from a bf16 base: NVFP4 + MTP through nvidia-modelopt (`pipeline dev served-base`).

Typically from `pipeline dev real-base BF16 --layers 8` (6 Gated-DeltaNet + 2 full-attention layers
and the MTP layer, Qwen3.6-27B shapes): `pipeline.merge.quantize.quantize_checkpoint` does the
work (recipe and sources there); this module writes OUT whole and records what was done in
`OUT/manifest.json` (`kind: served-checkpoint`, the quantizer record, sha256 of every file).
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.manifest import MANIFEST, file_hashes, package_versions
from pipeline.dev.output import write_whole
from pipeline.merge.quantize import DEFAULT_MAX_SEQ_LEN, load_calibration, quantize_checkpoint

log = logging.getLogger(__name__)


def build_served_base(
    src: Path,
    out: Path,
    *,
    device: str = "auto",
    calib_data: Path | None = None,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    max_shard_size: str = "5GB",
) -> dict:
    """Quantize the bf16 checkpoint `src` into the served format at `out`; returns the manifest.

    `out` is checked and written whole as `pipeline.dev.output.write_whole` says. Raises
    UsageError for bad input (see `quantize_checkpoint`, `load_calibration`) before `out` changes.
    """
    items, source = load_calibration(calib_data)
    with write_whole(out) as partial:
        record = quantize_checkpoint(
            src,
            partial,
            device=device,
            calibration=items,
            calibration_source=source,
            max_seq_len=max_seq_len,
            max_shard_size=max_shard_size,
        )
        manifest = {
            "schema": 1,
            "kind": "served-checkpoint",
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "quantization": record,
            "files": file_hashes(partial),
            "versions": package_versions(("nvidia-modelopt", "transformers", "torch", "lora-pipeline")),
        }
        write_json_atomic(partial / MANIFEST, manifest)
    log.info("served checkpoint in %s", out)
    return manifest
