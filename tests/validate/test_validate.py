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

import pytest

from pipeline.serving.vllm import fleet_applies
from pipeline.validate import FleetRules, validate_adapter
from tests.support.helpers import peft_adapter

W = "adapter_model.safetensors"
C = "adapter_config.json"
P = "base_model.model.model.layers."


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


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / C).read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / C).write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / W))
    t = fn(t) or t
    save_file(t, str(d / W))


_DROP = object()


def ids(rep, severity=None) -> set[str]:
    return {c.id for c in rep.checks if severity is None or c.severity == severity}


def only(rep, check_id):
    found = [c for c in rep.checks if c.id == check_id]
    assert found, f"{check_id} not reported; got {[(c.id, c.message) for c in rep.checks]}"
    return found[0]


# -- mutations: (check id, severity, edit(adapter dir), rules kwargs, words the message or where must contain) --------
def _rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def _add_pair(module: str, a_shape, b_shape):
    import torch

    def fn(t):
        t[f"base_model.model.{module}.lora_A.weight"] = torch.randn(a_shape)
        t[f"base_model.model.{module}.lora_B.weight"] = torch.randn(b_shape)

    return fn


def _set(name: str, fn_value):
    def fn(t):
        t[name] = fn_value(t[name])

    return fn


def _drop(pred):
    return lambda t: {k: v for k, v in t.items() if not pred(k)}


def _zero_b(t):
    return {k: (v * 0 if "lora_B" in k else v) for k, v in t.items()}


CASES = [
    ("config.peft_type", "error", ("config", {"peft_type": "LOHA"}), {}, ["LORA", C]),
    ("config.required", "error", ("config", {"lora_alpha": _DROP}), {}, ["lora_alpha", "re-save"]),
    (
        "config.rank",
        "error",
        ("config", {"rank_pattern": {"q_proj": 12}}),
        {},
        ["rank_pattern[q_proj] = 12", "retrain"],
    ),
    (
        "config.rank",
        "error",
        ("config", {"rank_pattern": {"q_proj": 32}}),
        {},
        ["--max-lora-rank 16", "max_lora_rank"],
    ),
    ("config.unsupported", "error", ("config", {"use_dora": True}), {}, ["DoRA", "retrain without"]),
    ("config.unsupported", "error", ("config", {"bias": "all"}), {}, ["bias", "'none'"]),
    (
        "config.unsupported",
        "error",
        ("config", {"modules_to_save": ["lm_head"]}),
        {},
        ["modules_to_save", "retrain"],
    ),
    ("config.unsupported", "error", ("config", {"layer_replication": [[0, 2]]}), {}, ["layer_replication"]),
    ("config.unsupported", "error", ("config", {"init_lora_weights": "pissa"}), {}, ["pissa", "convert"]),
    ("config.rslora", "error", ("config", {"use_rslora": True}), {}, ["--fold-rslora", "use_rslora"]),
    (
        "weights.dtype",
        "error",
        ("tensors", _set(P + "0.mlp.up_proj.lora_A.weight", lambda v: v.double())),
        {},
        ["F64", "0.mlp.up_proj", "bf16"],
    ),
    (
        "keys.unknown",
        "error",
        (
            "tensors",
            lambda t: t.update(
                {"base_model.model.model.norm.weight": t[P + "0.mlp.up_proj.lora_A.weight"].clone()}
            ),
        ),
        {},
        ["model.norm.weight", "lora_A.weight"],
    ),
    (
        "keys.pair",
        "error",
        ("tensors", _drop(lambda k: k == P + "1.mlp.down_proj.lora_B.weight")),
        {},
        ["lora_B missing", "layers.1.mlp.down_proj"],
    ),
    (
        "keys.embedding",
        "error",
        ("tensors", _add_pair("lm_head", (8, 128), (1024, 8))),
        {},
        ["lm_head", "allow_embedding_targets"],
    ),
    (
        "keys.mtp",
        "error",
        ("tensors", _add_pair("mtp.layers.0.mlp.up_proj", (8, 128), (256, 8))),
        {},
        ["mtp.layers.0.mlp.up_proj", "drop mtp"],
    ),
    (
        "keys.visual",
        "error",
        ("tensors", _add_pair("model.visual.blocks.0.attn.qkv", (8, 128), (384, 8))),
        {},
        ["visual.blocks.0.attn.qkv", "lora_target_modules"],
    ),
    (
        "keys.module",
        "error",
        ("tensors", _rename(P + "3.self_attn.q_proj", P + "0.self_attn.q_proj")),
        {},
        ["self_attn.q_proj does not exist on layer 0 (linear_attention)", "layers.0.self_attn.q_proj"],
    ),
    (
        "keys.conv1d",
        "error",
        ("tensors", _add_pair("model.layers.0.linear_attn.conv1d", (8, 4), (512, 8))),
        {},
        ["conv1d", "applies nothing"],
    ),
    (
        "keys.layer",
        "error",
        ("tensors", _rename(P + "2.mlp.", P + "9.mlp.")),
        {},
        ["layer 9 >= the base's 4 layers"],
    ),
    (
        "keys.shape",
        "error",
        ("tensors", _set(P + "0.mlp.up_proj.lora_A.weight", lambda v: v[:, :64].contiguous())),
        {},
        ["lora_A [8, 64]", "in_features 128", "layers.0.mlp.up_proj"],
    ),
    (
        "keys.rank",
        "error",
        ("config", {"r": 16}),
        {},
        ["tensor rank 8 != configured r 16", "adapter_config.json"],
    ),
    (
        "keys.partial",
        "warning",
        ("tensors", _drop(lambda k: ".1.mlp.up_proj." in k)),
        {},
        ["mlp.up_proj adapted on 3 of 4 layers", "missing on layers 1"],
    ),
    (
        "keys.declared_absent",
        "warning",
        (
            "config",
            {
                "target_modules": [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                    "in_proj_qkv",
                    "in_proj_z",
                    "out_proj",
                    "in_proj_b",
                ]
            },
        ),
        {},
        ["linear_attn.in_proj_b (layers 0-2)"],
    ),
    (
        "keys.undeclared",
        "warning",
        (
            "config",
            {
                "target_modules": [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "in_proj_qkv",
                    "in_proj_z",
                    "out_proj",
                ]
            },
        ),
        {},
        ["mlp.down_proj", "target_modules"],
    ),
    (
        "keys.fleet_targets",
        "error",
        None,
        {"lora_target_modules": ["q_proj", "o_proj", "gate_proj", "in_proj_qkv"]},
        ["down_proj (layers 0-3) is outside the fleet's --lora-target-modules", "fleet.lora_target_modules"],
    ),
    (
        "values.nonfinite",
        "error",
        (
            "tensors",
            _set(
                P + "2.mlp.down_proj.lora_B.weight",
                lambda v: v.index_fill(0, __import__("torch").tensor([0]), float("nan")),
            ),
        ),
        {},
        ["NaN/Inf", "layers.2.mlp.down_proj.lora_B", "retrain"],
    ),
    ("values.untrained", "error", ("tensors", _zero_b), {}, ["every lora_B is zero"]),
    (
        "values.zero_b",
        "warning",
        ("tensors", _set(P + "0.mlp.up_proj.lora_B.weight", lambda v: v * 0)),
        {},
        ["1 of 25 lora_B"],
    ),
    (
        "values.norm_outlier",
        "warning",
        ("tensors", _set(P + "1.mlp.up_proj.lora_B.weight", lambda v: v * 1000)),
        {},
        ["layers.1.mlp.up_proj", "median", "learning rate"],
    ),
    (
        "values.size_band",
        "error",
        ("tensors", _drop(lambda k: "q_proj" not in k)),
        {},
        ["implied by r, target_modules", "re-save"],
    ),
    (
        "fleet.resolver_base",
        "error",
        None,
        {"loading_mode": "resolver", "served_model": "Qwen/Qwen3.6-27B-NVFP4"},
        ["Qwen/Qwen3.6-27B-NVFP4", "404", "pipeline publish"],
    ),
]


