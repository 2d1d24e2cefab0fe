"""Unknown axolotl keys are refused before anything is written, against axolotl's own pydantic models.

axolotl's config model ignores extra keys, so a typo would train with the default silently
(issue 17 item 3). Real axolotl schema (no fake): `axolotl.utils.schemas.config`.
"""

import subprocess
import sys

import pytest

from pipeline.errors import CheckFailed
from pipeline.train.config import load_training_config
from pipeline.train.schema import axolotl_models, check_axolotl_schema, check_known_keys, unknown_keys
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"
PROD = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"
FSDP = REPO / "axolotl_configs" / "fsdp2.yml"


@pytest.fixture(scope="module")
def models():
    return axolotl_models({})


def test_shipped_configs_have_no_unknown_keys():
    for path, overlays in ((TINY, []), (PROD, []), (PROD, [FSDP])):
        check_known_keys(load_training_config(path, [], overlays))


def test_set_typo_is_refused_with_the_closest_key():
    """The issue's instance: `--set learning_rat=0.001`."""
    tc = load_training_config(TINY, ["learning_rat=0.001"])
    with pytest.raises(CheckFailed) as e:
        check_axolotl_schema(tc)
    msg = str(e.value)
    assert "--set learning_rat=0.001: `learning_rat` is not an axolotl setting" in msg
    assert "did you mean `learning_rate`?" in msg


def test_typo_inside_a_dataset_entry(models):
    """Sibling: nested models (each `datasets` entry against axolotl's dataset models)."""
    data = {"datasets": [{"path": "x.jsonl", "type": "chat_template", "feld_messages": "messages"}]}
    assert unknown_keys(data, models) == [("datasets[0].feld_messages", "field_messages")]


def test_typo_in_an_overlay_names_the_overlay(tmp_path):
    """Sibling: an overlay file's key, reported with the overlay's path."""
    ov = tmp_path / "overlay.yml"
    ov.write_text("gradient_acumulation_steps: 4\n")
    with pytest.raises(CheckFailed) as e:
        check_known_keys(load_training_config(TINY, [], [ov]))
    assert f"{ov}: `gradient_acumulation_steps`" in str(e.value)
    assert "gradient_accumulation_steps" in str(e.value)


def test_typo_in_the_config_file_names_the_file(tmp_path):
    """Sibling: the config itself, and a nested mapping (fsdp_config's model)."""
    cfg = tmp_path / "c.yml"
    cfg.write_text(TINY.read_text() + "lora_dropuot: 0.1\nfsdp_config: {fsdp_versoin: 2}\n")
    with pytest.raises(CheckFailed) as e:
        check_known_keys(load_training_config(cfg))
    msg = str(e.value)
    assert f"{cfg}: `lora_dropuot`" in msg and "lora_dropout" in msg
    assert "`fsdp_config.fsdp_versoin`" in msg and "fsdp_version" in msg


def test_aliases_and_pipeline_keys_are_known(models):
    assert unknown_keys({"model_revision": "abc", "model_type": "X"}, models) == []
    check_known_keys(load_training_config(TINY, ["base_model_revision=abc"]))


def test_base_model_revision_reaches_axolotl(tmp_path):
    """`base_model_revision` is the pipeline's key: the resolved config gives axolotl `revision_of_model`."""
    from pipeline.config import load_config
    from pipeline.train.launch import resolve

    tc = load_training_config(TINY, ["base_model=Qwen/Qwen3.6-27B", "base_model_revision=0123abc"])
    d = resolve(tc, tmp_path, load_config(None))
    assert d["revision_of_model"] == "0123abc"


def test_the_tracking_uri_stays_out_of_resolved_yml(tmp_path, monkeypatch):
    """Sibling of issue 30 kind 4 (a secret in a file): `resolved.yml` (kept with the run, 0644) held
    `mlflow_tracking_uri: postgresql://user:PASSWORD@...`. The trainer gets the URI from its
    environment; one in the user's own config goes too (axolotl would let it override the environment)."""
    from pipeline.config import load_config
    from pipeline.train.launch import resolve

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://lora:S3cret-Passw0rd@db:5432/mlflow")
    tc = load_training_config(TINY, ["mlflow_tracking_uri=http://u:Other-Secret-1@h:5000"])
    d = resolve(tc, tmp_path, load_config(None))
    assert "mlflow_tracking_uri" not in d and d["use_mlflow"] is True
    text = type(tc)(tmp_path / "resolved.yml", d).dump()
    assert "S3cret-Passw0rd" not in text and "Other-Secret-1" not in text


