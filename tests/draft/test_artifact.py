"""The drafter directory and the checks that refuse a drafter the fleet must not serve (pipeline.draft.artifact).

Each bad input is refused with an error naming the tensor or file: a tensor outside mtp.*, another shape or dtype
than the reference checkpoint's mtp.*, a tensor missing, non-finite values, no gain over the base's MTP layer,
tensors changed after the record was written (DrafterRefused, exit 1), and a file missing (UsageError, exit 2).
"""

from __future__ import annotations

import pytest

from pipeline.draft.artifact import (
    RECORD_FILE,
    TENSORS_FILE,
    DrafterRecord,
    DrafterRefused,
    check_drafter,
    read_record,
    write_drafter,
)
from pipeline.errors import UsageError


def _figures(al: float) -> dict:
    return {"acceptance": [al - 1.0, 0.0, 0.0], "acceptance_length": al, "positions": 10, "sequences": 2}


def _record(before: float = 1.1, after: float = 1.5) -> DrafterRecord:
    return DrafterRecord(
        name="agent", version=1, base="b", reference="r", sha256="", acceptance_before=_figures(before),
        acceptance_after=_figures(after), data_sha256="d" * 64, eval_data_sha256="e" * 64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base_mtp(tiny_vl_base):
    from pipeline.validate.acceptance import mtp_tensors

    return mtp_tensors(tiny_vl_base)


def _drafter(tmp_path, state, record=None):
    return write_drafter(tmp_path / "drafter", state, record or _record())


def test_a_good_drafter_passes_and_is_bf16_mtp_only(tmp_path, tiny_vl_base, base_mtp):
    from pipeline.artifacts.hashing import sha256_file
    from pipeline.artifacts.safetensors import read_safetensors_header

    d = _drafter(tmp_path, {k: v.float() for k, v in base_mtp.items()})  # written as bf16 whatever it was
    rec = check_drafter(d, tiny_vl_base)
    assert rec.sha256 == sha256_file(d / TENSORS_FILE) and rec.tensors == len(base_mtp)
    header = read_safetensors_header(d / TENSORS_FILE)
    assert set(header) == set(base_mtp) and {i.dtype for i in header.values()} == {"BF16"}
    assert read_record(d).gain == pytest.approx(0.4)


@pytest.mark.parametrize(
    "case, match",
    [
        ("outside", r"tensor model\.norm\.weight is outside mtp\.\*"),
        ("unknown", r"tensor mtp\.layers\.1\.mlp\.up_proj\.weight is not in .*mtp\.\* tensors"),
        ("shape", r"tensor mtp\.fc\.weight is BF16 \[128, 128\], .* has BF16 \[128, 256\]"),
        ("missing", r"tensor mtp\.norm\.weight missing"),
        ("nan", r"tensor mtp\.fc\.weight has 1 non-finite values"),
        ("no_gain", r"estimated acceptance length 1\.1 is not above the base MTP layer's 1\.1"),
    ],
)
def test_bad_drafters_are_refused_naming_the_tensor(tmp_path, tiny_vl_base, base_mtp, case, match):
    import torch

    state = dict(base_mtp)
    record = _record()
    if case == "outside":
        state["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    elif case == "unknown":
        state["mtp.layers.1.mlp.up_proj.weight"] = base_mtp["mtp.layers.0.mlp.up_proj.weight"].clone()
    elif case == "shape":
        state["mtp.fc.weight"] = base_mtp["mtp.fc.weight"][:, :128]
    elif case == "missing":
        del state["mtp.norm.weight"]
    elif case == "nan":
        state["mtp.fc.weight"] = base_mtp["mtp.fc.weight"].clone()
        state["mtp.fc.weight"][0, 0] = float("nan")
    elif case == "no_gain":
        record = _record(1.1, 1.1)
    d = _drafter(tmp_path, state, record)
    with pytest.raises(DrafterRefused, match=match):
        check_drafter(d, tiny_vl_base)


def test_another_dtype_than_the_reference_is_refused(tmp_path, tiny_vl_base, base_mtp):
    """write_drafter always writes bf16: a drafter re-saved in float32 afterwards (sha256 updated) is refused."""
    import torch
    from safetensors.torch import save_file

    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.hashing import sha256_file

    d = _drafter(tmp_path, dict(base_mtp))
    save_file({k: v.to(torch.float32) for k, v in base_mtp.items()}, str(d / TENSORS_FILE))
    rec = read_record(d)
    rec.sha256 = sha256_file(d / TENSORS_FILE)
    write_json_atomic(d / RECORD_FILE, rec.model_dump(mode="json"))
    with pytest.raises(DrafterRefused, match=r"tensor mtp\.\S+ is F32 \[.*\], .* has BF16"):
        check_drafter(d, tiny_vl_base)


def test_tensors_changed_after_the_record_are_refused(tmp_path, tiny_vl_base, base_mtp):
    from safetensors.torch import save_file

    d = _drafter(tmp_path, dict(base_mtp))
    save_file({k: v.clone() * 2 for k, v in base_mtp.items()}, str(d / TENSORS_FILE))
    with pytest.raises(DrafterRefused, match=rf"{TENSORS_FILE}: sha256 differs from {RECORD_FILE}"):
        check_drafter(d, tiny_vl_base)


def test_missing_files_are_usage_errors(tmp_path, tiny_vl_base, tiny_base, base_mtp):
    d = _drafter(tmp_path, dict(base_mtp))
    (d / TENSORS_FILE).unlink()
    with pytest.raises(UsageError, match=rf"{TENSORS_FILE}: missing"):
        check_drafter(d, tiny_vl_base)
    (d / RECORD_FILE).unlink()
    with pytest.raises(UsageError, match=rf"{RECORD_FILE}: missing"):
        check_drafter(d, tiny_vl_base)
    d = _drafter(tmp_path / "again", dict(base_mtp))
    with pytest.raises(UsageError, match=r"no mtp\.\* tensors"):  # a reference without an MTP layer
        check_drafter(d, tiny_base)
