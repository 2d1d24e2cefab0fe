"""Validation against what the fleet serves: tokenizer, chat template, rsLoRA normalisation,
behaviour (peft + transformers on CPU), the CLI's exit codes, and the publish gate.

Fixtures are built from the tiny base at test time (tests/support/helpers.py, pipeline.dev.tinybase).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.validate import FleetRules, validate_adapter
from tests.support.helpers import REPO
from tests.validate.cases import NEW, edit_config, edit_tensors
from tests.validate.test_validate import good_adapter, only, served  # noqa: F401 (fixtures)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture()
def adapter(tmp_path, good_adapter, tiny_base) -> Path:  # noqa: F811
    """The good adapter plus the base's tokenizer files, as `pipeline train` ships them."""
    d = Path(shutil.copytree(good_adapter, tmp_path / "adapter"))
    for f in TOKENIZER_FILES:
        if (tiny_base / f).exists():
            shutil.copy2(tiny_base / f, d / f)
    return d


# -- tokenizer and chat template --------------------------------------------------------------------------------------
def test_tokenizer_and_template_match_pass(adapter, tiny_vl_base, served):  # noqa: F811
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW))
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    assert rep.stats["template_conversations"] == {"rendered": 6, "diverged": []}  # template.CONVERSATIONS


def test_added_token_is_refused(adapter, tiny_vl_base, served):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(adapter))
    tok.add_tokens(["<my_tool>"])
    tok.save_pretrained(str(adapter))
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW))
    c = only(rep, "tokenizer.added_tokens")
    assert "<my_tool>" in c.message and "retrain without adding tokens" in c.message
    assert c.where.endswith("tokenizer.json") and not rep.passed


def test_other_vocabulary_is_refused(adapter, tiny_vl_base, served, tmp_path):  # noqa: F811
    from pipeline.dev.tinybase import build_tokenizer

    (tmp_path / "other-corpus").mkdir()
    (tmp_path / "other-corpus" / "a.jsonl").write_text("zebra quokka xylophone " * 50 + "\n")
    build_tokenizer(adapter, tmp_path / "other-corpus")
    c = only(
        validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW)),
        "tokenizer.vocab",
    )
    assert "vocabulary differs from the served base" in c.message and str(served) in c.message


def test_template_divergence_names_conversation_and_context(adapter, tiny_vl_base, tmp_path):
    from pipeline.dev.tinybase import build_tiny_served, chat_template_text

    drifted = chat_template_text().replace("'\\n<tool_response>\\n'", "'<tool_response>'")
    assert drifted != chat_template_text()
    served_dir = build_tiny_served(tiny_vl_base, tmp_path / "served-drift", chat_template=drifted)
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(served_path=served_dir, vllm_version=NEW))
    c = only(rep, "template.divergence")
    assert rep.stats["template_conversations"]["diverged"] == ["tool_call"]
    assert "conversation 'tool_call'" in c.message and "<tool_response>" in c.message
    assert "--chat-template" in c.message and str(served_dir) in c.where


def test_training_template_comes_from_the_resolved_axolotl_config(
    adapter,
    tiny_base,
    tiny_vl_base,
    served,  # noqa: F811
    tmp_path,
):
    resolved = tmp_path / "resolved.yml"
    resolved.write_text(
        json.dumps(
            {
                "base_model": str(tiny_base),
                "chat_template": "tokenizer_default",
                "datasets": [{"path": "x.jsonl", "type": "chat_template"}],
            }
        )
    )
    rep = validate_adapter(
        adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW), training_config=resolved
    )
    assert rep.passed and "tokenizer_default" in rep.stats["template_source"]["training"]
    # axolotl's named `chatml` template (no tools, no reasoning) is not what the fleet serves
    resolved.write_text(json.dumps({"base_model": str(tiny_base), "chat_template": "chatml"}))
    rep = validate_adapter(
        adapter, tiny_vl_base, FleetRules(served_path=served, vllm_version=NEW), training_config=resolved
    )
    c = only(rep, "template.divergence")
    assert "chatml" in c.where and not rep.passed


