"""Static validation: one failing fixture per check, each made from the tiny base at test time.

Every fixture is a copy of one good PEFT adapter (tests/support/helpers.py:peft_adapter on the tiny
text base) with one edit to its config or safetensors; validation runs against the tiny
vision-language-layout base (so the text/VL key mapping is exercised on every test) and,
where a test says so, a tiny NVFP4 ModelOpt-like served checkpoint built from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.serving.versions import rules_for
from pipeline.serving.vllm import fleet_applies
from pipeline.validate import FleetRules, validate_adapter
from tests.support.helpers import peft_adapter
from tests.validate.cases import CASES, NEW, C, W, _rename, edit_config, edit_tensors


@pytest.fixture(scope="session")
def good_adapter(tmp_path_factory, tiny_base) -> Path:
    return peft_adapter(tiny_base, tmp_path_factory.mktemp("good") / "adapter", r=8, alpha=16)


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_vl_base) -> Path:
    from pipeline.dev.tinybase import build_tiny_served

    return build_tiny_served(tiny_vl_base, tmp_path_factory.mktemp("served") / "tiny-nvfp4")


@pytest.fixture()
def adapter(tmp_path, good_adapter) -> Path:
    return Path(shutil.copytree(good_adapter, tmp_path / "adapter"))


def ids(rep, severity=None) -> set[str]:
    return {c.id for c in rep.checks if severity is None or c.severity == severity}


def only(rep, check_id):
    found = [c for c in rep.checks if c.id == check_id]
    assert found, f"{check_id} not reported; got {[(c.id, c.message) for c in rep.checks]}"
    return found[0]


@pytest.fixture(scope="session")
def env(tmp_path_factory, tiny_base, tiny_vl_base, served):
    return SimpleNamespace(
        tiny_base=tiny_base, tiny_vl_base=tiny_vl_base, served=served, tmp=tmp_path_factory.mktemp("env")
    )


@pytest.mark.parametrize(
    "check_id,severity,edit,rules,words,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_check_fails_its_fixture(adapter, env, check_id, severity, edit, rules, words, kwargs):
    """Every instance of every kind: the finding with its id, severity, location and fix; never a traceback."""
    if edit is not None:
        kind, change = edit
        if kind == "config":
            edit_config(adapter, **change)
        elif kind == "tensors":
            edit_tensors(adapter, change)
        else:
            change(adapter, env)
    rules = rules(env) if callable(rules) else rules
    kwargs = kwargs(env) if callable(kwargs) else dict(kwargs)
    base = kwargs.pop("base_dir", env.tiny_vl_base)
    rep = validate_adapter(adapter, base, FleetRules(**rules), **kwargs)
    c = only(rep, check_id)
    assert c.severity == severity
    text = f"{c.message} {c.where}"
    for w in words:
        assert w in text, f"{w!r} not in {text!r}"
    if severity != "info" and check_id != "served.unchecked":
        assert c.where, "every finding says where"
    assert rep.verdict == ("fail" if severity == "error" else rep.verdict)
    json.dumps(rep.to_dict())  # the report always serialises


def test_good_adapter_passes_both_layouts(adapter, tiny_vl_base, tiny_base, served):
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW))
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    assert ids(rep, "warning") == set()
    assert rep.stats["expected_weights_bytes"] == rep.stats["weights_bytes"]
    assert rep.stats["served"]["quant_algo"] == "NVFP4" and rep.stats["served"]["quant_config_sha256"]
    # The same adapter re-keyed to the VL layout, against the text-layout base.
    edit_tensors(
        adapter, _rename("base_model.model.model.layers.", "base_model.model.model.language_model.layers.")
    )
    rep = validate_adapter(adapter, tiny_base, FleetRules(served_path=served, vllm_version=NEW))
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    assert rep.weights_sha256 and len(rep.weights_sha256) == 64


@pytest.mark.parametrize(
    "setup,check_id,words",
    [
        ("missing_config", "config.missing", ["adapter_config.json", "save_pretrained"]),
        ("invalid_config", "config.invalid", [":1:", "not valid JSON"]),
        ("missing_weights", "weights.missing", [W]),
        ("pickle", "weights.pickle", ["adapter_model.bin", "safe_serialization"]),
        ("both", "weights.ambiguous", ["adapter_model.bin", "delete the pickle"]),
        ("truncated", "weights.header", ["truncated", "re-copy"]),
        ("garbage", "weights.header", ["not JSON"]),
        ("header_too_long", "weights.header", ["larger than the file"]),
        ("data_cut", "weights.header", ["leave the file"]),
        ("empty", "weights.empty", ["no tensors"]),
    ],
)
def test_file_faults_are_findings_not_tracebacks(adapter, tiny_vl_base, setup, check_id, words):
    w = adapter / W
    raw = w.read_bytes()
    if setup == "missing_config":
        (adapter / C).unlink()
    elif setup == "invalid_config":
        (adapter / C).write_text("{not json")
    elif setup == "missing_weights":
        w.unlink()
    elif setup == "pickle":
        w.rename(adapter / "adapter_model.bin")
    elif setup == "both":
        (adapter / "adapter_model.bin").write_bytes(b"\x80\x04")
    elif setup == "truncated":
        w.write_bytes(raw[:4])
    elif setup == "garbage":
        w.write_bytes((20).to_bytes(8, "little") + b"\xff" * 20 + raw[28:])
    elif setup == "header_too_long":
        w.write_bytes((10**7).to_bytes(8, "little") + raw[8:])
    elif setup == "data_cut":
        w.write_bytes(raw[: len(raw) // 2])
    elif setup == "empty":
        from safetensors.torch import save_file

        save_file({}, str(w))
    rep = validate_adapter(adapter, tiny_vl_base)
    c = only(rep, check_id)
    assert c.severity == "error" and not rep.passed
    for word in words:
        assert word in f"{c.message} {c.where}", c


def test_fleet_target_filter_follows_vllm_packing():
    # vllm/lora/utils.py is_in_target_modules: a listed child opens its packed parent for all children.
    r21, r20 = rules_for("0.21.0"), rules_for("0.20.0")
    assert fleet_applies("k_proj", ["q_proj"], r21)
    assert fleet_applies("up_proj", ["gate_up_proj"], r21)
    assert fleet_applies("in_proj_z", ["in_proj_qkv"], r21)
    assert not fleet_applies("down_proj", ["q_proj", "gate_proj"], r21)
    assert fleet_applies("down_proj", None, r21)
    # 0.20 splits the fused in_proj_qkvz with LoRA on: in_proj_z is its own runtime module (qwen3_5.py
    # update_packed_mapping), so listing in_proj_qkv does not open it (a sibling found in the sources)
    assert not fleet_applies("in_proj_z", ["in_proj_qkv"], r20)
    assert fleet_applies("k_proj", ["q_proj"], r20)


def test_resolver_base_is_info_before_publish_rewrites_it(adapter, tiny_vl_base):
    (adapter / "manifest.json").write_text(json.dumps({"files": {}}))  # a training output, not yet published
    rep = validate_adapter(
        adapter, tiny_vl_base, FleetRules(loading_mode="resolver", served_model="served-x")
    )
    assert only(rep, "fleet.resolver_base").severity == "info"
    edit_config(adapter, base_model_name_or_path="served-x")
    (adapter / "manifest.json").unlink()
    rep = validate_adapter(
        adapter, tiny_vl_base, FleetRules(loading_mode="resolver", served_model="served-x")
    )
    assert "fleet.resolver_base" not in ids(rep)


def test_alpha_pattern_and_rank_pattern_are_honoured(adapter, good_adapter, tiny_vl_base):
    from pipeline.artifacts.adapter import load_adapter_config

    # rank_pattern keyed by the PEFT module name matches the tensors; alpha_pattern sets down_proj's scale.
    edit_config(
        adapter, rank_pattern={"model.layers.3.self_attn.q_proj": 8}, alpha_pattern={"down_proj": 160}
    )
    rep = validate_adapter(adapter, tiny_vl_base)
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    cfg = load_adapter_config(adapter)
    assert cfg.scale_for("model.layers.0.mlp.down_proj") == 20.0
    assert cfg.scale_for("model.layers.0.mlp.up_proj") == 2.0
    plain = validate_adapter(good_adapter, tiny_vl_base).stats["update_norm_median"]
    ratio = rep.stats["update_norm_median"]["mlp.down_proj"] / plain["mlp.down_proj"]
    assert ratio == pytest.approx(10.0, rel=1e-4)
    assert rep.stats["update_norm_median"]["mlp.up_proj"] == pytest.approx(plain["mlp.up_proj"], rel=1e-6)


# -- served checkpoint ----------------------------------------------------------------------------------------------
def _edit_served(served: Path, dst: Path, fn=None, config=None, quant=None) -> Path:
    d = Path(shutil.copytree(served, dst))
    if fn is not None:
        from safetensors.torch import load_file, save_file

        t = fn(load_file(str(d / "model.safetensors"))) or None
        save_file(t, str(d / "model.safetensors"))
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"] = {k: "model.safetensors" for k in t}
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    if config:
        c = json.loads((d / "config.json").read_text())
        c.update(config)
        (d / "config.json").write_text(json.dumps(c))
    if quant:
        (d / "hf_quant_config.json").write_text(json.dumps(quant))
    return d


def test_served_checks(adapter, tiny_vl_base, served, tmp_path):
    def check(served_dir, check_id, words, severity="error"):
        rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served_dir, vllm_version=NEW))
        c = only(rep, check_id)
        assert c.severity == severity
        for w in words:
            assert w in f"{c.message} {c.where}", c

    import torch

    check(tmp_path / "nowhere", "served.unreadable", ["no config.json", "served.path"])
    check(
        _edit_served(served, tmp_path / "geo", config={"hidden_size": 256}),
        "served.geometry",
        ["hidden_size: base 128 vs served 256", "served.path"],
    )
    check(
        _edit_served(
            served,
            tmp_path / "missing",
            fn=lambda t: {k: v for k, v in t.items() if "layers.0.mlp.down_proj" not in k},
        ),
        "served.module_missing",
        ["mlp.down_proj on layers 0", "does not exist in the served"],
    )
    check(
        _edit_served(
            served,
            tmp_path / "shape",
            fn=lambda t: t | {"model.layers.0.mlp.down_proj.weight": torch.zeros(128, 64, dtype=torch.uint8)},
        ),
        "served.shape",
        ["[out, in] = [128, 128]", "U8 [128, 64]", "[128, 256]"],
    )
    check(
        _edit_served(served, tmp_path / "algo", quant={"quantization": {"quant_algo": "FANCY4"}}),
        "served.quant_unknown",
        ["FANCY4"],
        severity="warning",
    )


def test_tiny_served_checkpoint_is_nvfp4_shaped(served):
    from pipeline.artifacts.checkpoint import logical_linear_shape, quant_algo, read_checkpoint

    ck = read_checkpoint(served)
    assert quant_algo(ck) == "NVFP4" and ck.layout == "text"
    t = ck.tensors
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == "U8"
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (128, 128)
    assert t["model.layers.0.mlp.down_proj.weight_scale"].dtype == "F8_E4M3"
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (128, 16)
    assert logical_linear_shape(ck, "layers.0.mlp.down_proj") == (128, 256)
    assert t["lm_head.weight"].dtype == "BF16" and any(n.startswith("mtp.") for n in t)
    assert not any("visual" in n for n in t)


def test_nvfp4_quantization_round_trips():
    import torch

    from pipeline.dev.tinybase import E2M1_GRID, quantize_nvfp4

    w = torch.randn(4, 32)
    packed, scale, scale2 = quantize_nvfp4(w)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(4, 32).long()
    mag = torch.tensor(E2M1_GRID)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    deq = mag.reshape(4, 2, 16) * (scale.float() * scale2).unsqueeze(-1)
    # worst case is half the widest e2m1 gap (4 -> 6) times the block scale amax/6
    block_amax = w.reshape(4, 2, 16).abs().amax(-1, keepdim=True)
    assert bool(((deq - w.reshape(4, 2, 16)).abs() <= block_amax / 6 * 1.1 + 1e-6).all())


def test_missing_adapter_directory(tmp_path, tiny_vl_base):
    rep = validate_adapter(tmp_path / "nope", tiny_vl_base)
    assert [c.id for c in rep.checks] == ["adapter.missing"] and not rep.passed
    (tmp_path / "afile").write_text("x")  # helper-7: a file was "directory not found"
    rep = validate_adapter(tmp_path / "afile", tiny_vl_base)
    assert "is a file, not an adapter directory" in only(rep, "adapter.missing").message


def test_unquantized_served_checkpoint_is_info(adapter, tiny_vl_base):
    """The real-layout VL checkpoint as served (bf16): info only, and its layout is what keys are checked against."""
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=tiny_vl_base, vllm_version=NEW))
    assert only(rep, "served.not_quantized").severity == "info" and rep.passed
    assert rep.stats["served"]["architecture"] == "Qwen3_5ForConditionalGeneration"


def test_static_validation_imports_neither_torch_nor_transformers(
    good_adapter, tiny_vl_base, served, tiny_base
):
    """Issue 17's validate goal: the demo-sized adapter validates without importing torch or transformers."""
    import subprocess
    import sys

    d = Path(shutil.copytree(good_adapter, Path(good_adapter).parent / "with-tok", dirs_exist_ok=True))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(tiny_base / f, d / f)
    code = (
        "import sys; from pathlib import Path; from pipeline.validate import FleetRules, validate_adapter;"
        f"r = validate_adapter(Path({str(d)!r}), Path({str(tiny_vl_base)!r}),"
        f" FleetRules(served_path=Path({str(served)!r}), vllm_version='0.32.0'));"
        "assert r.stats['template_conversations']['rendered'] == 6, r.to_dict();"
        "print(r.verdict, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["pass", "False", "False"]


def test_a_failing_rule_is_a_finding_not_a_traceback(adapter, tiny_vl_base, monkeypatch):
    """The orchestrator turns a rule that raises into an error finding with that rule's id; the others still run."""
    from pipeline.validate import RULES

    spec = RULES["keys.conv1d"]

    def broken(ctx):
        raise TypeError("boom")
        yield

    monkeypatch.setitem(RULES, "keys.conv1d", type(spec)(**{**spec.__dict__, "fn": broken}))
    rep = validate_adapter(adapter, tiny_vl_base)
    c = only(rep, "keys.conv1d")
    assert c.severity == "error" and "TypeError: boom" in c.message and "please report it" in c.message
    assert "served.unchecked" in ids(rep)


@pytest.mark.parametrize(
    "manifest, says",
    [
        ("[1, 2", "not valid JSON"),
        ('{"files": {}, "base_model": {"id": "Qwen/Qwen3.6-27B"}}', "'Qwen/Qwen3.6-27B' is not a local"),
    ],
)
def test_no_base_says_why_the_manifest_gave_none(adapter, manifest, says):
    """New-user finding: a corrupt manifest read as "no base" with no hint of the manifest."""
    (adapter / "manifest.json").write_text(manifest)
    rep = validate_adapter(adapter, None, require_base=True)
    f = only(rep, "base.missing")
    assert "pass --base" in f.message and says in f.message, f.message


@pytest.mark.parametrize("r", [-4, 0])
def test_a_non_positive_r_is_one_finding(adapter, tiny_vl_base, r):
    """New-user finding: `"r": -4` gave 37 errors (every module's rank, "untrained", the size band);
    the config is what is wrong, said once."""
    edit_config(adapter, r=r)
    rep = validate_adapter(adapter, tiny_vl_base)
    errors = [c for c in rep.checks if c.severity == "error"]
    assert [c.id for c in errors] == ["config.rank"], [(c.id, c.message) for c in errors]


def _cut_rank(t):
    k = next(k for k in sorted(t) if "layers.0." in k and k.endswith("lora_A.weight"))
    t[k] = t[k][:4].contiguous()


def _shift_layers(t):
    import re

    return {
        re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + 90}.", k): v for k, v in t.items()
    }


