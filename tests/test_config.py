"""Project config: file, env overrides, clear errors."""

import pytest

from pipeline.config import ConfigError, load_config


def test_defaults_and_relative_paths(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("state_dir: st\nvolume: {path: vol}\nfleet: {max_lora_rank: 32}\n")
    cfg = load_config(p)
    assert cfg.state_dir == tmp_path / "st"
    assert cfg.volume.path == tmp_path / "vol"
    assert cfg.fleet.max_lora_rank == 32
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'st' / 'mlflow.db'}"


def test_env_overrides_file(tmp_path, monkeypatch):
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {max_lora_rank: 32}\nregistry: {tracking_uri: 'sqlite:///x.db'}\n")
    monkeypatch.setenv("PIPELINE_FLEET__MAX_LORA_RANK", "64")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    cfg = load_config(p)
    assert cfg.fleet.max_lora_rank == 64
    assert cfg.tracking_uri == "http://127.0.0.1:5999"


def test_invalid_rank_names_file_and_field(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {max_lora_rank: 24}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "fleet.max_lora_rank" in str(e.value) and "24" in str(e.value)


def test_unknown_key_and_bad_yaml(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {max_lora_rnk: 16}\n")
    with pytest.raises(ConfigError, match="max_lora_rnk"):
        load_config(p)
    p.write_text("fleet: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


@pytest.mark.parametrize(
    "text, says",
    [
        (
            "fleet: {instances: [{name: a, url: 'http://127.0.0.1:1'}, {name: a, url: 'http://127.0.0.1:2'}]}",
            "repeated: a",
        ),
        ("fleet: {instances: [{name: a, url: '127.0.0.1:8000'}]}", "http(s) base URL"),
        ("fleet: {instances: [{name: a, url: 'http://127.0.0.1:99999'}]}", "out of range"),
        ("fleet: {instances: [{name: a, url: 'http://'}]}", "http(s) base URL"),
        ("fleet: {instances: [{name: '', url: 'http://h:1'}]}", "fleet.instances.0.name"),
        ("fleet: {instances: [{name: 'a b/c', url: 'http://h:1'}]}", "fleet.instances.0.name"),
        (
            "fleet: {min_healthy: 3, instances: [{name: a, url: 'http://h:1'}, {name: b, url: 'http://h:2'}]}",
            "min_healthy 3",
        ),
        ("fleet: {lock_timeout_s: -1}", "fleet.lock_timeout_s"),
        # helper-7: an infinite or huge timeout overflowed the clock (traceback); URLs the client cannot use
        ("fleet: {connect_timeout_s: .inf}", "fleet.connect_timeout_s"),
        ("fleet: {timeout_s: 1e300}", "fleet.timeout_s"),
        ("fleet: {load_timeout_s: .nan}", "fleet.load_timeout_s"),
        ("fleet: {instances: [{name: a, url: ' http://127.0.0.1:9'}]}", "white space"),
        ("fleet: {instances: [{name: a, url: 'http://h:1/?x=1'}]}", "no query or fragment"),
        ("fleet: {instances: [{name: a, url: 'http://h:1#top'}]}", "no query or fragment"),
        ("fleet: {instances: [{name: a, url: 'http://h:0'}]}", "port 0"),
        ("fleet: {instances: [{name: a, url: 'http://user:s3cret@h:1'}]}", "credentials"),
        ("fleet: {instances: [{name: a, url: 'http://h:1'}, {name: b, url: 'http://h:1/'}]}", "one URL"),
        ("canary: {timeout_s: -1}", "canary.timeout_s"),
        ("train: {peak_tflops: -5}", "train.peak_tflops"),
        ("registry: {connect_timeout_s: .inf}", "registry.connect_timeout_s"),
        ("canary: {staging_url: 'http://user:pw@h:1'}", "credentials"),
    ],
)
def test_bad_values_name_file_and_field(tmp_path, text, says):
    """New-user and break-pass findings: instance URLs, duplicate names, min_healthy, NaN/inf and
    out-of-range values were taken as written (an infinite timeout overflowed the clock)."""
    p = tmp_path / "pipeline.yaml"
    p.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and says in str(e.value)
    assert "s3cret" not in str(e.value) and "pw@" not in str(e.value)  # credentials never echoed


def test_instance_url_trailing_slash_dropped(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {min_healthy: 1, instances: [{name: a, url: 'http://10.0.0.5:8000/'}]}\n")
    assert load_config(p).fleet.instances[0].url == "http://10.0.0.5:8000"


def test_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_project_is_found_walking_up(tmp_path, monkeypatch):
    """Issue 17 item 6: like git, the nearest pipeline.yaml (or .state/mlflow.db) up the tree is the project."""
    from pipeline.config import find_project, load_config

    monkeypatch.delenv("PIPELINE_CONFIG", raising=False)
    (tmp_path / ".git").mkdir()  # the walk stops at a repository's root
    proj = tmp_path / "proj"
    (proj / "sub" / "deeper").mkdir(parents=True)
    (proj / "pipeline.yaml").write_text("volume: {path: vol}\n")
    monkeypatch.chdir(proj / "sub" / "deeper")
    cfg = load_config()
    assert cfg.found and cfg.source == proj / "pipeline.yaml" and cfg.volume.path == proj / "vol"
    assert cfg.tracking_uri == f"sqlite:///{proj / '.state' / 'mlflow.db'}" and not cfg.store_exists()
    # no pipeline.yaml: the embedded store marks the root
    (proj / "pipeline.yaml").unlink()
    (proj / ".state").mkdir()
    (proj / ".state" / "mlflow.db").write_bytes(b"")
    assert find_project() == (None, proj)
    cfg = load_config()
    assert cfg.found and cfg.root == proj and cfg.store_exists()
    # nothing up to the repository root: not found, the working directory stands in
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert not cfg.found and cfg.root == tmp_path and find_project() == (None, None)


def test_an_environment_override_is_named_in_the_error(tmp_path, monkeypatch):
    """helper-7: PIPELINE_FLEET__TIMEOUT_S=abc was reported against pipeline.yaml alone."""
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {max_lora_rank: 32}\n")
    monkeypatch.setenv("PIPELINE_FLEET__TIMEOUT_S", "abc")
    with pytest.raises(ConfigError, match=r"fleet\.timeout_s \(from \$PIPELINE_FLEET__TIMEOUT_S\)"):
        load_config(p)


@pytest.mark.parametrize("key", ["quantized", "quantised"])
def test_canary_quantized_reads_both_spellings(tmp_path, monkeypatch, key):
    """`canary.quantized` (one spelling, as vLLM's `quantization`); files written with `quantised` still load."""
    p = tmp_path / "pipeline.yaml"
    p.write_text(f"canary: {{{key}: true}}\n")
    assert load_config(p).canary.quantized is True
    monkeypatch.setenv(f"PIPELINE_CANARY__{key.upper()}", "false")
    assert load_config(p).canary.quantized is False


@pytest.mark.parametrize(
    "var,value,says",
    [
        # issue 30: a malformed JSON override crashed every command with a traceback
        ("PIPELINE_FLEET", "{", r"\$PIPELINE_FLEET: not valid JSON"),
        # siblings: a list field, a lower-case name (read too), a section that is no object
        ("PIPELINE_FLEET__INSTANCES", "[{", r"\$PIPELINE_FLEET__INSTANCES: not valid JSON"),
        ("pipeline_registry", "{x", r"\$pipeline_registry: not valid JSON"),
        ("PIPELINE_FLEET", "[]", r"fleet \(from \$PIPELINE_FLEET\): Input should be a valid dictionary"),
        ("PIPELINE_STATE_DIR", "", r"state_dir \(from \$PIPELINE_STATE_DIR\): .*is empty"),
        ("PIPELINE_VOLUME_PATH", "/x", r"\$PIPELINE_VOLUME_PATH is not read: .*PIPELINE_VOLUME__PATH"),
        ("MLFLOW_TRACKING_URI", "http://[::1", r"\$MLFLOW_TRACKING_URI: 'http://\[::1' is not a URI"),
        ("MLFLOW_TRACKING_URI", "postgresql://u:pw@h:nan/db", r"'postgresql://\*\*\*@h:nan/db' is not a URI"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "abc", r"\$MLFLOW_HTTP_REQUEST_TIMEOUT='abc': .*whole number"),
    ],
)
def test_every_environment_setting_gets_a_clear_error_naming_it(tmp_path, monkeypatch, var, value, says):
    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: {max_lora_rank: 32}\n")
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=says):
        load_config(p)


def test_environment_errors_reach_the_cli_without_a_traceback(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["config", "show"], env={"PIPELINE_FLEET": "{"})
    assert r.exit_code == 2 and "Traceback" not in r.output and "$PIPELINE_FLEET" in r.output


def test_a_section_from_the_environment_is_bounded_json(monkeypatch, tmp_path):
    """Sibling of issue 30 kinds 2 and 3: pydantic-settings parses `PIPELINE_FLEET='[[[…'` with an
    unbounded json.loads (a RecursionError traceback from every command), and a 5000-digit number in it
    gave Python's advice to call sys.set_int_max_str_digits(). A variable below a field
    (`PIPELINE_FLEET__INSTANCES__0__URL`, which pydantic-settings does not read as a list index) is
    named in the error of the field it broke."""
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    cfg_file = tmp_path / "pipeline.yaml"
    cfg_file.write_text(f"state_dir: {tmp_path / 'state'}\n")
    for var, value, says in [
        ("PIPELINE_FLEET", "[" * 100_000, r"\$PIPELINE_FLEET: nested 100000 levels deep"),
        ("PIPELINE_FLEET__INSTANCES", "[" * 100_000, r"\$PIPELINE_FLEET__INSTANCES: nested 100000"),
        ("PIPELINE_FLEET", '{"max_lora_rank": ' + "9" * 5000 + "}", r"\$PIPELINE_FLEET: a number of more"),
        ("PIPELINE_FLEET__INSTANCES__0__URL", "http://h:1", r"fleet.instances \(from \$PIPELINE_FLEET__INST"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(ConfigError, match=says):
                load_config(cfg_file)
    monkeypatch.setenv("PIPELINE_FLEET", '{"max_lora_rank": 32}')
    assert load_config(cfg_file).fleet.max_lora_rank == 32


def test_a_typo_in_pipeline_yaml_gets_its_line_and_the_key_meant(tmp_path):
    """Issue 41.8: `fleet: {max_lora_rnak: 16}` said "fleet.max_lora_rnak: Extra inputs are not permitted",
    with no line and no suggestion. Siblings: a typo inside a list item, a section name, a bad value's line,
    and a value from the environment still named by its variable."""
    p = tmp_path / "pipeline.yaml"
    p.write_text(
        "state_dir: .state\n"
        "fleet:\n"
        "  max_lora_rnak: 16\n"
        "  instances:\n"
        "    - name: b\n"
        "      url: 'http://h:2'\n"
        "      api_key_enf: X\n"
        "registy: {experiment: x}\n"
        "run: {eval_loss_margin: abc}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{p}: invalid config:"
    assert "  fleet.max_lora_rnak (line 3): unknown key; did you mean 'max_lora_rank'?" in lines
    assert "  fleet.instances.0.api_key_enf (line 7): unknown key; did you mean 'api_key_env'?" in lines
    assert "  registy (line 8): unknown key; did you mean 'registry'?" in lines
    assert any(ln.startswith("  run.eval_loss_margin (line 9): ") for ln in lines), lines
    p.write_text("fleet: {zzz: 1}\n")
    with pytest.raises(ConfigError, match=r"fleet.zzz \(line 1\): unknown key \(known here: .*max_lora_rank"):
        load_config(p)


def test_the_explanation_reads_marks_without_expanding_aliases():
    from pipeline.config_errors import key_lines

    text = "a: &x [1, [2, 3]]\nb: *x\nc:\n  d: 1\n"
    lines = key_lines(text)
    assert (lines[("a",)], lines[("b",)], lines[("c",)], lines[("c", "d")]) == (1, 2, 3, 4)
    assert len(lines) == 4 + 4  # the aliased list's 4 nodes walked once, under one of its two names
    assert key_lines("a: [unclosed\n") == {}
