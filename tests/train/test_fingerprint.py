"""One input fingerprint for every registration (issue 17 item 2): demo, train + register and run agree."""

import shutil

from pipeline.artifacts.fingerprint import (
    base_identity,
    config_inputs_sha256,
    inputs_fingerprint,
    manifest_fingerprint,
    training_inputs,
)
from pipeline.artifacts.manifest import parse_manifest
from pipeline.config import load_config
from pipeline.registry.versions import FINGERPRINT_TAG, version_tags
from pipeline.train.config import load_training_config
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def test_demo_overrides_and_plain_run_share_the_fingerprint(tmp_path, monkeypatch, tiny_base):
    """`make demo` trains tiny-cpu.yml with an absolute base_model and dataset_prepared_path;
    `pipeline run axolotl_configs/tiny-cpu.yml` from the project root uses the relative ones."""
    shutil.copytree(tiny_base, tmp_path / ".state" / "tiny-base")
    monkeypatch.chdir(tmp_path)
    demo = load_training_config(
        TINY,
        [
            f"base_model={tmp_path / '.state' / 'tiny-base'}",
            f"dataset_prepared_path={tmp_path / '.state/prepared'}",
        ],
    )
    run = load_training_config(TINY)
    assert training_inputs("d" * 64, demo.data) == training_inputs("d" * 64, run.data)
    # the base's location does not matter, its content does
    moved = tmp_path / "elsewhere"
    shutil.copytree(tiny_base, moved)
    assert training_inputs("d" * 64, load_training_config(TINY, [f"base_model={moved}"]).data) == (
        training_inputs("d" * 64, run.data)
    )


def test_what_changes_the_weights_changes_the_fingerprint(tmp_path, monkeypatch, tiny_base):
    shutil.copytree(tiny_base, tmp_path / ".state" / "tiny-base")
    monkeypatch.chdir(tmp_path)
    fp = training_inputs("d" * 64, load_training_config(TINY).data)["fingerprint"]
    for change in ("learning_rate=0.001", "lora_r=16", "seed=1", "datasets=[{path: a.jsonl, type: alpaca}]"):
        assert training_inputs("d" * 64, load_training_config(TINY, [change]).data)["fingerprint"] != fp, (
            change
        )
    assert training_inputs("e" * 64, load_training_config(TINY).data)["fingerprint"] != fp
    # ...and what only says where things go does not
    for same in ("output_dir=/x", "logging_steps=5", "mlflow_experiment_name=x", "dataset_prepared_path=/p"):
        assert training_inputs("d" * 64, load_training_config(TINY, [same]).data)["fingerprint"] == fp, same