@pytest.mark.parametrize(
    "edit, root",
    [
        (lambda d: edit_config(d, r=16), "keys.rank"),
        (lambda d: edit_tensors(d, _cut_rank), "keys.shape"),
        (lambda d: edit_tensors(d, _rename("lora_A.weight", "lora_A.default.weight")), "keys.grammar"),
        (lambda d: edit_tensors(d, _shift_layers), "keys.layer"),
    ],
)
def test_coverage_checks_do_not_repeat_another_checks_finding(adapter, tiny_vl_base, edit, root):
    """helper-7: tensors refused by one keys check were then reported missing by keys.declared_absent
    ("no tensor adapts it") and keys.partial ("missing on layers 0"): false, and one cause twice."""
    edit(adapter)
    rep = validate_adapter(adapter, tiny_vl_base)
    got = ids(rep, "error")
    assert root in got and not got & {"keys.declared_absent", "keys.partial"}, [
        (c.id, c.message) for c in rep.checks if c.severity == "error"
    ]


def test_an_unknown_chat_template_in_the_training_config_is_an_error(adapter, tiny_vl_base, tmp_path):
    """helper-7: `chat_template: nosuch` passed with only template.unchecked ("pass --training-config")."""
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (adapter / f).unlink(missing_ok=True)  # no tokenizer with the adapter, none named by the config
    tc = tmp_path / "tc.yml"
    tc.write_text("chat_template: nosuch\n")
    rep = validate_adapter(adapter, tiny_vl_base, training_config=tc)
    assert "not one of axolotl's templates" in only(rep, "template.training").message
    tc.write_text("chat_template: chatml\n")  # a named template resolves without a tokenizer
    rep = validate_adapter(adapter, tiny_vl_base, training_config=tc)
    assert "template.unchecked" not in ids(rep) and "template.training" not in ids(rep)


