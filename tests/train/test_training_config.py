"""Training config checks: refuse what a hot-loading vLLM fleet cannot serve, before training."""

import pytest

from pipeline.errors import CheckFailed, UsageError
from pipeline.train.config import check_training_config, load_training_config, servability_problems
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def ids(tc, rank=16, allow=()):
    return {cid for cid, _ in servability_problems(tc, rank, set(allow))}


def test_shipped_configs_are_servable(tmp_path):
    tiny = load_training_config(TINY, [f"base_model={tmp_path}"])
    assert ids(tiny) == set()
    prod = load_training_config(REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml")
    assert ids(prod) == set()
    targets = prod.data["lora_target_modules"]
    assert {"in_proj_qkv", "in_proj_z", "out_proj"} <= set(targets)
    assert prod.data["chat_template"] == "tokenizer_default" and prod.data.get("eval_steps")


@pytest.mark.parametrize(
    "override, cid, legacy",
    [
        ("peft_use_dora=true", "config.dora", "dora"),
        ("lora_modules_to_save=[embed_tokens]", "config.modules_to_save", "modules_to_save"),
        ("lora_target_modules=[q_proj, lm_head]", "config.embedding_targets", "embedding_targets"),
        ("lora_r=24", "config.rank", "rank"),  # above 16 (not because 24 is no --max-lora-rank value)
        ("lora_r=32", "config.rank", "rank"),  # above the fleet's max_lora_rank 16
        ("adapter=qlora", "train.qlora", "qlora"),
        ("base_model=Org/Model", "train.unpinned_base", "unpinned_base"),
    ],
)
def test_unservable_settings_refused(tmp_path, override, cid, legacy):
    tc = load_training_config(TINY, [f"base_model={tmp_path}", override])
    assert cid in ids(tc)
    assert cid not in ids(tc, allow={cid})
    assert cid not in ids(tc, allow={legacy})  # the short ids of earlier releases still work


@pytest.mark.parametrize("override", ["lora_r=4", "lora_r=12", "lora_rank_pattern={q_proj: 4}"])
def test_ranks_up_to_the_fleet_max_are_not_refused(tmp_path, override):
    """vLLM serves any rank up to --max-lora-rank (peft_helper.py validate_legal); {1, 8, 16, ...} are the values of
    that flag, not of an adapter's r."""
    assert "config.rank" not in ids(load_training_config(TINY, [f"base_model={tmp_path}", override]))


def test_check_names_missing_dataset(tmp_path):
    """A missing file is bad input (exit 2, README), named by its entry on the message's first line."""
    tc = load_training_config(
        TINY,
        [
            f"base_model={tmp_path}",
            f"datasets=[{{path: {REPO / 'datasets/agent_chat_train.jsonl'}}}, "
            "{path: nope.jsonl, type: chat_template}]",
        ],
    )
    with pytest.raises(UsageError) as e:
        check_training_config(tc, 16)
    first = str(e.value).splitlines()[0]
    assert (
        f"{TINY} (--set datasets): datasets[1] (type chat_template) path nope.jsonl does not exist" in first
    )


def test_a_moved_base_directory_is_named_as_one(tmp_path, monkeypatch):
    """A base_model path that is gone was reported as "a hub id without base_model_revision: pin a commit
    sha"."""
    monkeypatch.chdir(tmp_path)
    for base in (".state/tiny-base", str(tmp_path / "bases/tiny"), "../tiny-base"):  # none can be a hub id
        with pytest.raises(UsageError) as e:
            check_training_config(load_training_config(TINY, [f"base_model={base}"]), 16)
        assert f"base_model {base} does not exist" in str(e.value)
        assert "moved or deleted" in str(e.value) and "point base_model at the directory" in str(e.value)
    assert f"working directory {tmp_path}" in str(e.value)  # a relative path: from where
    # `org/name` may be a hub id or a relative directory: the rule says both
    (msg,) = [
        m for cid, m in servability_problems(load_training_config(TINY, ["base_model=models/qwen"]), 16)
    ]
    assert "read as a hub id" in msg and "point base_model at its directory" in msg


# -- the rules `validate` runs, before axolotl starts (issue 15 kind 8): one failing config per instance ------------
TRAIN_CASES = [
    ("config.rank", ["lora_rank_pattern={q_proj: 32}"], "lora_rank_pattern[q_proj] = 32 exceeds"),
    ("config.rank", ["lora_rank_pattern={q_proj: 0}"], "not a positive integer rank"),
    ("config.init", ["peft_init_lora_weights=pissa"], "peft_init_lora_weights = 'pissa'"),
    ("config.init", ["peft_init_lora_weights=olora"], "olora"),
    ("config.init", ["peft_init_lora_weights=lora_ga"], "lora_ga_init"),
    ("tokenizer.added_tokens", ["special_tokens={eos_token: '<|newtok|>'}"], "<|newtok|>"),
    ("tokenizer.added_tokens", ["tokens=['<my_tool>']"], "<my_tool>"),
    (  # a family pipeline.train.packing does not cover (hub id: the family comes from model_type)
        "train.sample_packing",
        [
            "base_model=Qwen/Qwen3-Next-80B-A3B-Instruct",
            "model_type=Qwen3NextForCausalLM",
            "sample_packing=true",
        ],
        "Gated-DeltaNet",
    ),
    ("template.divergence", ["chat_template=chatml"], "chatml"),
    ("template.divergence", ["chat_template=qwen3_5"], "qwen3_5"),
    ("template.training", ["chat_template=no_such_template"], "no_such_template"),
    (
        "template.eos_terminator",
        ["special_tokens={eos_token: '<|endoftext|>'}"],
        "eos_token is '<|endoftext|>'",
    ),
    ("config.target_absent", ["lora_target_modules=[q_proj, in_proj_qkvz]"], "'in_proj_qkvz'"),
    ("config.target_absent", ["lora_target_modules=[q_proj, c_attn]"], "'c_attn'"),
    ("config.peft_type", ["adapter=ia3"], "adapter is 'ia3'"),
    ("config.required", ["lora_target_modules=[]"], "lora_target_linear"),
    ("config.required", ["lora_alpha=null"], "lora_alpha is missing"),
    ("config.regex", ["lora_rank_pattern={'q_proj(': 8}"], "not a valid regex"),
    ("config.layer_replication", ["peft_layer_replication=[[0, 2]]"], "peft_layer_replication"),
    (
        "config.target_parameters",
        ["lora_target_parameters=[mlp.experts.down_proj]"],
        "lora_target_parameters",
    ),
    ("config.patterns_ignored", ["lora_alpha_pattern={down_proj: 64}"], "pipeline publish"),
    ("fleet.rank_oversized", ["lora_r=1"], "--max-lora-rank 16"),
    ("train.base_model", ["base_model="], "base_model is missing"),
    ("serving.version_unknown", [], "0.28.0"),
    ("config.embedding_targets", ["lora_target_modules=[q_proj, embed_tokens]"], "embed_tokens"),
    ("train.qlora", ["adapter=qlora"], "4-bit base"),
    ("config.dora", ["peft_use_dora=true"], "peft_use_dora"),
    ("config.modules_to_save", ["lora_modules_to_save=[lm_head]"], "lora_modules_to_save"),
]


@pytest.mark.parametrize(
    "cid, overrides, words", TRAIN_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TRAIN_CASES)]
)
def test_train_runs_the_validation_rules_before_axolotl(tiny_base, cid, overrides, words):
    from pipeline.train.config import training_findings
    from pipeline.train.preflight import packing_problems
    from pipeline.validate import FleetRules

    version = "0.28.0" if cid == "serving.version_unknown" else "0.19.2"
    tc = load_training_config(TINY, [f"base_model={tiny_base}", *overrides])
    packing = packing_problems(tc, [])  # no GPU here: the preflight's facts, as `pipeline train` passes them
    findings = training_findings(tc, FleetRules(vllm_version=version), packing=packing)
    found = [f for f in findings if f.id == cid]
    assert found, [(f.id, f.message) for f in findings]
    assert words in f"{found[0].message} {found[0].where}" and found[0].where
    if found[0].severity == "error":
        with pytest.raises(CheckFailed, match=f"--allow {cid}"):
            check_training_config(tc, FleetRules(vllm_version=version), packing=packing)


