"""The loss without materialised logits for Qwen3_5ForConditionalGeneration (pipeline plugin).

On CPU the fused path is `chunked_causal_lm_loss` (Liger's kernel is Triton-only); the Liger path
was checked against the unfused run on an H200 (benchmarks/RESULTS.md).
"""

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.qwen3_5 import modeling_qwen3_5

from pipeline.dev.realbase import real_config
from pipeline.train import fused_loss
from pipeline.train.axolotl_plugin import PipelinePlugin
from tests.dev.test_realbase import SMALL_TEXT, SMALL_VISION


@pytest.fixture()
def unpatched(monkeypatch):
    """Restore Qwen3_5ForConditionalGeneration.forward after the test (the patch is class-wide)."""
    cls = modeling_qwen3_5.Qwen3_5ForConditionalGeneration
    monkeypatch.setattr(cls, "forward", cls.forward)
    assert not fused_loss.is_patched()
    return cls


@pytest.mark.parametrize("num_items", [None, 37])
def test_chunked_loss_equals_transformers_loss(num_items):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 50, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 300, (2, 50), generator=g)
    labels[:, :7] = -100
    ref = ForCausalLMLoss(h @ w.t(), labels, 300, num_items_in_batch=num_items)
    (gref,) = torch.autograd.grad(ref, h)
    got = fused_loss.chunked_causal_lm_loss(h, w, labels, num_items, chunk_tokens=16)  # 7 chunks
    (ggot,) = torch.autograd.grad(got, h)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ggot, gref, rtol=1e-5, atol=1e-7)


def test_plugin_patches_the_vl_class_only_when_asked(unpatched):
    from axolotl.utils.dict import DictDefault

    plugin = PipelinePlugin()
    plugin.pre_model_load(DictDefault(liger_fused_linear_cross_entropy=False, model_config_type="qwen3_5"))
    assert not fused_loss.is_patched()
    plugin.pre_model_load(
        DictDefault(liger_fused_linear_cross_entropy=True, model_config_type="qwen3_5_text")
    )
    assert not fused_loss.is_patched()  # text class: axolotl's Liger integration handles it
    plugin.pre_model_load(DictDefault(liger_fused_linear_cross_entropy=True, model_config_type="qwen3_5"))
    assert fused_loss.is_patched()
    assert fused_loss.patch_vl_fused_cross_entropy() is False  # idempotent


def test_vl_forward_without_logits_matches_the_unfused_loss(unpatched):
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(real_config(4, SMALL_TEXT, SMALL_VISION)).float().train()
    x = torch.randint(0, 2048, (2, 96))
    y = x.clone()
    y[:, :20] = -100

    def step():
        model.zero_grad()
        out = model(input_ids=x, labels=y)
        out.loss.backward()
        return out, model.model.language_model.layers[0].mlp.up_proj.weight.grad.clone()

    ref, gref = step()
    assert ref.logits.shape == (2, 96, 2048)
    fused_loss.patch_vl_fused_cross_entropy()
    got, ggot = step()
    assert got.logits is None  # never materialised when labels are given
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ggot, gref, rtol=1e-4, atol=1e-7)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=x).logits.shape == (2, 96, 2048)  # generation path unchanged
