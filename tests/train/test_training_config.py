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
    "override, cid",
    [
        ("peft_use_dora=true", "dora"),
        ("lora_modules_to_save=[embed_tokens]", "modules_to_save"),
        ("lora_target_modules=[q_proj, lm_head]", "embedding_targets"),
        ("peft_use_rslora=true", "rslora"),
        ("lora_r=24", "rank"),
        ("lora_r=32", "rank"),  # above the fleet's max_lora_rank 16
        ("adapter=qlora", "qlora"),
        ("base_model=Org/Model", "unpinned_base"),
    ],
)
def test_unservable_settings_refused(tmp_path, override, cid):
    tc = load_training_config(TINY, [f"base_model={tmp_path}", override])
    assert cid in ids(tc)
    assert cid not in ids(tc, allow={cid})


def test_check_names_missing_dataset(tmp_path):
    tc = load_training_config(
        TINY, [f"base_model={tmp_path}", "datasets=[{path: nope.jsonl, type: chat_template}]"]
    )
    with pytest.raises(CheckFailed, match="nope.jsonl does not exist"):
        check_training_config(tc, 16)


def test_bad_yaml_and_override(tmp_path):
    p = tmp_path / "c.yml"
    p.write_text("adapter: lora\nlora_r: [\n")
    with pytest.raises(UsageError, match=rf"{p}:\d+: not valid YAML"):
        load_training_config(p)
    with pytest.raises(UsageError, match="key=value"):
        load_training_config(TINY, ["max_steps"])
    with pytest.raises(UsageError, match="unknown check id"):
        check_training_config(load_training_config(TINY), 16, {"everything"})


@pytest.mark.parametrize(
    "override, message",
    [
        ("datasets=/tmp/x.jsonl", "must be a list of mappings with a path"),
        ("datasets=[/tmp/x.jsonl]", "must be a list of mappings with a path"),
        ("datasets={path: /tmp/x}", "must be a list of mappings with a path"),
    ],
)
def test_malformed_dataset_overrides_are_usage_errors(tmp_path, override, message):
    """Regression: these reached the trainer set-up as AttributeError/KeyError tracebacks."""
    tc = load_training_config(TINY, [f"base_model={tmp_path}", override])
    with pytest.raises(UsageError, match=message):
        check_training_config(tc, 16)


def test_unparseable_override_value():
    with pytest.raises(UsageError, match="not valid YAML"):
        load_training_config(TINY, ["lora_r=["])


def test_axolotl_schema_refusal_before_anything_is_written(tmp_path):
    """axolotl's own validation runs in-process before a run directory or MLflow run exists."""
    from pipeline.train.launch import check_axolotl_schema

    check_axolotl_schema(
        load_training_config(TINY, [f"base_model={tmp_path}"])
    )  # the shipped config is valid
    with pytest.raises(CheckFailed, match="micro_batch_size: Input should be a valid integer"):
        check_axolotl_schema(load_training_config(TINY, [f"base_model={tmp_path}", "micro_batch_size=abc"]))
