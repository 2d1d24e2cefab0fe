"""benchmarks/mtp_distill.py: the drafter it trains computes what vLLM's `qwen3_5_mtp` proposer computes.

The fast tests check the pieces on the tiny VL base (CPU, about a second each): the multi-step
attention mask against a plain causal recomputation per start position (what the drafter's KV cache
holds at each draft step), distinct prompts and a split by prompt. The slow one distills the tiny
base's MTP layer, serves it on vLLM's CPU build with `qwen3_5_mtp` (3 tokens) and compares vLLM's own
spec-decode counters with the distillation's estimate.
"""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import mtp_distill  # noqa: E402


@pytest.fixture(scope="module")
def parts(tiny_vl_base):
    """(mtp, embed, rotary, text config) of the tiny VL base, MTP weights as in the checkpoint (random)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_vl_base), dtype=torch.float32).eval()
    tensors = {k: v for f in sorted(tiny_vl_base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    cfg = model.config.get_text_config()
    mtp = mtp_distill._Mtp(cfg, {k: v for k, v in tensors.items() if k.startswith("mtp.")}, "cpu")
    return mtp, model.get_input_embeddings(), model.model.rotary_emb, cfg


def _reference(mtp, embed, rotary, hidden, ids, start: int, steps: int):
    """Draft steps 1..steps from one start position, one step at a time, each with plain causal
    attention over what vLLM's drafter KV cache holds then: first-pass entries at 0..start, then one
    entry per earlier draft step of this start (a single layer's keys depend only on its inputs)."""
    import torch

    z1 = mtp.fc(mtp.fc_inputs(embed(ids[:, 1 : start + 2]), hidden[:, : start + 1]))
    seq, prev, outs = z1, None, []
    for k in range(steps):
        if k:
            z = mtp.fc(mtp.fc_inputs(embed(ids[:, start + k + 1 : start + k + 2]), prev))
            seq = torch.cat([seq, z], 1)
        pos = torch.arange(seq.shape[1])
        causal = pos[None, :] <= pos[:, None]
        prev = mtp.forward(seq, mtp_distill._pos_emb(rotary, seq, pos), causal)[:, -1:]
        outs.append(prev[:, 0])
    return outs


def test_draft_steps_attend_to_what_vllms_kv_cache_holds(parts):
    """Every draft step's output at every start equals the step-by-step causal recomputation; the old
    parallel unroll (step k attending to step-k outputs of earlier starts) does not."""
    import torch

    mtp, embed, rotary, cfg = parts
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    hidden = torch.randn(2, 12, cfg.hidden_size, generator=g)
    for p in mtp.parameters():  # larger than the checkpoint's 0.02: attention visibly matters
        p.data.normal_(0, 0.2, generator=g)
    with torch.no_grad():
        outs = mtp_distill._unrolled(mtp, embed, hidden, ids, rotary, 3)
        assert [o.shape[1] for o in outs] == [11, 10, 9]
        for start in (0, 4, 8):
            ref = _reference(mtp, embed, rotary, hidden, ids, start, 3)
            for k in range(3):
                torch.testing.assert_close(outs[k][:, start], ref[k], rtol=1e-4, atol=1e-4)
        # the mask matters: step 2 attending to step-2 entries of earlier starts differs
        z1 = mtp.fc(mtp.fc_inputs(embed(ids[:, 1:]), hidden[:, :-1]))
        o1 = mtp.forward(
            z1, mtp_distill._pos_emb(rotary, z1, torch.arange(11)), torch.ones(11, 11).tril().bool()
        )
        z2 = mtp.fc(mtp.fc_inputs(embed(ids[:, 2:]), o1[:, :10]))
        pos = torch.arange(1, 11)
        par = mtp.forward(z2, mtp_distill._pos_emb(rotary, z2, pos), torch.ones(10, 10).tril().bool())
        torch.testing.assert_close(o1, outs[0], rtol=1e-4, atol=1e-4)
        assert (par[:, 8] - outs[1][:, 8]).abs().max() > 1e-3


def test_prompts_distinct_and_split_by_prompt(tiny_vl_base):
    """The repository's chat prompts cut to 48 ids repeat (the first GPU run held 2 of its 12 test
    prompts in training too); `_prompts` returns distinct ones and `_split` disjoint slices."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_base))
    prompts = mtp_distill._prompts(tok, 96, 48, 0)
    assert len(prompts) == 96 and all(len(p) == 48 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 96
    test, val, train = mtp_distill._split(96)
    assert (test.stop - test.start, val.stop - val.start, train.stop - train.start) == (12, 12, 72)
    assert test.stop == val.start and val.stop == train.start
    with pytest.raises(ValueError, match="too few"):
        mtp_distill._split(5)


def test_graft_mtp_replaces_only_the_mtp_tensors(tiny_vl_base, tmp_path):
    """benchmarks/mtp_acceptance.py serves a second checkpoint (the NVFP4 one) with the base's distilled
    MTP layer: only `mtp.*` change, to the source's bytes; a checkpoint with other MTP names or shapes is
    refused before anything is written. (Its engine part runs as a benchmark only: ~85 s on CPU.)"""
    import json
    import shutil

    import mtp_acceptance
    import torch
    from safetensors.torch import load_file, save_file

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    src = shutil.copytree(tiny_vl_base, tmp_path / "src")
    dst = shutil.copytree(tiny_vl_base, tmp_path / "dst")
    for f in src.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: (v + 1 if k.startswith("mtp.") else v) for k, v in t.items()}, str(f), {"format": "pt"})
    before = tensors(dst)
    assert mtp_acceptance.graft_mtp(src, dst)
    after, want = tensors(dst), tensors(src)
    for k, v in after.items():
        assert v.equal(want[k] if k.startswith("mtp.") else before[k]), k

    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    name = next(k for k in idx["weight_map"] if k.startswith("mtp.fc"))
    f = dst / idx["weight_map"][name]
    t = load_file(str(f))
    t[name] = torch.zeros(2, 2, dtype=t[name].dtype)
    save_file(t, str(f), {"format": "pt"})
    snapshot = {p.name: p.read_bytes() for p in dst.glob("*.safetensors")}
    with pytest.raises(ValueError, match="mtp.fc"):
        mtp_acceptance.graft_mtp(src, dst)
    assert snapshot == {p.name: p.read_bytes() for p in dst.glob("*.safetensors")}