@pytest.mark.parametrize(
    "edit, check_id",
    [
        (lambda d: edit_config(d, r=16), "keys.rank"),
        (lambda d: edit_tensors(d, lambda t: {k: v.double() for k, v in t.items()}), "weights.dtype"),
        (lambda d: edit_tensors(d, _rename("lora_A.weight", "lora_A.default.weight")), "keys.grammar"),
        (lambda d: edit_tensors(d, _shift_layers), "keys.layer"),
    ],
)
def test_one_mistake_on_every_module_is_one_finding(adapter, tiny_vl_base, edit, check_id):
    """helper-7: `r` 8 -> 16 gave 25 keys.rank errors, float64 weights 50 weights.dtype errors."""
    edit(adapter)
    rep = validate_adapter(adapter, tiny_vl_base)
    found = [c for c in rep.checks if c.id == check_id]
    assert len(found) == 1, [c.message for c in found]
    assert any(w in found[0].message for w in ("tensors, e.g.", "modules, e.g.", "modules)")), found[
        0
    ].message


@pytest.mark.parametrize("field, value", [("target_modules", [1, 2]), ("layers_to_transform", "0")])
def test_a_wrong_type_is_one_finding_per_field(adapter, tiny_vl_base, field, value):
    """helper-7: `[1, 2]` gave two config.type errors, one per member of PEFT's `list[str] | str`."""
    edit_config(adapter, **{field: value})
    found = [c for c in validate_adapter(adapter, tiny_vl_base).checks if c.id == "config.type"]
    assert len(found) == 1 and field in found[0].message, [c.message for c in found]