# -- rsLoRA normalisation --------------------------------------------------------------------------------------------
def test_fold_rslora_keeps_every_scale(adapter, tiny_vl_base):
    from pipeline.artifacts.adapter import load_adapter_config
    from pipeline.artifacts.manifest import file_hashes, read_manifest, verify_files
    from pipeline.artifacts.normalise import module_names, scale_table

    edit_config(
        adapter, use_rslora=True, alpha_pattern={"down_proj": 64, "model.layers.3.self_attn.q_proj": 4}
    )
    (adapter / "manifest.json").write_text(json.dumps({"files": file_hashes(adapter), "adapter": {}}))
    modules = module_names(adapter)
    before = scale_table(load_adapter_config(adapter).raw, modules)
    assert before["model.layers.0.mlp.down_proj"] == pytest.approx(64 / 8**0.5)
    assert validate_adapter(adapter, tiny_vl_base).passed  # vLLM applies alpha/sqrt(r) exactly (issue 25.3)

    rep = validate_adapter(adapter, tiny_vl_base, fold_rslora=True)
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    c = only(rep, "config.rslora_folded")
    assert c.severity == "warning" and "unchanged on all 25 modules" in c.message
    cfg = load_adapter_config(adapter)
    assert cfg.use_rslora is False
    after = scale_table(cfg.raw, modules)
    assert after == pytest.approx(before, rel=1e-12)
    man = read_manifest(adapter)
    assert verify_files(adapter, man.files) == [] and man.normalised["rslora"]["before"]["use_rslora"] is True


def test_fold_handles_overlapping_patterns():
    from pipeline.artifacts.normalise import fold_config, scale_table

    raw = {
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": True,
        "rank_pattern": {"layers.3.self_attn.q_proj": 16},
        "alpha_pattern": {"q_proj": 8},
    }
    modules = [
        "model.layers.3.self_attn.q_proj",
        "model.layers.7.self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
    ]
    new, bad = fold_config(raw, modules)
    assert bad == [] and new["use_rslora"] is False
    assert scale_table(new, modules) == pytest.approx(scale_table(raw, modules), rel=1e-12)


# -- behaviour (peft + transformers on CPU) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def val_file(tmp_path_factory) -> Path:
    lines = (REPO / "datasets" / "agent_chat_validation.jsonl").read_text().splitlines()
    p = tmp_path_factory.mktemp("val") / "val.jsonl"
    p.write_text(sorted(lines, key=len)[0] + "\n")
    return p


@pytest.mark.slow
@pytest.mark.parametrize("factor,check_id", [(1e-4, "behaviour.canary"), (300.0, "behaviour.eval_loss")])
def test_behaviour_fixtures(good_adapter, tiny_base, tmp_path, val_file, factor, check_id):  # noqa: F811
    d = Path(shutil.copytree(good_adapter, tmp_path / "a"))
    edit_tensors(d, lambda t: {k: (v * factor if "lora_B" in k else v) for k, v in t.items()})
    rep = validate_adapter(d, tiny_base, behaviour=True, validation_files=[val_file])
    c = only(rep, check_id)
    assert c.severity == "error" and c.where == str(d)
    assert "canary" in c.message or "eval loss with the adapter" in c.message
    b = rep.stats["behaviour"]
    assert b["conversations"] == 1 and b["eval_tokens"] > 0
    if check_id == "behaviour.canary":
        assert b["canaries_identical"] == "3/3"
    else:
        assert b["eval_loss_adapter"] > b["eval_loss_base"]