@pytest.mark.parametrize(
    "check_id,severity,edit,rules,words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_check_fails_its_fixture(adapter, tiny_vl_base, check_id, severity, edit, rules, words):
    if edit is not None:
        kind, change = edit
        edit_config(adapter, **change) if kind == "config" else edit_tensors(adapter, change)
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(**rules))
    c = only(rep, check_id)
    assert c.severity == severity
    text = f"{c.message} {c.where}"
    for w in words:
        assert w in text, f"{w!r} not in {text!r}"
    assert c.where, "every finding says where"
    assert rep.verdict == ("fail" if severity == "error" else rep.verdict)


def test_good_adapter_passes_both_layouts(adapter, tiny_vl_base, tiny_base, served):
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served))
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    assert ids(rep, "warning") == set()
    assert rep.stats["expected_weights_bytes"] == rep.stats["weights_bytes"]
    assert rep.stats["served"]["quant_algo"] == "NVFP4" and rep.stats["served"]["quant_config_sha256"]
    # The same adapter re-keyed to the VL layout, against the text-layout base.
    edit_tensors(
        adapter, _rename("base_model.model.model.layers.", "base_model.model.model.language_model.layers.")
    )
    rep = validate_adapter(adapter, tiny_base, FleetRules(served_path=served))
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
        w.write_bytes((10**9).to_bytes(8, "little") + raw[8:])
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
    assert fleet_applies("k_proj", ["q_proj"])
    assert fleet_applies("up_proj", ["gate_up_proj"])
    assert fleet_applies("in_proj_z", ["in_proj_qkv"])
    assert not fleet_applies("down_proj", ["q_proj", "gate_proj"])
    assert fleet_applies("down_proj", None)


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
        rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served_dir))
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


def test_nvfp4_quantisation_round_trips():
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
