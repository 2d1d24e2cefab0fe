"""Publish makes the adapter serve exactly as trained on the fleet's vLLM version (issue 14 item 3, issue 15.7/15.10):
keys renamed to the served layout, patterns folded into lora_B, safetensors metadata written, each parity-proven;
a verdict computed against another served checkpoint / version / rule set is re-checked before publishing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.artifacts.adapter import WEIGHTS_FILE
from pipeline.artifacts.normalise import ParityError, normalise_for_serving
from pipeline.artifacts.safetensors import file_metadata, read_safetensors_header
from pipeline.serving.versions import VL_CLASS, rules_for
from pipeline.validate import FleetRules, validate_adapter
from tests.support.helpers import peft_adapter, write_project_config
from tests.validate.cases import edit_tensors
from tests.validate.test_validate import good_adapter, only  # noqa: F401 (fixture)

V19 = rules_for("0.19.2rc1.dev123+gabcdef")


def _tensor_bytes(d: Path) -> dict[str, bytes]:
    h = read_safetensors_header(d / WEIGHTS_FILE)
    raw = (d / WEIGHTS_FILE).read_bytes()
    return {n: raw[i.offset : i.offset + i.nbytes] for n, i in h.items()}


def test_rename_to_the_served_layout_keeps_every_tensor(good_adapter, tiny_vl_base, tmp_path):  # noqa: F811
    d = Path(shutil.copytree(good_adapter, tmp_path / "a"))
    rules = FleetRules(served_path=tiny_vl_base, vllm_version="0.19.2")
    before = validate_adapter(d, tiny_vl_base, rules)
    assert only(before, "keys.served_layout").severity == "warning" and before.passed
    old = _tensor_bytes(d)
    rec = normalise_for_serving(d, VL_CLASS, V19)
    new = _tensor_bytes(d)
    assert rec["layout"]["to"] == "model.language_model.layers.N" and rec["layout"]["tensors"] == len(old)
    for name, data in old.items():
        assert new[name.replace("model.model.layers.", "model.model.language_model.layers.")] == data
    after = validate_adapter(d, tiny_vl_base, rules)
    assert after.passed and "keys.served_layout" not in {c.id for c in after.checks}, after.to_dict()[
        "checks"
    ]
    assert normalise_for_serving(d, VL_CLASS, V19) == {}  # idempotent


def test_rename_refuses_a_collision(good_adapter, tmp_path):  # noqa: F811
    d = Path(shutil.copytree(good_adapter, tmp_path / "a"))
    edit_tensors(
        d,
        lambda t: (
            t
            | {
                k.replace("model.model.layers.", "model.model.language_model.layers."): v.clone()
                for k, v in t.items()
                if ".0.mlp.up_proj" in k
            }
        ),
    )
    with pytest.raises(ParityError, match="collide"):
        normalise_for_serving(d, VL_CLASS, V19)


def test_fold_patterns_serves_the_trained_deltas(tiny_base, tmp_path):
    """rank_pattern/alpha_pattern folded into B: PEFT (patterns honoured) gives identical logits before and after,
    and the 0.19 interpretation (global alpha/r for every module) of the folded adapter equals the trained deltas."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = peft_adapter(
        tiny_base,
        tmp_path / "src",
        r=8,
        alpha=16,
        rank_pattern={"q_proj": 16},
        alpha_pattern={"down_proj": 64, "q_proj": 8},
    )
    rep = validate_adapter(src, tiny_base, FleetRules(vllm_version="0.19.2"))
    assert only(rep, "config.patterns_ignored").severity == "warning" and rep.passed
    assert "config.patterns_ignored" not in {
        c.id for c in validate_adapter(src, tiny_base, FleetRules(vllm_version="0.33.0")).checks
    }
    d = Path(shutil.copytree(src, tmp_path / "folded"))
    rec = normalise_for_serving(d, None, V19)
    assert set(rec) == {"patterns"} and rec["patterns"]["global_scale"] == 2.0
    assert "config.patterns_ignored" not in {
        c.id for c in validate_adapter(d, tiny_base, FleetRules(vllm_version="0.19.2")).checks
    }

    x = torch.tensor([[1, 5, 9, 42, 7, 3]])
    outs = []
    for a in (src, d):
        m = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32), str(a)
        )
        with torch.no_grad():
            outs.append(m(input_ids=x).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)

    from safetensors.torch import load_file

    old, new = load_file(str(src / WEIGHTS_FILE)), load_file(str(d / WEIGHTS_FILE))
    cfg = json.loads((src / "adapter_config.json").read_text())
    for k, b in old.items():
        if ".lora_B." in k:
            trained = {"q_proj": 8 / 16, "down_proj": 64 / 8}.get(
                k.split(".lora_B")[0].rsplit(".", 1)[-1], 2.0
            )
            assert torch.allclose(
                new[k].float() * (cfg["lora_alpha"] / cfg["r"]), b.float() * trained, rtol=1e-6
            )


