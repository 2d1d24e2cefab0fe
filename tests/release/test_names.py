"""One name grammar, checked before any work at every entry point; no name and version can produce
another's path or served name (issue 16 section 2)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.artifacts.names import GRAMMAR, MAX_LEN, check_name, name_problem
from pipeline.artifacts.volume import parse_version_name, version_dir, version_name
from pipeline.cli import app
from pipeline.errors import UsageError
from tests.support import release_support
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters

HOSTILE = {
    "../escape": "is a path",
    "a/b": "is a path",
    "/etc/passwd": "is a path",
    "..": "is a path",
    "x" * 300: "is 300 characters long",
    "": "is empty",
    "Agent": "contains 'A'",
    "a b": "contains ' '",
    "naïve": "contains 'ï'",
    "foo:bar": "contains ':'",
    "qwen3.6": "contains '.'",  # MLflow refuses '.' in the LoggedModel name
    "chat_2": "contains '_'",  # Kubernetes object names (schedule emit)
    ".hidden": "contains '.'",
    "-rf": "must start and end",
    "trailing-": "must start and end",
    "foo-v1": "version 1 of adapter 'foo'",
    "foo-v12": "version 12 of adapter 'foo'",
    "a\nb": "contains '\\n'",
    "abc\n": "contains '\\n'",  # issue 30: `$` matched before the newline: the directory `abc\n-v1`
    "\nabc": "contains '\\n'",
}


@pytest.mark.parametrize(
    "name", ["agent-tools", "qwen3-6-27b-lora", "a", "chat2", "x" * MAX_LEN, "foo-v1x", "v1"]
)
def test_valid_names(name):
    assert name_problem(name) is None and check_name(name) == name


@pytest.mark.parametrize("name,why", list(HOSTILE.items()), ids=lambda x: repr(x)[:20])
def test_hostile_names_are_refused_with_the_grammar(name, why):
    with pytest.raises(UsageError) as e:
        check_name(name)
    assert why in str(e.value) and GRAMMAR in str(e.value)
    assert len(str(e.value)) < 600  # a 300-character name is shortened in the message


def test_no_pattern_of_the_volume_or_the_tensors_takes_a_trailing_newline():
    """Siblings of `abc\n`: a directory `agent-v1\n` parsed as version 1 of `agent` (prune counted v1
    twice and deleted a version it should keep), a tensor `...lora_A.weight\n` parsed as a LoRA key."""
    from pipeline.artifacts.adapter import lora_key_form, parse_key
    from pipeline.artifacts.volume import staging_owner

    assert parse_version_name("agent-v1") == ("agent", 1)
    assert parse_version_name("agent-v1\n") is None
    assert staging_owner("agent\n") is None
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert parse_key(key) is not None
    assert parse_key(key + "\n") is None and lora_key_form(key + "\n") is not None


def test_instance_names_from_the_config_take_no_newline(tmp_path):
    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from tests.support.helpers import write_project_config

    p = write_project_config(tmp_path, fleet={"instances": [{"name": "vllm-1\n", "url": "http://h:1"}]})
    with pytest.raises(ConfigError, match="fleet.instances.0.name"):
        load_config(p)


def test_no_name_and_version_produce_another_adapters_directory_or_served_name():
    """`foo-v1` (an adapter) collided with version 1 of `foo`: publishing `foo` unloaded it."""
    names = ["foo", "foo-1", "foo-v", "foo-v1x", "f", "foo-vx", "v1"]
    seen = {}
    for n in names:
        assert name_problem(n) is None
        for v in (1, 2, 10, 11):
            vn = version_name(n, v)
            assert vn not in seen and vn not in names, (vn, seen.get(vn))
            assert name_problem(vn) is not None  # a version name is never a valid adapter name
            assert parse_version_name(vn) == (n, v)
            seen[vn] = (n, v)
    assert parse_version_name("foo-v1-v3") is None  # would need adapter `foo-v1`, which cannot exist


def test_default_names_from_config_files_fit_the_grammar():
    from pipeline.artifacts.names import default_name

    assert default_name("qwen3.6-27b-lora") == "qwen3-6-27b-lora"
    assert default_name("My_Config") == "my-config"
    assert name_problem(default_name("tiny-cpu")) is None


def test_served_base_name_is_refused(tmp_path, release_adapters):
    """Versions registered before the base was served under their name (issue 40: register now refuses
    too) are not published under it."""
    from pipeline.config import load_config
    from pipeline.release.publish import publish
    from tests.support.helpers import write_project_config

    legacy = new_project(tmp_path)
    cfg = load_config(
        write_project_config(tmp_path, served={"model": "tiny-base", "served_model_name": "base-llm"})
    )
    for n in ("tiny-base", "base-llm"):
        register_versions(legacy, n, release_adapters, 1)
        with pytest.raises(UsageError, match="serves the base model under"):
            publish(cfg, n, version=1)
        assert not version_dir(cfg.volume.path, n, 1).exists()


def _cli(cfg, *args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs/path", "x" * 300, "foo-v1"])
def test_register_refuses_bad_names_before_validation_runs(tmp_path, release_adapters, monkeypatch, name):
    """Issue 16: `register --name ../escape` ended in a traceback after validation had run; a
    300-character name registered, then publish failed with 'File name too long'."""
    import pipeline.cli.registry as cli_registry

    def no_validation(*a, **k):
        raise AssertionError("validation ran before the name was checked")

    monkeypatch.setattr(cli_registry, "validate_with_config", no_validation)
    cfg = new_project(tmp_path, store=False)
    r = _cli(cfg, "register", release_adapters[0][0], "--name", name)
    assert r.exit_code == 2, r.output
    assert "Adapter names use:" in r.output and "Traceback" not in r.output
    assert not (cfg.state_dir / "mlflow.db").exists()  # nothing registered, no store created


@pytest.mark.parametrize(
    "args",
    [
        ["publish", "../escape", "--version", "1"],
        ["promote", "a/b", "1"],
        ["rollback", "/abs"],
        ["status", "Foo"],
        ["fleet", "prune", "x" * 300],
        ["run", "axolotl_configs/tiny-cpu.yml", "--name", "../x"],
        ["train", "axolotl_configs/tiny-cpu.yml", "--name", "a/b"],
        ["follow-alias", "--once", "--name", "foo-v2"],
        ["schedule", "emit", "--kind", "systemd", "--name", "../x", "--config", "c.yml"],
        ["canary", "../no-such-adapter", "--staging", "http://127.0.0.1:9"],
        ["demo", "--name", "a/b"],
    ],
    ids=lambda a: " ".join(a)[:40],
)
def test_every_entry_point_checks_the_name_first(tmp_path, args):
    cfg = new_project(tmp_path, store=False)
    r = _cli(cfg, *args)
    assert r.exit_code == 2, r.output
    assert "Adapter names use:" in r.output and "Traceback" not in r.output
    assert not cfg.volume.path.exists() and not cfg.train.runs_dir.exists()
    assert not (cfg.state_dir / "mlflow.db").exists()


def test_library_entry_points_check_the_name(tmp_path, release_adapters):
    """The CLI is not the only caller: demo, the follower, run and tests call the functions."""
    from pipeline import registry
    from pipeline.release.prune import prune
    from pipeline.release.publish import publish
    from pipeline.release.rollback import rollback

    cfg = new_project(tmp_path)
    for call in (
        lambda: registry.register_adapter(cfg, release_adapters[0][0], "../x", release_adapters[0][1]),
        lambda: publish(cfg, "a/b", version=1),
        lambda: rollback(cfg, "foo-v1"),
        lambda: prune(cfg, "/x", 1),
    ):
        with pytest.raises(UsageError, match="Adapter names use"):
            call()
    assert not cfg.volume.path.exists()
