"""Issue 41.5: a preview before every change. `--dry-run` prints the plan (JSON with `--json`), changes
nothing and exits 0; `fleet prune` asks on a terminal unless `--yes`, and never in a non-interactive run."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.release.publish import publish
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import new_project, register_versions, snapshot

release_adapters = release_support.release_adapters


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, release_adapters):
    """agent v1..v4 registered, v1, v2, v3 published in that order (v3 production, v2 previous); v4 candidate."""
    cfg = new_project(tmp_path_factory.mktemp("dry-run"))
    register_versions(cfg, "agent", release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, "agent", version=v)
    from pipeline import registry

    # v4: the same weights as v1, registered on purpose (the library call takes no duplicate check)
    registry.register_adapter(cfg, release_adapters[0][0], "agent", release_adapters[0][1])
    return cfg


def cli(cfg, *args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


def dirs(cfg) -> list[str]:
    return sorted(p.name for p in cfg.volume.path.iterdir() if p.name.startswith("agent-v"))


def test_prune_dry_run_lists_what_it_would_delete_and_deletes_nothing(cfg):
    """The failing input: `fleet prune agent --keep 1` deleted v1 and v2 with no preview."""
    before = dirs(cfg)
    r = cli(cfg, "fleet", "prune", "agent", "--keep", "1", "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        f"would remove {cfg.volume.path}/agent-v2",
        f"would remove {cfg.volume.path}/agent-v1",
        "(dry run: nothing changed)",
    ]
    plan = json.loads(cli(cfg, "fleet", "prune", "agent", "--keep", "1", "--dry-run", "--json").stdout)
    assert plan["dry_run"] is True and plan["versions"] == [2, 1]
    assert dirs(cfg) == before == ["agent-v1", "agent-v2", "agent-v3"]


def test_publish_promote_rollback_dry_runs_print_the_plan_and_change_nothing(cfg):
    before = (snapshot(cfg, "agent"), dirs(cfg))
    r = cli(cfg, "publish", "agent", "--version", "4", "--dry-run")
    assert r.exit_code == 0, r.output
    assert f"publish agent v4: would write {cfg.volume.path}/agent-v4" in r.stdout
    assert "alias production v3 -> v4, previous v2 -> v3; desired v3 -> v4" in r.stdout
    assert r.stdout.rstrip().endswith("(dry run: nothing changed)")
    plan = json.loads(cli(cfg, "promote", "agent", "4", "--dry-run", "--json").stdout)
    assert (plan["action"], plan["version"], plan["write"]) == ("promote", 4, True)
    assert plan["production"] == {"from": 3, "to": 4} and plan["previous"] == {"from": 2, "to": 3}
    # sibling: a version already on the volume is verified, not rewritten
    plan = json.loads(cli(cfg, "publish", "agent", "--version", "1", "--dry-run", "--json").stdout)
    assert plan["write"] is False and plan["path"] == str(cfg.volume.path / "agent-v1")
    r = cli(cfg, "rollback", "agent", "--dry-run")
    assert r.exit_code == 0, r.output
    assert (
        "would roll back agent: desired version v3 -> v2; alias production v3 -> v2, previous -> v3"
        in r.stdout
    )
    plan = json.loads(cli(cfg, "rollback", "agent", "--to", "1", "--dry-run", "--json").stdout)
    assert (plan["from_version"], plan["to_version"], plan["changes"]) == (3, 1, True)
    assert (snapshot(cfg, "agent"), dirs(cfg)) == before


def test_a_dry_run_refuses_what_the_command_would_refuse(cfg):
    """A plan is not a promise the command breaks: the same errors, with the same exit codes."""
    r = cli(cfg, "publish", "agent", "--version", "9", "--dry-run")
    assert r.exit_code == 2 and "version 9 not found" in r.output
    r = cli(cfg, "rollback", "agent", "--to", "9", "--dry-run")
    assert r.exit_code == 2 and "version 9 not found" in r.output


def test_register_refuses_weights_an_existing_version_holds(cfg, release_adapters):
    """Issue 41.6: the same weights registered twice became two versions, silently."""
    adapter = release_adapters[1][0]  # v2's weights
    r = cli(cfg, "register", adapter, "--name", "agent")
    assert r.exit_code == 2, r.output
    assert (
        "these weights" in r.output
        and "are already version 2 (alias previous); nothing registered" in r.output
    )
    assert "--allow-duplicate" in r.output
    # sibling: the newest of several versions holding them is named (v1 and v4 hold release_adapters[0])
    r = cli(cfg, "register", release_adapters[0][0], "--name", "agent", "--json")
    assert r.exit_code == 2 and "already version 4" in json.loads(r.stdout)["error"]
    # sibling: a dry run says it would be a duplicate and what number it would get, and registers nothing
    r = cli(cfg, "register", adapter, "--name", "agent", "--allow-duplicate", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert (plan["version"], plan["duplicate_of"], plan["verdict"]) == (5, 2, "pass")
    from pipeline import registry

    assert [int(v.version) for v in registry.versions(cfg, "agent")] == [4, 3, 2, 1]
    # another model may hold the same weights: the check is per model
    r = cli(cfg, "register", adapter, "--name", "other", "--dry-run")
    assert r.exit_code == 0 and "would register" in r.stdout and "other version 1" in r.stdout, r.output


def test_fleet_sync_dry_run_without_instances(cfg):
    r = cli(cfg, "fleet", "sync", "--dry-run")
    assert r.exit_code == 0 and "nothing to do" in r.stdout, r.output


def _prune_on_a_terminal(cfg, answer: bytes) -> tuple[int, str]:
    """`pipeline fleet prune agent --keep 2` with its stdin and stderr on a pseudo-terminal; types `answer`."""
    main, sub = pty.openpty()
    env = dict(os.environ, PIPELINE_CONFIG=str(cfg.source), PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "fleet", "prune", "agent", "--keep", "2"],
        stdin=sub,
        stderr=sub,
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    os.close(sub)
    seen, deadline = b"", time.monotonic() + 120
    while b"[y/N]" not in seen and time.monotonic() < deadline and p.poll() is None:
        if select.select([main], [], [], 1)[0]:
            seen += os.read(main, 4096)
    os.write(main, answer)
    out, _ = p.communicate(timeout=120)
    os.close(main)
    return p.returncode, seen.decode() + out.decode()


def test_prune_asks_on_a_terminal_and_not_in_a_pipe(cfg):
    before = dirs(cfg)
    code, text = _prune_on_a_terminal(cfg, b"n\n")
    assert code == 0 and "would remove" in text and "agent-v1" in text, text
    assert "delete 1 version directory of agent? [y/N]" in text and "nothing deleted" in text
    assert dirs(cfg) == before
    # no terminal (CliRunner: stdin is not a tty): it does not ask, and says what it did
    r = cli(cfg, "fleet", "prune", "agent", "--keep", "2")
    assert r.exit_code == 0 and r.stdout.strip() == f"removed {cfg.volume.path}/agent-v1", r.output
    assert dirs(cfg) == ["agent-v2", "agent-v3"]


def test_run_dry_run_says_skip_ship_or_train(cfg, tiny_base, monkeypatch):
    """Sibling: `pipeline run` (the nightly job) had no preview either. Its dry run takes the same
    decision from the files' fingerprint, takes no lock and writes nothing."""
    from pipeline import registry
    from pipeline.artifacts.fingerprint import training_inputs
    from pipeline.train.config import load_training_config
    from pipeline.train.dataset import files_fingerprint

    monkeypatch.chdir(REPO)  # the config's dataset paths are relative to the repo
    config = REPO / "axolotl_configs" / "tiny-cpu.yml"
    args = ["run", config, "--name", "agent", "--set", f"base_model={tiny_base}", "--dry-run", "--json"]
    tc = load_training_config(config, [f"base_model={tiny_base}"])
    quick = files_fingerprint(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets"))
    fp = training_inputs(quick, tc.data)["fingerprint"]
    plan = json.loads(cli(cfg, *args).stdout)
    assert (plan["plan"], plan["version"], plan["production"]) == ("train", 5, 3), plan
    registry.set_version_tags(cfg, "agent", 2, {registry.FINGERPRINT_TAG: fp})  # v2 shipped, rolled past
    try:
        r = cli(cfg, *args[:-1])
        assert r.exit_code == 0, r.output
        assert (
            "agent: would skip: inputs unchanged: v2 was trained from them; v3 is in production" in r.stdout
        )
        assert json.loads(cli(cfg, *args, "--force").stdout)["plan"] == "train"
    finally:
        registry.client(cfg).delete_model_version_tag("agent", "2", registry.FINGERPRINT_TAG)
    assert not (cfg.state_dir / "locks" / "agent.lock").exists() and not cfg.train.runs_dir.exists()
    assert cli(cfg, "run", config, "--json").exit_code == 2  # --json is for the dry run


# -- the siblings: every other command that changes state (issue 41 item 5) ---------------------------------------
# Commands that change nothing (reads, previews, servers), or dev tools that write only the OUT directory they
# are given, need no --dry-run; each other command has one (test_every_state_changing_command_has_a_dry_run).
NO_DRY_RUN = {
    "status": "reads",
    "ui": "serves the MLflow UI; writes nothing",
    "validate": "reads; its report is the output",
    "config show": "reads",
    "fleet status": "reads",
    "fleet resolve": "reads",
    "dataset check": "reads",
    "dev tiny-base": "a dev tool writing only OUT",
    "dev real-base": "a dev tool writing only OUT",
    "dev trained-base": "a dev tool writing only OUT",
    "dev served-base": "a dev tool writing only OUT",
    "dev task-data": "a dev tool writing only OUT",
    "demo": "a dev tool: the whole job on the embedded default project; `pipeline run --dry-run` previews a job",
}


def _leaves() -> dict:
    """Every command path of the CLI -> its click command (modules loaded: the main group lists stand-ins)."""
    import click

    from pipeline.cli import COMMANDS, load_command

    out = {}
    for name, (_, is_group, _) in COMMANDS.items():
        cmd = load_command(name)
        if is_group:
            out |= {f"{name} {sub}": c for sub, c in cmd.commands.items() if not isinstance(c, click.Group)}
        else:
            out[name] = cmd
    return out


def test_every_state_changing_command_has_a_dry_run():
    """The failing input: `merge`, `draft`, `canary`, `merge-parity`, `follow-alias` and `schedule emit --out`
    changed state with no preview. A command added without `--dry-run` (or a reason here) fails this test."""
    leaves = _leaves()
    missing = []
    for path, cmd in leaves.items():
        flags = {o for p in cmd.params for o in getattr(p, "opts", [])}
        if "--dry-run" not in flags and path not in NO_DRY_RUN:
            missing.append(path)
    assert missing == []
    assert {"publish", "fleet prune", "schedule emit", "dev task-data"} <= set(
        leaves
    )  # the walk sees them all


def test_follow_alias_dry_run_names_what_one_pass_would_publish(cfg):
    from pipeline import registry

    before, on_volume = snapshot(cfg, "agent"), dirs(cfg)
    plan = json.loads(cli(cfg, "follow-alias", "--dry-run", "--json").stdout)
    assert plan["models"] == [{"name": "agent", "alias_version": 3, "action": "none"}]
    registry.set_alias(cfg, "agent", "production", 4)  # moved in the UI: v4 is not on the volume
    try:
        r = cli(cfg, "follow-alias", "--dry-run")
        assert r.exit_code == 0 and "agent: production -> v4: would publish" in r.stdout, r.output
        assert r.stdout.rstrip().endswith("(dry run: nothing changed)")
        assert dirs(cfg) == on_volume and "agent-v4" not in on_volume  # nothing published
        r = cli(cfg, "follow-alias", "staging", "--dry-run")
        assert r.exit_code == 0 and "agent: no staging alias, nothing to do" in r.stdout
    finally:
        registry.set_alias(cfg, "agent", "production", 3)
    assert snapshot(cfg, "agent") == before


def test_canary_and_merge_parity_dry_runs_send_nothing(cfg, tiny_base):
    """A staging URL nobody listens on: the plan needs no instance, and records nothing on the version."""
    from pipeline import registry

    r = cli(cfg, "canary", "agent", "--version", "4", "--dry-run")
    assert r.exit_code == 2 and "no staging instance" in r.output  # refused as the real run refuses it
    tags = dict(registry.resolve_version(cfg, "agent", version=4).tags)
    r = cli(cfg, "canary", "agent", "--version", "4", "--staging", "http://127.0.0.1:9", "--base",
            tiny_base, "--dry-run", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert (plan["adapter"], plan["version"], plan["staging"], plan["record"]) == (
        "agent v4", 4, "http://127.0.0.1:9", True)  # fmt: skip
    assert dict(registry.resolve_version(cfg, "agent", version=4).tags) == tags
    r = cli(cfg, "canary", "agent", "--version", "9", "--staging", "http://127.0.0.1:9", "--dry-run")
    assert r.exit_code == 2 and "version 9 not found" in r.output
    # merge-parity: the same refusal of what is not a quantized merge, before any request
    r = cli(
        cfg, "merge-parity", str(cfg.volume.path / "agent-v1"), "--merged", "http://127.0.0.1:9", "--dry-run"
    )
    assert r.exit_code == 2 and "merge" in r.output, r.output


def test_merge_dry_run_checks_and_writes_nothing(cfg, release_adapters, tiny_base, tmp_path):
    adapter = release_adapters[0][0]
    out = tmp_path / "merged"
    r = cli(cfg, "merge", adapter, "--base", tiny_base, "--out", out, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["action"] == "merge" and plan["lora_pairs"] > 0 and 0 < plan["bytes"] < plan["free_bytes"]
    assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    r = cli(cfg, "merge", adapter, "--base", tiny_base, "--out", out, "--dry-run")
    assert r.exit_code == 2 and "exists" in r.output  # the real merge's refusal


def test_schedule_emit_dry_run_writes_no_file(cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(cfg.root)
    (cfg.root / "my-task.yml").write_text((REPO / "axolotl_configs" / "tiny-cpu.yml").read_text())
    out = tmp_path / "sched"
    r = cli(cfg, "schedule", "emit", "--kind", "systemd", "--name", "agent", "--config", "my-task.yml", "--out",
            out, "--no-check", "--dry-run")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"would write {out / 'lora-retrain-agent.service'}" in r.stdout and "[Service]" in r.stdout
    assert not out.exists()


def test_a_dry_run_refuses_every_input_the_real_command_refuses(cfg, release_adapters, tiny_base, tmp_path):
    """helper-2's inputs: each of these dry runs said exit 0 (a plan) where the real command exits 2."""
    import torch

    adapter = release_adapters[0][0]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    m = ["merge", adapter, "--base", tiny_base]
    cases = [
        (["follow-alias", "--webhook-port", "8999"], "HMAC secret"),
        ([*m, "--out", "/proc/m1"], "--out /proc/m1"),
        ([*m, "--out", a_file / "sub"], "in the way"),
        ([*m, "--out", tmp_path / "q", "--quantize", "nvfp4", "--calib-data", tmp_path / "nope.jsonl"], "nope"),
        ([*m, "--out", tmp_path / "t", "--name", "nosuch", "--version", "9"], "nosuch"),
        (["merge-parity", tmp_path, "--merged", "http://127.0.0.1:9", "--name", "agent", "--version", "99"], "99"),
        (["canary", "agent", "--version", "4", "--staging", "http://127.0.0.1:9", "--instance-path", "/x"],
         "--instance-path is for directory adapters"),
        (["canary", "agent", "--version", "4", "--staging", "http://127.0.0.1:9", "--validation", tmp_path],
         "not a file"),
        (["canary", "agent", "--version", "4", "--staging", "http://127.0.0.1:9", "--base", tmp_path / "none"],
         "not a directory"),
        (["draft", "agent", "--version", "1", "--out", "/proc/x"], "--out /proc/x"),
        (["schedule", "emit", "--kind", "systemd", "--name", "agent", "--config", "c.yml", "--out", "/proc/s",
          "--no-check"], "--out /proc/s"),
        (["schedule", "emit", "--kind", "systemd", "--name", "agent", "--config", "c.yml", "--out", a_file,
          "--no-check"], "not a directory"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases += [
            ([*m, "--out", tmp_path / "c", "--device", "cuda"], "no CUDA GPU"),
            (["draft", "agent", "--version", "1", "--device", "cuda"], "no CUDA GPU"),
        ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, says in cases:
        r = cli(cfg, *args, "--dry-run")
        assert r.exit_code == 2 and says in r.output, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # and nothing was written


def test_follow_alias_dry_run_creates_no_store(tmp_path):
    """helper-2: in a project no command had written to yet, the dry run created `state/mlflow.db`."""
    cfg = new_project(tmp_path / "p", store=False)
    listing = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    r = cli(cfg, "follow-alias", "--dry-run", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["models"] == [], r.output
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == listing


def test_canary_dry_run_speaks_json_under_o_json(cfg, tiny_base):
    r = cli(cfg, "canary", "agent", "--version", "4", "--staging", "http://127.0.0.1:9", "--base", tiny_base,
            "--dry-run", "-o", "json")  # fmt: skip
    assert r.exit_code == 0 and json.loads(r.stdout)["dry_run"] is True, r.output