def test_missing_safetensors_metadata_is_written(good_adapter, tmp_path):  # noqa: F811
    d = Path(shutil.copytree(good_adapter, tmp_path / "a"))
    edit_tensors(d, lambda t: t, metadata=None)
    old = _tensor_bytes(d)
    assert file_metadata(d / WEIGHTS_FILE) is None
    assert normalise_for_serving(d, None, V19) == {
        "safetensors_metadata": {"before": None, "after": {"format": "pt"}}
    }
    assert file_metadata(d / WEIGHTS_FILE) == {"format": "pt"} and _tensor_bytes(d) == old


# -- through publish (the registry, the volume) ----------------------------------------------------------------------
def _project(root: Path, monkeypatch, served: Path | None, version="0.19.2"):
    from pipeline.config import load_config

    root.mkdir(parents=True, exist_ok=True)
    sections = {"fleet": {"vllm_version": version}}
    if served is not None:
        sections["served"] = {"path": str(served)}
    path = write_project_config(root, **sections)
    monkeypatch.setenv("PIPELINE_CONFIG", str(path))
    return load_config(path)


def _register(cfg, tiny_base, root, name):
    from pipeline import registry
    from pipeline.validate import validate_with_config
    from tests.support.registry_support import adapter_with_manifest

    a = adapter_with_manifest(tiny_base, root / name, seed=1, name=name)
    rep = validate_with_config(cfg, a, tiny_base)
    assert rep.passed, rep.to_dict()["checks"]
    return rep, registry.register_adapter(cfg, a, name, rep.to_dict())


def test_publish_fixes_the_layout_of_the_demo_adapter(tmp_path, monkeypatch, tiny_base, tiny_vl_base):
    """Issue 14 done-when: the text-layout adapter against a real-layout (VL) served checkpoint at the configured
    fleet version no longer passes silently, and publish renames its keys with parity proven in the manifest."""
    from pipeline.release.publish import publish

    cfg = _project(tmp_path, monkeypatch, tiny_vl_base)
    rep, reg = _register(cfg, tiny_base, tmp_path, "layout")
    assert "keys.served_layout" in {c.id for c in rep.warnings}
    pub = publish(cfg, "layout", version=reg.version)
    man = json.loads((pub.path / "manifest.json").read_text())
    assert man["normalised"]["layout"]["to"] == "model.language_model.layers.N"
    assert all(".language_model.layers." in k for k in read_safetensors_header(pub.path / WEIGHTS_FILE))
    again = validate_adapter(pub.path, tiny_base, FleetRules.from_config(cfg))
    assert again.passed and "keys.served_layout" not in {c.id for c in again.checks}