def test_shipped_tiny_config_passes_every_rule(tiny_base):
    from pipeline.train.config import training_findings
    from pipeline.validate import FleetRules

    tc = load_training_config(TINY, [f"base_model={tiny_base}"])
    assert training_findings(tc, FleetRules()) == []


def test_packing_refusal_is_the_preflight_rule_under_one_id(tmp_path, tiny_base):
    """The gpu preflight's packing facts are reported as train.sample_packing, overridable by --allow."""
    from pipeline.train.config import training_findings
    from pipeline.train.preflight import packing_problems
    from pipeline.validate import FleetRules

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    tc = load_training_config(TINY, [f"base_model={tmp_path}", "sample_packing=true"])
    assert packing_problems(tc, []) == []  # not a Gated-DeltaNet model
    assert (
        packing_problems(load_training_config(TINY, [f"base_model={tiny_base}", "sample_packing=true"]), [])
        == []
    )
    nxt = tmp_path / "next"  # a Gated-DeltaNet family the exact-packing patch does not cover
    nxt.mkdir()
    (nxt / "config.json").write_text('{"model_type": "qwen3_next"}')
    gdn = load_training_config(TINY, [f"base_model={nxt}", "sample_packing=true"])
    facts = packing_problems(gdn, [])
    ids_ = {f.id for f in training_findings(gdn, FleetRules(), packing=facts)}
    assert "train.sample_packing" in ids_
    assert "train.sample_packing" not in {
        f.id for f in training_findings(gdn, FleetRules(), {"train.sample_packing"}, packing=facts)
    }


def test_axolotl_schema_refusal_before_anything_is_written(tmp_path):
    """axolotl's own validation runs in-process before a run directory or MLflow run exists."""
    from pipeline.errors import CheckFailed
    from pipeline.train.schema import check_axolotl_schema

    check_axolotl_schema(
        load_training_config(TINY, [f"base_model={tmp_path}"])
    )  # the shipped config is valid
    with pytest.raises(CheckFailed, match="micro_batch_size: Input should be a valid integer"):
        check_axolotl_schema(load_training_config(TINY, [f"base_model={tmp_path}", "micro_batch_size=abc"]))
