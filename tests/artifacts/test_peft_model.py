"""Base + adapter through transformers/peft with every adapter tensor applied (pipeline.artifacts.peft_model).

The defect: `AutoModelForCausalLM` loads a Qwen3.5 VL checkpoint as `Qwen3_5ForCausalLM` (modules
`model.layers.N`), so an adapter trained on the VL class (keys `model.language_model.layers.N`, what
axolotl writes for the real checkpoint) loaded with `PeftModel.from_pretrained` applied nothing: the
canary's PEFT reference, `validate --behaviour` and the merge parity check all computed the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.helpers import peft_adapter


def _rekey(src: Path, dst: Path, rename) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(src / "adapter_model.safetensors"))
    save_file({rename(k): v for k, v in t.items()}, str(dst / "adapter_model.safetensors"))
    return dst


def _vl(key: str) -> str:
    return key.replace("base_model.model.model.layers", "base_model.model.model.language_model.layers")


@pytest.fixture(scope="module")
def adapters(tiny_base, tmp_path_factory):
    """The same LoRA in the text layout (for tiny_base) and the VL layout (for tiny_vl_base)."""
    root = tmp_path_factory.mktemp("peft-load")
    text = peft_adapter(
        tiny_base, root / "text", targets=["q_proj", "v_proj", "gate_proj", "in_proj_qkv"], b_std=0.3
    )
    return text, _rekey(text, root / "vl", _vl)


def _logits(model, ids):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).logits
        with model.disable_adapter():
            base = model(input_ids=torch.tensor([ids])).logits
    return out, base


IDS = [5, 17, 33, 2, 91, 40, 7]


def test_vl_trained_adapter_applies_as_on_the_text_base(tiny_base, tiny_vl_base, adapters):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.artifacts.peft_model import load_peft

    text, vl = adapters
    # the failing input: the causal-LM class + peft leave every VL-named tensor unapplied
    old = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_vl_base), dtype=torch.float32), str(vl)
    )
    with_old, base_old = _logits(old.eval(), IDS)
    assert torch.equal(with_old, base_old)

    on_vl = load_peft(tiny_vl_base, vl)
    on_text = load_peft(tiny_base, text)
    assert type(on_vl.get_base_model()).__name__ == "Qwen3_5ForConditionalGeneration"
    a, b = _logits(on_vl, IDS)
    t, tb = _logits(on_text, IDS)
    assert (a - b).abs().max() > 0.1  # the adapter changes the output ...
    assert torch.allclose(a, t, atol=1e-5) and torch.allclose(
        b, tb, atol=1e-5
    )  # ... exactly as on the text base


def test_tensors_naming_no_module_are_refused(tiny_base, adapters, tmp_path):
    from pipeline.artifacts.peft_model import AdapterNotApplied, load_peft

    bad = _rekey(adapters[0], tmp_path / "bad", lambda k: k.replace("layers.3.", "layers.7."))
    with pytest.raises(AdapterNotApplied, match=r"adapter tensors name no module .*layers\.7\."):
        load_peft(tiny_base, bad)


def test_canary_reference_applies_a_vl_trained_adapter(tiny_vl_base, adapters):
    """Sibling 1: the canary's reference scored the base for the adapter pass."""
    from pipeline.canary.reference import Reference

    ref = Reference(tiny_vl_base, adapters[1])
    with_ad = ref.score(IDS[:3], IDS[3:], [[t] for t in IDS[3:]], adapter=True)
    base = ref.score(IDS[:3], IDS[3:], [[t] for t in IDS[3:]], adapter=False)
    assert (
        max(abs(w.logprobs[t] - b.logprobs[t]) for w, b, t in zip(with_ad, base, IDS[3:], strict=True)) > 0.01
    )


def test_validate_behaviour_measures_a_vl_trained_adapter(tiny_vl_base, adapters, tmp_path):
    """Sibling 2: `validate --behaviour` compared the base with itself (equal eval losses, identical canaries)."""
    from pipeline.validate.behaviour import evaluate
    from tests.support.helpers import REPO

    rows = (REPO / "datasets" / "agent_chat_validation.jsonl").read_text().splitlines()[:2]
    (tmp_path / "val.jsonl").write_text("\n".join(rows) + "\n")
    stats = evaluate(adapters[1], tiny_vl_base, [tmp_path / "val.jsonl"])
    assert abs(stats["eval_loss_adapter"] - stats["eval_loss_base"]) > 1e-3, stats


def test_merge_parity_of_a_vl_trained_adapter(tiny_vl_base, adapters, tmp_path):
    """Sibling 3: merge parity against a reference that computed the base refused a correct VL merge."""
    from pipeline.merge import merge_adapter
    from pipeline.merge.parity import check_parity

    merge_adapter(adapters[1], tiny_vl_base, tmp_path / "merged")
    v = check_parity(tiny_vl_base, adapters[1], tmp_path / "merged", threads=1)
    assert v["verdict"] == "pass" and v["adapter_effect"] > 0.1, v["reasons"]
