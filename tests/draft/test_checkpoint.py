"""A served checkpoint with a drafter in place of its MTP layer (pipeline.draft.checkpoint.drafter_checkpoint).

What does not change is linked, the shards holding `mtp.*` are rewritten with the drafter's values, the index
is unchanged; a drafter that does not match the served checkpoint is refused and nothing is written.
"""

from __future__ import annotations

import json

import pytest

from pipeline.draft.artifact import DrafterRefused, write_drafter
from pipeline.draft.checkpoint import MARKER, drafter_checkpoint
from pipeline.errors import UsageError
from tests.draft.test_artifact import _record


@pytest.fixture(scope="module")
def base_mtp(tiny_vl_base):
    from pipeline.validate.acceptance import mtp_tensors

    return mtp_tensors(tiny_vl_base)


def _state(base_mtp, shift: float = 0.5):
    return {k: v.float() + shift for k, v in base_mtp.items()}


def test_the_drafter_replaces_the_mtp_layer_and_the_rest_is_linked(tmp_path, tiny_vl_base, base_mtp):
    import torch

    from pipeline.validate.acceptance import checkpoint_shards, mtp_tensors

    d = write_drafter(tmp_path / "drafter", _state(base_mtp), _record())
    out = tmp_path / "ckpt"
    res = drafter_checkpoint(tiny_vl_base, d, out)
    got = mtp_tensors(out)
    assert set(got) == set(base_mtp)
    for k, v in got.items():  # the drafter's values, in the served dtype
        assert v.dtype == base_mtp[k].dtype
        assert torch.equal(v, (base_mtp[k].float() + 0.5).to(v.dtype)), k
    assert res["rewritten"] and res["linked"] + res["copied"] >= 2
    # everything else is the same file (a hard link) and the index is the served one
    for f in tiny_vl_base.rglob("*"):
        if f.is_file() and f.name not in res["rewritten"]:
            assert (out / f.relative_to(tiny_vl_base)).read_bytes() == f.read_bytes(), f.name
    assert [p.name for p in checkpoint_shards(out)] == [p.name for p in checkpoint_shards(tiny_vl_base)]
    assert json.loads((out / MARKER).read_text())["drafter_sha256"] == res["drafter_sha256"]
    assert not (tmp_path / "ckpt.partial").exists()
    # built again from another drafter: replaced whole
    d2 = write_drafter(tmp_path / "drafter2", _state(base_mtp, 1.0), _record())
    drafter_checkpoint(tiny_vl_base, d2, out)
    k = sorted(base_mtp)[0]
    assert torch.equal(mtp_tensors(out)[k], (base_mtp[k].float() + 1.0).to(base_mtp[k].dtype))


def test_a_drafter_of_another_shape_is_refused_and_nothing_is_written(tmp_path, tiny_vl_base, base_mtp):
    import torch

    state = _state(base_mtp)
    k = sorted(state)[0]
    state[k] = torch.zeros(*state[k].shape[:-1], state[k].shape[-1] + 1)
    d = write_drafter(tmp_path / "drafter", state, _record())
    with pytest.raises(DrafterRefused, match=k.replace(".", r"\.")):
        drafter_checkpoint(tiny_vl_base, d, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()


def test_a_checkpoint_without_mtp_and_a_foreign_out_dir_are_usage_errors(
    tmp_path, tiny_vl_base, tiny_base, base_mtp
):
    d = write_drafter(tmp_path / "drafter", _state(base_mtp), _record())
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a drafter checkpoint"):
        drafter_checkpoint(tiny_vl_base, d, foreign)
    assert (foreign / "notes.txt").read_text() == "keep"
    with pytest.raises((UsageError, DrafterRefused), match="mtp"):
        drafter_checkpoint(tiny_base, d, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
