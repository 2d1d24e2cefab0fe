"""`--json` on every command that changes state; errors as JSON under `--json` (issue 17 item 8)."""

import json
import uuid

import pytest
from typer.testing import CliRunner

from pipeline.cli import COMMANDS, app, load_command
from tests.support import registry_support

registry_project = registry_support.registry_project
two_adapters = registry_support.two_adapters

STATE_CHANGING = ("train", "register", "publish", "promote", "rollback", "merge", "demo", "canary")


@pytest.mark.parametrize("name", STATE_CHANGING + ("validate", "status"))
def test_command_has_json(name):
    assert name in COMMANDS
    opts = {o for p in load_command(name).params for o in getattr(p, "opts", [])}
    assert "--json" in opts, name


def test_version_option():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("lora-pipeline ")


def _json(r):
    return json.loads(r.stdout)


def test_register_publish_promote_rollback_json(registry_project, two_adapters, tiny_base):
    cfg = registry_project
    name = f"json-{uuid.uuid4().hex[:6]}"
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    run = CliRunner().invoke
    r = run(
        app, ["register", str(two_adapters[0]), "--name", name, "--base", str(tiny_base), "--json"], env=env
    )
    assert r.exit_code == 0, r.output
    reg = _json(r)
    assert reg["version"] == 1 and reg["verdict"] == "pass" and reg["failed_checks"] == []
    r = run(
        app, ["register", str(two_adapters[1]), "--name", name, "--base", str(tiny_base), "--json"], env=env
    )
    assert _json(r)["version"] == 2
    r = run(app, ["publish", name, "--version", "1", "--json"], env=env)
    assert r.exit_code == 0, r.output
    pub = _json(r)
    assert pub["version"] == 1 and pub["created"] is True and pub["path"].endswith(f"{name}-v1")
    r = run(app, ["promote", name, "2", "--json"], env=env)
    assert r.exit_code == 0 and _json(r)["previous_production"] == 1
    r = run(app, ["rollback", name, "--json"], env=env)
    assert r.exit_code == 0, r.output
    assert _json(r)["to_version"] == 1 and _json(r)["from_version"] == 2
    # errors are JSON too, with the documented exit code
    r = run(app, ["publish", name, "--version", "9", "--json"], env=env)
    err = _json(r)
    assert r.exit_code == 2 and err["exit_code"] == 2 and "version 9 not found" in err["error"]
    r = run(app, ["status", "no-such-model", "--json"], env=env)
    assert r.exit_code == 2 and "not found" in _json(r)["error"]
    r = run(app, ["register", "/nonexistent", "--name", name, "--json"], env=env)
    assert r.exit_code == 2 and _json(r)["exit_code"] == 2


@pytest.mark.parametrize(
    "args, says",
    [
        (["publish", "x", "--version", "abc", "--json"], "not a valid integer"),  # click's parse error
        (["status", "--bogus", "--json"], "No such option"),
        (["rollback", "--json"], "Missing argument"),
        (["register", ".", "--name", "../escape", "--json"], "adapter name"),  # callback before --json
        (["train", "x.yml", "--gpus", "0", "--json"], "range"),
        (["validate", ".", "--served", "/nonexistent", "--json"], "served checkpoint directory not found"),
    ],
)
def test_parse_errors_are_json_too(args, says, tmp_path, monkeypatch):
    """Sibling: errors click raises before `--json` itself is read are JSON under `--json` as well."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2
    err = json.loads(r.stdout)
    assert says in err["error"] and err["exit_code"] == 2