def test_the_tokenizer_and_its_chat_template_change_the_fingerprint(tmp_path, monkeypatch, tiny_base):
    """A base whose chat template was fixed in place has the same config and safetensors headers: the
    fingerprint stayed, and `pipeline run` skipped the retrain on the new template. Sibling: a separate
    `tokenizer_config` directory, a location key whose bytes counted nowhere."""
    import json

    base = tmp_path / ".state" / "tiny-base"
    shutil.copytree(tiny_base, base)
    monkeypatch.chdir(tmp_path)
    fp = training_inputs("d" * 64, load_training_config(TINY).data)
    assert fp["tokenizer_sha256"] and len(fp["tokenizer_sha256"]) == 64
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": "{{ messages }}"}))
    changed = training_inputs("d" * 64, load_training_config(TINY).data)
    assert changed["base"] == fp["base"] and changed["fingerprint"] != fp["fingerprint"]
    tok = tmp_path / "tok"
    shutil.copytree(tiny_base, tok)
    with_tok = training_inputs("d" * 64, load_training_config(TINY, [f"tokenizer_config={tok}"]).data)
    assert with_tok["fingerprint"] == fp["fingerprint"]  # the same bytes elsewhere: the same inputs
    (tok / "tokenizer.json").write_text(
        (tok / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_stop|>"')
    )
    assert (
        training_inputs("d" * 64, load_training_config(TINY, [f"tokenizer_config={tok}"]).data)["fingerprint"]
        != fp["fingerprint"]
    )


def test_every_registration_tags_the_manifest_fingerprint(tmp_path):
    """`register_adapter` (used by `pipeline register`, `demo` and `run`) tags `run.fingerprint`."""
    cfg = load_config(None)
    inputs = {"fingerprint": "f" * 64}
    new = parse_manifest({"files": {}, "inputs": inputs, "dataset": {"fingerprint": "d" * 64}})
    tags = version_tags(cfg, new, {"verdict": "pass"}, None)
    assert tags[FINGERPRINT_TAG] == "f" * 64
    # a manifest from before the inputs block still gets a stable fingerprint
    old = {
        "files": {},
        "dataset": {"fingerprint": "d" * 64},
        "config_sha256": "c" * 64,
        "base_model": {"id": "b"},
    }
    fp = manifest_fingerprint(parse_manifest(old))
    assert fp and version_tags(cfg, parse_manifest(old), {}, None)[FINGERPRINT_TAG] == fp
    # ... the same value as before manifests were typed: sha256 of the three parts
    assert fp == inputs_fingerprint("d" * 64, "c" * 64, base_identity("b", None, None))


def test_dataset_paths_do_not_count_but_their_options_do():
    a = {"datasets": [{"path": "/a/train.jsonl", "type": "chat_template"}]}
    b = {"datasets": [{"path": "rel/train.jsonl", "type": "chat_template"}]}
    c = {"datasets": [{"path": "/a/train.jsonl", "type": "chat_template", "field_messages": "conversations"}]}
    assert config_inputs_sha256(a) == config_inputs_sha256(b) != config_inputs_sha256(c)


def _two_entries(first: str, second: str) -> dict:
    """tiny-cpu.yml with two training entries that read their files differently (roles trained)."""
    return load_training_config(
        TINY,
        [
            f"datasets=[{{path: {first}, ds_type: json, type: chat_template, roles_to_train: [assistant]}}, "
            f"{{path: {second}, ds_type: json, type: chat_template, roles_to_train: [assistant, tool]}}]"
        ],
    ).data


def test_which_file_goes_with_which_dataset_entry_counts(tmp_path, monkeypatch, tiny_base):
    """The config's inputs drop each entry's path and the dataset fingerprint sorts (role, sha256): swapping
    the files of two entries with different options gave the same fingerprint, so `pipeline run` skipped a
    changed training (and reused its prepared datasets). Paths themselves still do not count."""
    from pipeline.train.dataset import files_fingerprint

    project = tmp_path / "project"
    shutil.copytree(tiny_base, project / ".state" / "tiny-base")
    (project / "data").mkdir()
    for name in ("agent_chat_train.jsonl", "agent_chat_validation.jsonl"):
        shutil.copy(REPO / "datasets" / name, project / "data" / name)
    a, b = "data/agent_chat_train.jsonl", "data/agent_chat_validation.jsonl"
    monkeypatch.chdir(project)
    data_fp = files_fingerprint([project / a, project / b])  # the same files either way
    assert data_fp == files_fingerprint([project / b, project / a])
    ab = training_inputs(data_fp, _two_entries(a, b))
    ba = training_inputs(data_fp, _two_entries(b, a))
    assert ab["config_inputs_sha256"] == ba["config_inputs_sha256"]  # options alone: the same
    assert ab["fingerprint"] != ba["fingerprint"]
    # the whole project moved (relative paths from its new root, or absolute ones): the same inputs
    moved = tmp_path / "moved"
    shutil.move(project, moved)
    monkeypatch.chdir(moved)
    assert training_inputs(data_fp, _two_entries(a, b)) == ab
    assert training_inputs(data_fp, _two_entries(str(moved / a), str(moved / b))) == ab


def test_one_entry_per_dataset_list_keeps_its_fingerprint(tmp_path, monkeypatch, tiny_base):
    """With one entry per list the role pairs each file with its entry: no entry part, and the value is the
    one versions registered before it carry (no retrain after the upgrade)."""
    shutil.copytree(tiny_base, tmp_path / ".state" / "tiny-base")
    monkeypatch.chdir(tmp_path)
    inputs = training_inputs("d" * 64, load_training_config(TINY).data)
    assert inputs["dataset_entries_sha256"] is None
    assert inputs["fingerprint"] == inputs_fingerprint(
        "d" * 64, inputs["config_inputs_sha256"], inputs["base"], inputs["tokenizer_sha256"]
    )