@pytest.mark.slow
def test_behaviour_passes_for_an_adapter_that_fits_the_data(tiny_base, tmp_path, val_file):
    """A LoRA fitted for a few steps on the validation conversations lowers their loss and changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.validate.behaviour import _assistant_mask, _conversations

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32),
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
        ),
    )
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        for conv in _conversations([val_file]):
            ids, mask = _assistant_mask(tok, conv["messages"], conv.get("tools"))
            x = torch.tensor([ids])
            labels = torch.where(torch.tensor([mask]) == 1, x, torch.tensor(-100))
            model(input_ids=x, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    model.save_pretrained(str(tmp_path / "fitted"))
    rep = validate_adapter(tmp_path / "fitted", tiny_base, behaviour=True, validation_files=[val_file])
    assert rep.passed, [(c.id, c.message) for c in rep.checks]
    b = rep.stats["behaviour"]
    assert b["eval_loss_adapter"] < b["eval_loss_base"] and b["canaries_identical"] != "3/3"


# -- CLI and the publish gate -----------------------------------------------------------------------------------------
def test_cli_exit_codes(project, adapter, tiny_vl_base, served, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    monkeypatch.setenv("PIPELINE_FLEET__VLLM_VERSION", NEW)  # the tiny served checkpoint is a 0.32+ class

    from pipeline.cli import app

    run = CliRunner().invoke
    r = run(app, ["validate", str(adapter), "--base", str(tiny_vl_base), "--served", str(served), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["verdict"] == "pass"
    edit_config(adapter, r=16)
    r = run(app, ["validate", str(adapter), "--base", str(tiny_vl_base)])
    assert r.exit_code == 1 and "keys.rank" in r.output
    r = run(app, ["validate", str(adapter)])
    assert r.exit_code == 2 and "--base" in r.output


def test_publish_refuses_a_registered_adapter_that_failed_validation(project, adapter, tiny_vl_base):
    from pipeline import registry
    from pipeline.artifacts.manifest import file_hashes
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish

    edit_tensors(
        adapter,
        lambda t: {
            k: (v * float("nan") if k.endswith("0.mlp.up_proj.lora_B.weight") else v) for k, v in t.items()
        },
    )
    (adapter / "manifest.json").write_text(
        json.dumps({"files": file_hashes(adapter), "base_model": {"id": "tiny"}, "adapter": {"r": 8}})
    )
    rep = validate_adapter(adapter, tiny_vl_base)
    assert only(rep, "values.nonfinite") and rep.verdict == "fail"
    reg = registry.register_adapter(project, adapter, "broken", rep.to_dict())
    with pytest.raises(CheckFailed, match="validation verdict is 'fail'"):
        publish(project, "broken", version=reg.version)
    assert not (project.volume.path / f"broken-v{reg.version}").exists()


def test_behaviour_unavailable_and_skipped(good_adapter, tiny_vl_base, tiny_base, tmp_path):  # noqa: F811
    """`--behaviour` never raises: an unloadable base, failed static checks and no validation data are findings."""
    base = Path(shutil.copytree(tiny_base, tmp_path / "odd-base"))
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(
        json.dumps(cfg | {"model_type": "no_such_model", "architectures": ["Nope"]})
    )
    rep = validate_adapter(good_adapter, base, behaviour=True)  # headers fine, transformers cannot load it
    assert only(rep, "behaviour.unavailable").severity == "error"
    d = Path(shutil.copytree(good_adapter, tmp_path / "bad"))
    edit_config(d, r=16)
    rep = validate_adapter(d, tiny_base, behaviour=True)
    assert only(rep, "behaviour.skipped").severity == "info"


@pytest.mark.slow
def test_behaviour_without_validation_data(good_adapter, tiny_base):  # noqa: F811
    rep = validate_adapter(good_adapter, tiny_base, behaviour=True, validation_files=[])
    assert only(rep, "behaviour.no_data").severity == "warning"


def test_behaviour_without_assistant_tokens_says_so(good_adapter, tiny_base, tmp_path):  # noqa: F811
    """Validation conversations with no assistant turn: both losses are NaN, and the finding blamed the
    adapter ('non-finite logits; retrain'). It names the data now."""
    f = tmp_path / "val.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    rep = validate_adapter(good_adapter, tiny_base, behaviour=True, validation_files=[f])
    c = only(rep, "behaviour.eval_loss")
    assert c.severity == "error" and "no assistant tokens in 1 validation conversations" in c.message


def test_behaviour_with_the_manifests_validation_files_missing_fails(good_adapter, tiny_base, tmp_path):  # noqa: F811
    """The manifest lists a validation file that is not here: the eval-loss comparison did not run and the
    only finding was the warning 'manifest lists none', so the verdict passed."""
    from pipeline.artifacts.manifest import (
        AdapterManifest,
        DatasetFile,
        DatasetRecord,
        file_hashes,
        write_manifest,
    )

    d = Path(shutil.copytree(good_adapter, tmp_path / "a"))
    gone = tmp_path / "moved" / "val.jsonl"
    man = AdapterManifest(
        files=file_hashes(d), dataset=DatasetRecord(files=[DatasetFile(path=str(gone), role="validation")])
    )
    write_manifest(d, man)
    rep = validate_adapter(d, tiny_base, behaviour=True)
    c = only(rep, "behaviour.eval_loss")
    assert c.severity == "error" and str(gone) in c.message and not rep.passed
    assert "behaviour.no_data" not in {x.id for x in rep.checks}
    # one of two here: compared on the rest, with a warning naming the missing one
    here = tmp_path / "val.jsonl"
    here.write_text((REPO / "datasets" / "agent_chat_validation.jsonl").read_text().splitlines()[0] + "\n")
    man.dataset.files.append(DatasetFile(path=str(here), role="validation"))
    write_manifest(d, man)
    rep = validate_adapter(d, tiny_base, behaviour=True)
    w = only(rep, "behaviour.no_data")
    assert w.severity == "warning" and "1 of the manifest's validation files are not here" in w.message
    assert rep.stats["behaviour"]["conversations"] == 1


@pytest.mark.parametrize(
    "lora, base, words",
    [
        (1.0, float("nan"), "eval loss of the base alone is nan"),  # lora > nan is False: it passed
        (float("nan"), 1.0, "eval loss with the adapter is nan"),
        (2.0, 1.0, "> base 1.0000"),
    ],
)
def test_eval_loss_rule_needs_a_measured_baseline(tmp_path, lora, base, words):
    """The rule on given measurements (a base whose own loss is NaN while the adapter's is finite cannot be
    built from a tiny model: a context stand-in carries the figures)."""
    from types import SimpleNamespace

    from pipeline.validate.behaviour import eval_loss_worse
    from pipeline.validate.facts import Fact

    stats = {"eval_loss_adapter": lora, "eval_loss_base": base, "eval_tokens": 12, "conversations": 1}
    ctx = SimpleNamespace(behaviour=Fact(stats), stats={}, adapter_dir=tmp_path, base_dir=tmp_path)
    (issue,) = list(eval_loss_worse(ctx))
    assert words in issue.message


def test_cli_never_prints_a_traceback_on_hostile_adapters(project, good_adapter, tiny_vl_base, tmp_path):  # noqa: F811
    """Issue 16.3 through the CLI: symlink, weights directory, NaN alpha, NaN r, overlapping tensors -> exit 1."""
    import os

    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.validate.cases import _overlap, _rewrite_header

    setups = {
        "symlink": lambda d: os.symlink("/etc/shadow", d / "notes.txt"),
        "weights_dir": lambda d: (
            (d / "adapter_model.safetensors").unlink(),
            (d / "adapter_model.safetensors").mkdir(),
        ),
        "nan_alpha": lambda d: edit_config(d, lora_alpha=float("nan")),
        "inf_alpha": lambda d: edit_config(d, lora_alpha=float("inf")),
        "nan_r": lambda d: edit_config(d, r=float("nan")),
        "overlap": lambda d: _rewrite_header(d, _overlap),
    }
    for name, setup in setups.items():
        d = Path(shutil.copytree(good_adapter, tmp_path / name))
        setup(d)
        r = CliRunner().invoke(app, ["validate", str(d), "--base", str(tiny_vl_base)])
        assert r.exit_code == 1, (name, r.output)
        assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit), (
            name
        )
