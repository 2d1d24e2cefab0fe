"""Exact sample packing (pipeline.train.packing): packed and unpacked per-sample logits and losses agree.

CPU, no fla: the boundary rule runs through the module's torch reference (the same boundaries the
fla kernels get on a GPU; benchmarks/packing_check.py measures those on the H200). Each leaking
path is shown to leak without the patch, so these tests fail when the patch stops working.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.train import packing

LENGTHS = [37, 70, 20]  # crosses the delta rule's 64-token chunks and the 4-tap conv window


@pytest.fixture(scope="module")
def models(tiny_base, tiny_vl_base):
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32).eval()
    vl = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_vl_base), dtype=torch.float32).eval()
    return {"qwen3_5_text": text, "qwen3_5": vl}


@pytest.fixture()
def unpatched():
    yield
    for mt in ("qwen3_5", "qwen3_5_text"):
        packing.restore(mt)


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (n,), generator=g) for n in LENGTHS]


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def _logits(model, **kw):
    with torch.no_grad():
        return model(use_cache=False, **kw).logits


def _rel(packed_logits, samples, refs):
    out, o = [], 0
    for s, ref in zip(samples, refs, strict=True):
        n = len(s)
        out.append(((packed_logits[o : o + n] - ref).norm() / ref.norm()).item())
        o += n
    return out


def _loss(logits, ids):
    return F.cross_entropy(logits[:-1], ids[1:]).item()


def test_boundary_rule():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    starts = packing.segment_starts(pos)
    assert starts.tolist() == [[1, 0, 0, 1, 0, 1], [1, 0, 0, 0, 1, 0]]
    assert packing.cu_seqlens(starts).tolist() == [0, 3, 5, 6, 10, 12]  # rows flattened, row starts too
    assert torch.equal(packing.positions_from_starts(starts), pos)
    # axolotl's multipack collator: segment ids 1, 2, ... in attention_mask, padding 0
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    assert packing.segment_starts(None, seg).tolist() == [[1, 0, 1, 0, 0, 1]]
    assert packing.segment_starts(None, torch.ones(1, 6, dtype=torch.long)) is None  # a 0/1 mask: no boundary
    assert not packing.is_packed(packing.segment_starts(torch.arange(6)[None]))


def test_conv_reference_restarts_per_sample():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    torch.manual_seed(1)
    lengths, D, W = [5, 2, 9], 8, 4
    x, w = torch.randn(1, sum(lengths), D), torch.randn(D, W)
    starts = packing.segment_starts(_positions(lengths)[None])[0]
    got = packing.causal_conv1d_varlen(x, w, None, "silu", starts)
    want = torch.cat(
        [
            causal_conv1d_fn(part.transpose(1, 2), w, None, "silu").transpose(1, 2)
            for part in x.split(lengths, 1)
        ],
        dim=1,
    )
    assert torch.allclose(got, want, atol=1e-6)
    leaky = causal_conv1d_fn(x.transpose(1, 2), w, None, "silu").transpose(1, 2)
    assert not torch.allclose(leaky, want, atol=1e-3)  # the unpatched conv reads across boundaries


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5"])
def test_packed_equals_unpacked(models, model_type, unpatched):
    """Both layouts: position-restart rows (what axolotl's trainer sends for sdpa), the collator's
    segment-id mask, two packed rows per batch, and (VL) the three MRoPE axes without a text axis."""
    model = models[model_type]
    samples = _samples()
    refs = [_logits(model, input_ids=s[None])[0] for s in samples]
    ids = torch.cat(samples)[None]
    pos = _positions(LENGTHS)[None]
    seg = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(LENGTHS)])[None]

    leak = _rel(_logits(model, input_ids=ids, position_ids=pos)[0], samples, refs)
    assert leak[0] < 1e-5 and min(leak[1:]) > 1e-3, leak  # unpatched: later samples see earlier ones
    scaled = _rel(_logits(model, input_ids=ids, position_ids=pos, attention_mask=seg)[0], samples, refs)
    assert min(scaled[1:]) > 0.1, scaled  # the segment-id mask read as a padding mask: sample k scaled by k

    packing.apply(model_type)
    cases = {
        "positions": dict(position_ids=pos),
        "segment-id mask": dict(position_ids=pos, attention_mask=seg),
        "segment-id mask only": dict(attention_mask=seg),
    }
    if model_type == "qwen3_5":
        cases["mrope axes"] = dict(position_ids=pos[None].expand(3, 1, -1))
    for name, kw in cases.items():
        out = _logits(model, input_ids=ids, **kw)[0]
        rel = _rel(out, samples, refs)
        assert max(rel) < 1e-5, (name, rel)
        o = 0
        for s, ref in zip(samples, refs, strict=True):
            got, want = _loss(out[o : o + len(s)], s), _loss(ref, s)
            assert abs(got - want) / want < 1e-6, (name, got, want)
            o += len(s)
    # two packed rows per batch (micro_batch_size 2 with packing): fla needs them flattened to one row
    rows = torch.stack([torch.cat(samples[:2]), torch.cat([samples[2], samples[1], samples[0][:17]])])
    rpos = torch.stack([_positions(LENGTHS[:2]), _positions([20, 70, 17])])
    out = _logits(model, input_ids=rows, position_ids=rpos)
    assert max(_rel(out[0], samples[:2], refs[:2])) < 1e-5
    assert max(_rel(out[1, :90], [samples[2], samples[1]], [refs[2], refs[1]])) < 1e-5
    # an unpacked row still runs transformers' own forward bit for bit
    assert torch.equal(_logits(model, input_ids=samples[1][None])[0], refs[1])


def test_packed_gradients_equal_unpacked(models, unpatched):
    """The torch reference's backward: packed loss (sum over samples) and the unpacked sum give the same grads."""
    model = models["qwen3_5_text"]
    packing.apply("qwen3_5_text")
    samples = _samples(seed=3)[1:]
    params = [model.model.layers[0].linear_attn.A_log, model.model.layers[0].linear_attn.conv1d.weight]

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in params]

    unpacked = grads(
        sum(
            F.cross_entropy(model(input_ids=s[None], use_cache=False).logits[0, :-1], s[1:], reduction="sum")
            for s in samples
        )
    )
    logits = model(
        input_ids=torch.cat(samples)[None], position_ids=_positions(LENGTHS[1:])[None], use_cache=False
    ).logits[0]
    o, total = 0, 0
    for s in samples:
        total = total + F.cross_entropy(logits[o : o + len(s) - 1], s[1:], reduction="sum")
        o += len(s)
    packed = grads(total)
    model.zero_grad()
    for a, b in zip(packed, unpacked, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()


def test_plugin_patches_only_packed_qwen35_runs(unpatched):
    from axolotl.utils.dict import DictDefault

    from pipeline.train.axolotl_plugin import PipelinePlugin

    plugin = PipelinePlugin()
    plugin.pre_model_load(DictDefault({"model_config_type": "qwen3_5", "sample_packing": False}))
    assert not packing.is_applied("qwen3_5")
    plugin.pre_model_load(DictDefault({"model_config_type": "llama", "sample_packing": True}))
    assert not packing.is_applied("qwen3_5")
    plugin.pre_model_load(DictDefault({"model_config_type": "qwen3_5", "eval_sample_packing": True}))
    assert packing.is_applied("qwen3_5")