@pytest.mark.parametrize(
    "targets, version",
    [
        (
            ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "out_proj", "in_proj_qkv", "in_proj_z"],
            "0.19.2",
        ),
        (["q_proj", "o_proj", "gate_proj", "down_proj", "out_proj", "in_proj_qkvz"], "0.25.1"),
        (None, "0.19.1"),
    ],
)
def test_fleet_targets_as_each_version_matches_them_pass(adapter, tiny_vl_base, targets, version):
    """No false alarm: 0.19 with runtime names, 0.21+ with packed parents or one child of each."""
    rep = validate_adapter(
        adapter, tiny_vl_base, FleetRules(lora_target_modules=targets, vllm_version=version)
    )
    assert "keys.fleet_targets" not in ids(rep), [c.message for c in rep.checks]


@pytest.mark.parametrize(
    "keep, version", [("in_proj_qkv", "0.32.0"), ("in_proj_qkv", "0.20.0"), ("in_proj_z", "0.19.1")]
)
def test_gdn_partial_loads_where_vllm_handles_it(adapter, env, keep, version):
    from tests.validate.cases import _gdn_alone

    _gdn_alone(keep)(adapter, env)
    rep = validate_adapter(adapter, env.tiny_vl_base, FleetRules(vllm_version=version))
    assert "keys.gdn_partial" not in ids(rep)
    assert rep.passed, [(c.id, c.message) for c in rep.errors]


