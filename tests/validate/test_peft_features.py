"""What `pipeline.validate.peft_features` derives from the installed peft's source (peft 0.20)."""

from pipeline.validate import peft_features as pf


def test_base_mutating_inits_come_from_peft_layer_source():
    got = {m for m in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga") if pf.mutates_base(m)}
    assert got == {"pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"}
    assert [pf.mutates_base(i) for i in ("gaussian", "eva", "orthogonal", "mica", True, False)] == [None] * 6


def test_variant_fields_are_peft_is_lora_variant_fields():
    assert {
        "use_dora",
        "alora_invocation_tokens",
        "use_bdlora",
        "velora_config",
        "arrow_config",
    } <= pf.variant_fields()
    assert "use_rslora" not in pf.variant_fields() and "r" not in pf.variant_fields()


def test_lora_config_fields_include_the_base_config_and_not_kasa():
    fields = pf.lora_config_fields()
    assert {
        "r",
        "lora_alpha",
        "target_modules",
        "peft_type",
        "base_model_name_or_path",
        "task_type",
    } <= fields
    assert "kasa_config" not in fields
    assert pf.peft_version()


def test_known_inits_are_every_value_peft_layer_tests():
    """A string init no LoraLayer test names makes peft raise (reset_lora_parameters: Unknown initialization)
    and vLLM 0.32+ refuse; every value peft dispatches (any case) is known."""
    known = ("gaussian", "Gaussian", "eva", "orthogonal", "mica", "pissa", "pissa_niter_4", "corda", "olora")
    assert all(pf.known_init(v) for v in (*known, "loftq", "lora_ga", True, False))
    assert not any(pf.known_init(v) for v in ("kaiming", "true", "lora-ga", ""))
    assert "'pissa...'" in pf.known_init_names() and "'gaussian'" in pf.known_init_names()
