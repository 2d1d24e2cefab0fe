"""A version's drafter on disk: `mtp.safetensors` (the `mtp.*` tensors, bf16) and `drafter.json`, and the checks
that refuse a drafter the fleet must not serve.

Layout of a drafter directory (an artifact of the drafter's MLflow run, linked from the model version):
- `mtp.safetensors`: exactly the served checkpoint's `mtp.*` tensor names, shapes and dtypes (bf16 in the
  fleet's NVFP4 checkpoint: modelopt's recipe excludes `mtp*` from quantization), finite values;
- `drafter.json` (`DrafterRecord`): the file's sha256, the estimated acceptance before (the base's MTP layer)
  and after (this drafter) on the adapter's validation prompts, the digest of the data it was distilled on,
  the version and base it belongs to, and the measured acceptance once an engine served it (null until then).

`check_drafter` refuses, each with an error naming the file or tensor: a file missing (UsageError, exit 2), a
sha256 that differs from the record, a tensor outside `mtp.*`, a tensor the reference checkpoint's `mtp.*` lacks
or one it has that the drafter lacks, another shape or dtype, non-finite values, and a drafter whose estimated
acceptance length is not above the base MTP layer's (DrafterRefused, exit 1).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.bounded import load_json_file
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.safetensors import HeaderError, read_safetensors_header
from pipeline.errors import CheckFailed, UsageError
from pipeline.validate.acceptance import MTP_PREFIX, checkpoint_shards

TENSORS_FILE = "mtp.safetensors"
RECORD_FILE = "drafter.json"
FORMAT = 1


class DrafterRefused(CheckFailed):
    """A drafter the fleet must not serve (wrong tensors, shapes, dtypes, values, no gain): exit 1."""


class DrafterRecord(BaseModel):
    """`drafter.json`: what the drafter is, what it was distilled on, and what it is expected to do."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT
    name: str = Field(description="registered model the drafter belongs to")
    version: int = Field(description="its model version (the adapter the drafter was distilled for)")
    base: str = Field(description="the base checkpoint whose MTP layer it started from")
    reference: str = Field(description="the checkpoint whose mtp.* names, shapes and dtypes it must match")
    adapter_weights_sha256: str | None = None
    sha256: str = Field(description=f"sha256 of {TENSORS_FILE}")
    tensors: int = 0
    acceptance_before: dict = Field(
        description="estimate with the base's MTP layer (validate.acceptance.score)"
    )
    acceptance_after: dict = Field(description="estimate with this drafter, same prompts")
    data_sha256: str = Field(description="sha256 of the distillation prompts' token ids")
    eval_data_sha256: str = Field(description="sha256 of the estimate's prompts' token ids")
    train: dict = Field(
        default_factory=dict, description="steps, seconds, lr, prompts, new_tokens, device, seed"
    )
    mlflow_run_id: str | None = None
    measured_acceptance: dict | None = Field(
        None, description="on an engine serving it (pipeline canary); null until"
    )

    @property
    def gain(self) -> float | None:
        a, b = self.acceptance_after.get("acceptance_length"), self.acceptance_before.get("acceptance_length")
        return None if a is None or b is None else round(a - b, 4)


def write_drafter(out: Path, state: dict, record: DrafterRecord) -> Path:
    """Write `state` (`mtp.*` name -> tensor, cast to bf16) and `record` (its sha256 filled in) into `out`.

    The tensors are written to a temporary name and renamed; `drafter.json` last (atomic). Returns `out`.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TENSORS_FILE + ".tmp")
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / TENSORS_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    record.sha256 = sha256_file(out / TENSORS_FILE)
    record.tensors = len(tensors)
    write_json_atomic(out / RECORD_FILE, record.model_dump(mode="json"))
    return out


def read_record(d: Path) -> DrafterRecord:
    """`drafter.json` of drafter directory `d`. Raises UsageError when it is missing or malformed."""
    p = Path(d) / RECORD_FILE
    if not p.is_file():
        raise UsageError(f"{p}: missing (a drafter directory holds {TENSORS_FILE} and {RECORD_FILE})")
    try:
        return DrafterRecord.model_validate(load_json_file(p, 16 << 20))
    except ValueError as e:  # JSON, bounds or pydantic's ValidationError
        raise UsageError(f"{p}: not a drafter record ({e})") from e


def reference_headers(ckpt: Path) -> dict:
    """{`mtp.*` name: TensorInfo} of a checkpoint (headers only). Raises UsageError when it has none."""
    out = {}
    for f in checkpoint_shards(ckpt):
        try:
            out.update({k: v for k, v in read_safetensors_header(f).items() if k.startswith(MTP_PREFIX)})
        except (HeaderError, OSError) as e:
            raise UsageError(f"{f}: unreadable safetensors header ({e})") from e
    if not out:
        raise UsageError(f"{ckpt}: no {MTP_PREFIX}* tensors: a drafter needs a checkpoint with an MTP layer")
    return out


def check_drafter(d: Path, reference: Path) -> DrafterRecord:
    """Refuse a drafter the fleet must not serve; returns its record when it may be served.

    Args: `d` the drafter directory; `reference` the checkpoint it must match (the served checkpoint when it
    has `mtp.*` tensors, else the base).
    Raises UsageError (exit 2): a file missing or unreadable. DrafterRefused (exit 1): the first of the
    problems in the module docstring, naming the tensor or file, and how many problems there were.
    """
    import torch
    from safetensors import safe_open

    d = Path(d)
    record = read_record(d)
    path = d / TENSORS_FILE
    if not path.is_file():
        raise UsageError(f"{path}: missing (the drafter's tensors)")
    problems: list[str] = []
    if sha256_file(path) != record.sha256:
        problems.append(f"{path}: sha256 differs from {RECORD_FILE} (changed after it was written)")
    try:
        header = read_safetensors_header(path)
    except (HeaderError, OSError) as e:
        raise DrafterRefused(f"{path}: not a safetensors file ({e})") from e
    ref = reference_headers(reference)
    for name, info in header.items():
        if not name.startswith(MTP_PREFIX):
            problems.append(
                f"{path}: tensor {name} is outside {MTP_PREFIX}* (a drafter holds the MTP layer only)"
            )
        elif name not in ref:
            problems.append(f"{path}: tensor {name} is not in {reference}'s {MTP_PREFIX}* tensors")
        elif tuple(info.shape) != tuple(ref[name].shape) or info.dtype != ref[name].dtype:
            problems.append(
                f"{path}: tensor {name} is {info.dtype} {list(info.shape)}, {reference} has "
                f"{ref[name].dtype} {list(ref[name].shape)}"
            )
    problems += [
        f"{path}: tensor {n} missing (in {reference}'s {MTP_PREFIX}*)" for n in sorted(set(ref) - set(header))
    ]
    with safe_open(str(path), "pt") as sf:
        for name in sf.keys():
            t = sf.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                problems.append(f"{path}: tensor {name} has {bad} non-finite values (NaN/inf)")
    gain = record.gain
    if gain is None or gain <= 0:
        problems.append(
            f"{d / RECORD_FILE}: estimated acceptance length {record.acceptance_after.get('acceptance_length')} is "
            f"not above the base MTP layer's {record.acceptance_before.get('acceptance_length')}: the drafter does not "
            "improve the estimate (distil longer: --budget-s, more training prompts, or another --lr)"
        )
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})" if len(problems) > 1 else ""
        raise DrafterRefused(f"drafter refused: {problems[0]}{more}")
    return record