def test_embedding_lora_that_fits_passes_where_the_fleet_serves_it(adapter, tiny_vl_base):
    """No false alarm (issue 25.8): embed_tokens + lm_head LoRA of the base's vocabulary on 0.32 with
    fleet.allow_embedding_targets."""
    import torch

    def add(t):
        t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(8, 1024).bfloat16()
        t["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(128, 8).bfloat16()
        t["base_model.model.lm_head.lora_A.weight"] = torch.randn(8, 128).bfloat16()
        t["base_model.model.lm_head.lora_B.weight"] = torch.randn(1024, 8).bfloat16()

    edit_tensors(adapter, add)
    rules = FleetRules(allow_embedding_targets=True, vllm_version=NEW)
    rep = validate_adapter(adapter, tiny_vl_base, rules)
    assert not {"keys.embedding", "keys.embedding_shape", "keys.module"} & ids(rep), [
        c.message for c in rep.checks
    ]


def test_embedding_lora_as_peft_saves_it_passes_where_the_fleet_serves_it(adapter, env):
    """peft's save_pretrained writes the base embed_tokens/lm_head (`...base_layer.weight`) next to their LoRA;
    vLLM skips them (lora/utils.py is_base_embedding_weights): not unknown tensors, not counted as LoRA bytes."""
    from tests.validate.cases import _embedding_lora_saved_by_peft

    _embedding_lora_saved_by_peft()(adapter, env)
    rep = validate_adapter(
        adapter, env.tiny_vl_base, FleetRules(allow_embedding_targets=True, vllm_version=NEW)
    )
    assert rep.passed, [(c.id, c.message) for c in rep.errors]
    assert {"keys.unknown", "values.size_band", "adapter.size"}.isdisjoint(ids(rep))
    assert ids(rep, "warning") == {"keys.base_copy", "served.unchecked"}


def test_served_checkpoint_without_mtp_passes_a_fleet_that_does_not_draft(
    adapter, tiny_vl_base, served, tmp_path
):
    from tests.validate.cases import _served_tensors

    d = Path(shutil.copytree(served, tmp_path / "no-mtp"))
    _served_tensors(lambda t: {k: v for k, v in t.items() if not k.startswith("mtp.")})(d)
    assert "served.mtp" in ids(
        validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=d, vllm_version=NEW))
    )
    rules = FleetRules(served_path=d, vllm_version=NEW, speculative_mtp=False)
    assert validate_adapter(adapter, tiny_vl_base, rules).passed


