"""The adapter's speed figure before a GPU (issue 38 item 1): the base's MTP layer drafting for the base and for
base + adapter, as vLLM feeds it (pipeline.validate.acceptance), and its gate `fleet.min_acceptance_ratio`.

The base here has an MTP layer distilled on its own outputs (tests/support/drafter.py), so the base has an
acceptance to lose: an adapter that moves the target's argmax lowers the estimate, an adapter that changes
nothing (lora_B zero) keeps it exactly.
"""

from __future__ import annotations

import pytest

from tests.support.drafter import conversations, drafted_base, vl_adapter, write_jsonl


@pytest.fixture(scope="module")
def speed_case(tiny_vl_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    base = drafted_base(tiny_vl_base, tmp_path_factory)
    strong = vl_adapter(base, root / "strong", b_std=0.3)
    inert = vl_adapter(base, root / "inert", zero_b=True, seed=1)
    val = write_jsonl(root / "val.jsonl", conversations(4, offset=8))
    return base, strong, inert, val


def _estimate(base, adapter, convs):
    from transformers import AutoTokenizer

    from pipeline.artifacts.peft_model import load_peft
    from pipeline.validate.acceptance import estimate, mtp_tensors

    model = load_peft(base, adapter)
    return estimate(model, AutoTokenizer.from_pretrained(str(base)), convs, mtp_tensors(base), new_tokens=16)


def test_an_adapter_that_moves_the_argmax_lowers_the_estimate(speed_case):
    base, strong, inert, _ = speed_case
    convs = conversations(4, offset=8)
    est = _estimate(base, strong, convs)
    b, a = est["base"], est["adapter"]
    assert b["acceptance_length"] > 1.0 and len(b["acceptance"]) == 3, (
        est
    )  # the base's drafter agrees with it
    assert b["acceptance"] == sorted(b["acceptance"], reverse=True)  # drafts 1..k all accepted: never rising
    assert a["acceptance_length"] < b["acceptance_length"], est
    assert est["acceptance_ratio"] == round(a["acceptance_length"] / b["acceptance_length"], 4)
    same = _estimate(base, inert, convs)  # lora_B = 0: the target is the base, the figures are the base's
    assert same["adapter"] == same["base"] and same["acceptance_ratio"] == 1.0


def test_the_gate_warns_by_default_and_refuses_when_set():
    from pipeline.validate.acceptance import DEFAULT_WARN_RATIO, gate, speed_ratio

    assert gate(0.95, None) is None
    assert gate(0.5, None)[0] == "warning" and str(DEFAULT_WARN_RATIO) in gate(0.5, None)[1]
    assert gate(0.5, 0.4) is None
    assert gate(0.5, 0.8) == ("error", "predicted MTP acceptance ratio 0.5 < fleet.min_acceptance_ratio 0.8")
    assert gate(None, 0.8)[0] == "error"  # not estimated while the operator asked for the gate
    assert gate(None, None) is None
    assert speed_ratio(0.5, 0.93) == 0.465 and speed_ratio(None, 0.93) is None


def test_validate_behaviour_reports_and_gates_the_estimate(speed_case):
    from pipeline.validate import validate_adapter
    from pipeline.validate.report import FleetRules

    base, strong, _, val = speed_case
    rep = validate_adapter(
        strong, base, FleetRules(min_acceptance_ratio=0.99), behaviour=True, validation_files=[val]
    )
    figures = rep.stats["acceptance"]
    assert figures["acceptance_length_adapter"] < figures["acceptance_length_base"], figures
    assert figures["speed_ratio"] == round(figures["acceptance_ratio"] * 0.93, 4)
    found = [f for f in rep.checks if f.id == "behaviour.acceptance"]
    assert [f.severity for f in found] == ["error"] and "fleet.min_acceptance_ratio 0.99" in found[0].message
    assert not rep.passed