def test_publish_without_a_served_checkpoint_renames_for_the_only_class(
    tmp_path,
    monkeypatch,
    tiny_base,
    good_adapter,  # noqa: F811 (fixture)
):
    """No served.path, fleet on 0.19: vLLM 0.19 serves qwen3_5 only as Qwen3_5ForConditionalGeneration, so the
    text-layout keys would load and change nothing; validate says so and publish renames them all the same."""
    from pipeline.validate import validate_with_config
    from pipeline.validate.publishable import prepare_for_fleet

    cfg = _project(tmp_path, monkeypatch, None)
    cfg.base.path = tiny_base
    stage = Path(shutil.copytree(good_adapter, tmp_path / "stage"))
    rep = validate_with_config(cfg, stage, tiny_base)
    assert rep.passed and "keys.served_layout" in {c.id for c in rep.warnings}
    record = prepare_for_fleet(cfg, {"validation.report": json.dumps(rep.to_dict())}, stage)
    assert record["normalised"]["layout"]["architecture"] == VL_CLASS
    (stage / "manifest.json").write_text(json.dumps({"files": {}, "published": {"name": "x", "version": 1}}))
    again = validate_adapter(stage, tiny_base, FleetRules.from_config(cfg))
    assert again.passed and "keys.served_layout" not in {c.id for c in again.checks}
    # 0.32 registers both classes: without a served checkpoint nothing is guessed
    cfg32 = _project(tmp_path / "p32", monkeypatch, None, version="0.32.0")
    cfg32.base.path = tiny_base
    other = Path(shutil.copytree(good_adapter, tmp_path / "stage32"))
    assert "layout" not in prepare_for_fleet(cfg32, {}, other).get("normalised", {})


def test_publish_rechecks_a_verdict_bound_to_another_served_checkpoint(
    tmp_path, monkeypatch, tiny_base, tiny_vl_base
):
    """Issue 15.7: served.path changed after validation -> publish re-validates and refuses when that fails."""
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish

    cfg = _project(tmp_path, monkeypatch, tiny_vl_base)
    _, reg = _register(cfg, tiny_base, tmp_path, "bound")
    other = Path(shutil.copytree(tiny_vl_base, tmp_path / "other-served"))
    c = json.loads((other / "config.json").read_text())
    c["text_config"]["hidden_size"] = 256
    (other / "config.json").write_text(json.dumps(c))
    cfg2 = _project(tmp_path / "p2", monkeypatch, other)
    cfg2.registry, cfg2.state_dir, cfg2.volume = cfg.registry, cfg.state_dir, cfg.volume
    with pytest.raises(CheckFailed) as e:
        publish(cfg2, "bound", version=reg.version)
    assert "config.json sha256 differs" in str(e.value) and "served.geometry" in str(e.value), str(e.value)
    assert not list(Path(cfg.volume.path).glob("bound-v*"))
    cfg3 = _project(
        tmp_path / "p3", monkeypatch, tiny_vl_base, version="0.20.0"
    )  # a version change: re-checked
    cfg3.registry, cfg3.state_dir, cfg3.volume = cfg.registry, cfg.state_dir, cfg.volume
    pub = publish(cfg3, "bound", version=reg.version)
    man = json.loads((pub.path / "manifest.json").read_text())
    assert "fleet vLLM version 0.19.2 -> 0.20.0" in man["revalidated"]["because"]


def test_publish_refuses_an_unknown_fleet_version(tmp_path, monkeypatch, tiny_base):
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish

    cfg = _project(tmp_path, monkeypatch, None)
    _, reg = _register(cfg, tiny_base, tmp_path, "ver")
    cfg.fleet.vllm_version = "0.28.0"
    with pytest.raises(CheckFailed, match="0.28.0 lies outside every version range"):
        publish(cfg, "ver", version=reg.version)