def test_tokens_the_served_tokenizer_config_adds_too_are_not_new(adapter, env, tmp_path):
    """An added token in the adapter's tokenizer_config.json that the served checkpoint's tokenizer_config.json adds
    as well (transformers adds it on both sides, vLLM loads the served one with transformers) is not new."""
    from tests.validate.cases import _tokenizer_config_adds

    _tokenizer_config_adds(extra_special_tokens={"image_token": "<img_new>"})(adapter, env)
    served = Path(shutil.copytree(env.tiny_vl_base, tmp_path / "served"))
    shutil.copy2(adapter / "tokenizer_config.json", served / "tokenizer_config.json")
    rep = validate_adapter(adapter, env.tiny_vl_base, FleetRules(served_path=served, vllm_version="0.19.2"))
    assert "tokenizer.added_tokens" not in ids(rep), [c.message for c in rep.checks]


def test_a_rank_below_max_lora_rank_that_is_no_flag_value_passes(tmp_path, tiny_base, tiny_vl_base):
    """vLLM refuses only r > --max-lora-rank (peft_helper.py validate_legal) and copies a smaller adapter into the
    first rows of its max-rank buffers: r=4 served as its zero-padded r=8 equivalent on vLLM CPU 0.32 (same greedy
    tokens and logprobs). config.rank refused every r outside {1, 8, 16, ...}, the values of the server flag."""
    a = peft_adapter(tiny_base, tmp_path / "r4", r=4, alpha=8)
    rep = validate_adapter(a, tiny_vl_base, FleetRules(vllm_version="0.19.2"))
    assert rep.passed and "config.rank" not in ids(rep), [(c.id, c.message) for c in rep.errors]
    edit_config(a, rank_pattern={"q_proj": 12})
    assert "config.rank" not in ids(validate_adapter(a, tiny_vl_base, FleetRules(vllm_version="0.19.2")))