def test_cli_train_refuses_before_writing(tmp_path):
    """`pipeline train ... --set learning_rat=0.001`: exit 1, nothing written, one clear message."""
    (tmp_path / "pipeline.yaml").write_text(
        f"state_dir: {tmp_path / 'state'}\ntrain: {{runs_dir: {tmp_path / 'runs'}}}\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "--config",
            str(tmp_path / "pipeline.yaml"),
            "train",
            str(TINY),
            "--set",
            f"base_model={tmp_path}",
            "--set",
            "learning_rat=0.001",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "learning_rate" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "state" / "mlflow.db").exists()


# -- issue 41 item 4: a typo is refused before the heavy imports, from axolotl's keys kept as data -------------------
def test_the_key_tree_gives_the_models_answers(models, tmp_path, monkeypatch):
    """`KeyTree` (cached as JSON) answers like the pydantic models it was built from, nested models included;
    a cache file that cannot be read is computed again."""
    from pipeline.train.schema import KeyTree, key_tree

    tree = KeyTree.of(models)
    data = {
        "learning_rat": 1,
        "model_revision": "abc",
        "datasets": [{"path": "x", "feld_messages": "m"}],
        "fsdp_config": {"fsdp_versoin": 2},
    }
    assert unknown_keys(data, tree) == unknown_keys(data, models)
    assert len(unknown_keys(data, tree)) == 3
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path))
    first = key_tree({})  # computed (axolotl is imported here already) and cached
    (cached,) = tmp_path.glob("axolotl-keys-*.json")
    assert key_tree({}, cached_only=True) == first
    cached.write_text("{not json")
    assert key_tree({}, cached_only=True) is None and key_tree({}) == first  # passed by, then rewritten


def test_the_cache_key_follows_axolotl_the_plugins_and_the_pipeline_plugin():
    from pipeline.train.schema import PLUGIN, _cache_key

    liger = "axolotl.integrations.liger.LigerPlugin"
    assert _cache_key([PLUGIN]) != _cache_key([liger, PLUGIN])
    assert (
        _cache_key(["no_such_package_xyz.Plugin", PLUGIN]) is None
    )  # not named without importing: not cached


# Each refusal in a fresh interpreter: exit code, message, and none of the heavy libraries imported. The issue's
# instances (a `train` option typo: 11-14 s; an overlay key typo: 19.5 s) and their siblings.
FAST_REFUSALS = [
    (["train", "{tiny}", "--lerning-rate", "0.001"], 2, "No such option: --lerning-rate"),
    (["run", "{tiny}", "--lerning-rate", "0.001"], 2, "No such option: --lerning-rate"),
    (
        ["train", "{tiny}", "--overlay", "{overlay}"],
        1,
        "`gradient_acumulation_steps` is not an axolotl setting",
    ),
    (["run", "{tiny}", "--set", "learning_rat=0.1"], 1, "did you mean `learning_rate`"),
    (["train", "{tiny}", "--overlay", "{nested}"], 1, "`datasets[0].feld_messages`"),
    (["train", "{tiny}", "--overlay", "{tmp}/none.yml"], 2, "none.yml"),
]


@pytest.mark.parametrize("argv, code, words", FAST_REFUSALS)
def test_typos_are_refused_before_the_heavy_imports(tmp_path, argv, code, words):
    import os

    from pipeline.train.schema import key_tree

    key_tree({})  # warm: what any earlier check on this machine left in the cache
    key_tree({"plugins": ["axolotl.integrations.liger.LigerPlugin"]})
    (tmp_path / "ov.yml").write_text("gradient_acumulation_steps: 4\n")
    (tmp_path / "nested.yml").write_text(
        "datasets:\n  - {path: datasets/agent_chat_train.jsonl, type: chat_template, feld_messages: m}\n"
    )
    args = [
        a.format(tiny=TINY, overlay=tmp_path / "ov.yml", nested=tmp_path / "nested.yml", tmp=tmp_path)
        for a in argv
    ]
    (tmp_path / "pipeline.yaml").write_text(
        f"state_dir: {tmp_path / 'state'}\ntrain: {{runs_dir: {tmp_path / 'runs'}}}\n"
    )
    probe = (
        "import sys\nfrom pipeline.cli import app\n"
        "try:\n    app(prog_name='pipeline')\nfinally:\n"
        "    print('HEAVY', sorted(m for m in ('axolotl', 'torch', 'transformers', 'mlflow', 'pipeline.validate')"
        " if m in sys.modules), file=sys.stderr)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, "--config", str(tmp_path / "pipeline.yaml"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert r.returncode == code, r.stderr[-2000:]
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "HEAVY []" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "state" / "mlflow.db").exists()