def test_binding_differences_name_what_changed():
    from pipeline.validate.publishable import binding_differences

    fleet = FleetRules().profile()
    now = {
        "served": {"revision": "r2", "path": "/s", "config_sha256": "a"},
        "vllm_version": "0.19.2",
        "fleet": fleet,
        "rules_version": "x",
    }
    bound = {
        "served": {"revision": "r1", "path": "/s", "config_sha256": "a"},
        "vllm_version": "0.19.2",
        "fleet": fleet,
        "rules_version": "x",
    }
    assert binding_differences(bound, now) == ["served revision r1 -> r2"]
    assert binding_differences(bound | {"rules_version": "y", "served": now["served"]}, now) == [
        "validation rules y -> x"
    ]
    assert binding_differences({}, now) == ["the verdict records no binding (validated by an older pipeline)"]
    assert binding_differences(bound | {"served": now["served"]}, now) == []
    # issue 27.8: the whole fleet profile the rules read is bound, not only the vLLM version
    assert binding_differences(
        bound | {"served": now["served"], "fleet": fleet | {"max_lora_rank": 64}}, now
    ) == ["fleet profile max_lora_rank 64 -> 16"]
    older = {k: v for k, v in bound.items() if k != "fleet"} | {"served": now["served"]}
    assert binding_differences(older, now) == [
        "the verdict records no fleet profile (validated by an older pipeline)"
    ]


def test_publish_refuses_a_verdict_bound_to_another_fleet_profile(tmp_path, monkeypatch, tiny_base):
    """Issue 27.8: `validate` passes, then `PIPELINE_FLEET__MAX_LORA_RANK=1`: publish re-validates and refuses."""
    from pipeline.config import load_config
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish

    cfg = _project(tmp_path, monkeypatch, None)
    _, reg = _register(cfg, tiny_base, tmp_path, "tight")
    monkeypatch.setenv("PIPELINE_FLEET__MAX_LORA_RANK", "1")
    with pytest.raises(CheckFailed) as e:
        publish(load_config(cfg.source), "tight", version=reg.version)
    assert "fleet profile max_lora_rank 16 -> 1" in str(e.value) and "config.rank" in str(e.value), str(
        e.value
    )
    assert not list(Path(cfg.volume.path).glob("tight-v*"))


@pytest.mark.parametrize(
    "env, words",
    [
        # siblings: the fleet's target modules narrowed; the fleet restarted with --fully-sharded-loras on 0.19
        (
            {"PIPELINE_FLEET__LORA_TARGET_MODULES": '["qkv_proj", "o_proj"]'},
            ["fleet profile lora_target_modules None -> ['qkv_proj', 'o_proj']", "keys.fleet_targets"],
        ),
        (
            {"PIPELINE_FLEET__FULLY_SHARDED_LORAS": "true"},
            ["fully_sharded_loras False -> True", "keys.fully_sharded"],
        ),
    ],
)
def test_prepare_for_fleet_rechecks_every_fleet_setting(
    tmp_path,
    monkeypatch,
    tiny_base,
    good_adapter,  # noqa: F811 (fixture)
    env,
    words,
):
    from pipeline.config import load_config
    from pipeline.errors import CheckFailed
    from pipeline.validate import validate_with_config
    from pipeline.validate.publishable import prepare_for_fleet

    cfg = _project(tmp_path, monkeypatch, None)
    stage = Path(shutil.copytree(good_adapter, tmp_path / "stage"))
    rep = validate_with_config(cfg, stage, tiny_base)
    assert rep.passed
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    tightened = load_config(cfg.source)
    tightened.base.path = tiny_base
    with pytest.raises(CheckFailed) as e:
        prepare_for_fleet(tightened, {"validation.report": json.dumps(rep.to_dict())}, stage)
    for w in words:
        assert w in str(e.value), str(e.value)


# -- issue 25.3: no false alarms on adapters for the class the fleet serves, publish's own output included ----------
VL_PREFIX = "base_model.model.model.language_model.layers."
VL_REGEX = r"^(model\.language_model(?=\.).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|out_proj))$"


def _modules(d: Path) -> list[str]:
    return sorted(
        {
            k.rsplit(".lora_", 1)[0].removeprefix("base_model.model.")
            for k in read_safetensors_header(d / WEIGHTS_FILE)
        }
    )


def _vl_keyed(good: Path, dst: Path) -> Path:
    d = Path(shutil.copytree(good, dst))
    edit_tensors(
        d, lambda t: {k.replace("base_model.model.model.layers.", VL_PREFIX): v for k, v in t.items()}
    )
    return d


def _set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("form", ["qualified", "ms_swift_regex", "rslora", "rslora_patterns"])
def test_adapters_written_for_the_vl_class_pass(good_adapter, tiny_vl_base, tmp_path, form):  # noqa: F811
    """PEFT on Qwen3_5ForConditionalGeneration targets all modules with each form, and vLLM applies them."""
    d = _vl_keyed(good_adapter, tmp_path / "a")
    if form == "qualified":
        _set_config(d, target_modules=_modules(d))
    elif form == "ms_swift_regex":
        _set_config(d, target_modules=VL_REGEX)
    elif form == "rslora":  # vllm/lora/peft_helper.py applies alpha/sqrt(r) on every version read
        _set_config(d, use_rslora=True)
    else:
        _set_config(d, use_rslora=True, alpha_pattern={"down_proj": 64})
    for version in ("0.19.2", "0.32.0"):
        rep = validate_adapter(d, tiny_vl_base, FleetRules(served_path=tiny_vl_base, vllm_version=version))
        errors = [(c.id, c.message) for c in rep.errors]
        assert rep.passed, (version, errors)
        if form != "rslora_patterns":
            assert not rep.warnings, [(c.id, c.message) for c in rep.warnings]


def _needs(step: str, good: Path, tmp: Path) -> Path:
    """An adapter directory that publish must rewrite with `step` (and the siblings that rewrite must handle)."""
    d = (
        _vl_keyed(good, tmp / step)
        if step in ("safetensors_metadata", "base_model")
        else Path(shutil.copytree(good, tmp / step))
    )
    if step == "layout":  # text-layout keys with fully qualified targets, escaped pattern keys
        _set_config(
            d,
            target_modules=_modules(d),
            alpha_pattern={r"model\.layers\.0\.mlp\.down_proj": 16},
            exclude_modules=["model.layers.3.mlp.nonexistent"],
        )
    elif step == "layout_regex":  # a regex matched against the whole (text-layout) name
        _set_config(d, target_modules=r"model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.[a-z_]+")
    elif step == "layout_exclude_regex":  # a regex exclude_modules naming the old prefix (layer 0 left out)
        _set_config(d, exclude_modules=r"model\.layers\.0\..*")
        edit_tensors(d, lambda t: {k: v for k, v in t.items() if ".layers.0." not in k})
    elif step == "layout_pattern_class":  # a pattern key the prefix rename cannot rewrite ([.] for \.)
        _set_config(d, alpha_pattern={r"model[.]layers[.]1[.]mlp[.]down_proj": 32}, rank_pattern={})
    elif step == "patterns":
        _set_config(d, alpha_pattern={"down_proj": 160}, rank_pattern={"model.layers.3.self_attn.q_proj": 8})
    elif step == "safetensors_metadata":
        edit_tensors(d, lambda t: t, metadata=None)
    return d


REWRITES = {
    "base_model": "base_model",
    "layout": "layout",
    "layout_regex": "layout",
    "layout_exclude_regex": "layout",
    "layout_pattern_class": "layout",
    "patterns": "patterns",
    "safetensors_metadata": "safetensors_metadata",
}


@pytest.mark.parametrize("case", sorted(REWRITES))
def test_every_directory_publish_writes_passes_validate(
    good_adapter,  # noqa: F811 (fixture)
    tiny_vl_base,
    tiny_base,
    tmp_path,
    case,
):
    """Every rewrite publish does (`normalise_for_serving`'s steps and `rewrite_base_model`), on the input that
    needs it: the result, marked published (so fixable problems are errors), passes validate against the same
    fleet profile with no warning."""
    from pipeline.artifacts.normalise import NORMALISE_STEPS, rewrite_base_model

    assert set(REWRITES.values()) == {*NORMALISE_STEPS, "base_model"}, (
        "a new publish rewrite needs a case here"
    )
    d = _needs(case, good_adapter, tmp_path)
    rules = FleetRules(served_path=tiny_vl_base, vllm_version="0.19.2")
    if case == "base_model":  # resolver mode: the directory must name the `vllm serve` model exactly
        rules = FleetRules(
            served_path=tiny_vl_base, vllm_version="0.19.2", loading_mode="resolver", served_model="m"
        )
        assert rewrite_base_model(d, "m") != "m"
    done = normalise_for_serving(d, VL_CLASS, rules_for(rules.vllm_version))
    assert case == "base_model" or REWRITES[case] in done, done
    (d / "manifest.json").write_text(json.dumps({"files": {}, "published": {"name": "x", "version": 1}}))
    for base in (tiny_vl_base, tiny_base):
        rep = validate_adapter(d, base, rules)
        assert rep.passed and not rep.warnings, [
            (c.id, c.severity, c.message) for c in rep.checks if c.severity != "info"
        ]


def test_publish_output_with_every_rewrite_passes_validate(tmp_path, monkeypatch, tiny_base, tiny_vl_base):
    """Issue 25.3 done-when, through the real publish: text-layout keys with fully qualified targets, a rank
    pattern the fleet ignores, no safetensors metadata, resolver mode (base_model_name_or_path rewritten)."""
    from pipeline import registry
    from pipeline.config import load_config
    from pipeline.release.publish import publish
    from pipeline.validate import validate_with_config
    from tests.support.registry_support import adapter_with_manifest

    root = tmp_path / "p"
    root.mkdir()
    path = write_project_config(
        root,
        fleet={"vllm_version": "0.19.2", "loading_mode": "resolver"},
        served={"path": str(tiny_vl_base), "model": "Qwen/Qwen3.6-27B-NVFP4"},
    )
    monkeypatch.setenv("PIPELINE_CONFIG", str(path))
    cfg = load_config(path)
    a = adapter_with_manifest(tiny_base, tmp_path / "all", seed=3, name="all")
    _set_config(a, target_modules=_modules(a), alpha_pattern={"down_proj": 160})
    edit_tensors(a, lambda t: t, metadata=None)
    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.manifest import MANIFEST, file_hashes

    man = json.loads((a / MANIFEST).read_text())
    man["files"] = file_hashes(a)
    write_json_atomic(a / MANIFEST, man)
    rep = validate_with_config(cfg, a, tiny_base)
    assert rep.passed, [(c.id, c.message) for c in rep.errors]
    reg = registry.register_adapter(cfg, a, "all", rep.to_dict())
    pub = publish(cfg, "all", version=reg.version)
    assert set(json.loads((pub.path / MANIFEST).read_text())["normalised"]) == {"layout", "patterns"}
    again = validate_adapter(pub.path, tiny_base, FleetRules.from_config(cfg))
    assert again.passed and not again.warnings, [
        (c.id, c.message) for c in again.checks if c.severity != "info"
    ]


def test_fold_patterns_proves_no_parity_with_a_nan(tiny_base, tmp_path):
    """The fold's parity check compared `max |new - old| > tol`, false for NaN: a lora_B holding a NaN was
    rewritten and called parity-proven. Now it is refused and the adapter left as it was."""
    from safetensors.torch import load_file, save_file

    src = peft_adapter(tiny_base, tmp_path / "src", r=8, alpha=16, alpha_pattern={"down_proj": 64})
    w = src / WEIGHTS_FILE
    t = load_file(str(w))
    key = next(k for k in t if "down_proj.lora_B" in k)
    t[key][0, 0] = float("nan")
    save_file(t, str(w), metadata={"format": "pt"})
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    with pytest.raises(ParityError, match="differs from the trained delta"):
        normalise_for_serving(src, None, V19)
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
