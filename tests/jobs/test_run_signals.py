"""SIGTERM/SIGINT end `pipeline run` cleanly (issue 27 item 7): what systemd and Kubernetes send at a timeout.

Real signals delivered by the kernel: to a `pipeline run` process from outside, or by the process
to itself at a named point of the publish transaction (`PIPELINE_TEST_KILL_AT` with
`PIPELINE_TEST_KILL_SIGNAL`), or from a timer thread of this process while it trains. No training
runs to the end: a candidate registered from the run's inputs makes `run` go straight to the gates
(as in test_run_resume.py); the training case stops the trainer while it starts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.artifacts.fingerprint import training_inputs
from pipeline.cli import app
from pipeline.jobs.run import FINGERPRINT_TAG, run
from pipeline.train.config import load_training_config
from pipeline.train.launch import check_inputs
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import Killed, crash_at, new_project

release_adapters = release_support.release_adapters
TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


@pytest.fixture
def setup(tmp_path, tiny_base):
    cfg = new_project(tmp_path / "p")
    sets = [
        f"base_model={tiny_base}",
        f"dataset_prepared_path={tmp_path / 'prepared'}",
        f"datasets=[{{path: {REPO / 'datasets/agent_chat_train.jsonl'}, ds_type: json, type: chat_template, "
        "field_messages: messages, roles_to_train: [assistant]}]",
        f"test_datasets=[{{path: {REPO / 'datasets/agent_chat_validation.jsonl'}, ds_type: json, split: train, "
        "type: chat_template, field_messages: messages, roles_to_train: [assistant]}]",
    ]
    tc = load_training_config(TINY, sets, [])
    fp = training_inputs(check_inputs(cfg, tc, set()).fingerprint, tc.data)["fingerprint"]
    return cfg, sets, fp


def run_args(name: str, sets: list[str]) -> list[str]:
    args = ["run", str(TINY), "--name", name]
    for s in sets:
        args += ["--set", s]
    return args


def candidate(cfg, name: str, fp: str, adapters) -> int:
    """A version registered from the run's inputs, never published: `run` gates and publishes it."""
    reg = registry.register_adapter(cfg, adapters[0][0], name, adapters[0][1])
    registry.set_version_tags(cfg, name, reg.version, {FINGERPRINT_TAG: fp})
    return reg.version


def test_sigterm_during_publish_completes_the_transaction_then_reports_killed(setup, release_adapters):
    """A process told to stop in the middle of publishing (after the volume, before the aliases) ends
    the transaction first: no half-shipped version, `production` moved, the last line says `killed`
    and where it got; the next run finds it shipped."""
    cfg, sets, fp = setup
    v = candidate(cfg, "sig", fp, release_adapters)
    env = {
        "PIPELINE_CONFIG": str(cfg.source),
        "PIPELINE_TEST_KILL_AT": "after-volume",
        "PIPELINE_TEST_KILL_SIGNAL": "SIGTERM",
    }
    r = CliRunner().invoke(app, run_args("sig", sets), env=env)
    assert r.exit_code == 128 + signal.SIGTERM, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == "killed" and out["exit_code"] == 143 and out["stage"] == "publish"
    assert out["version"] == v and out["published"].endswith(f"sig-v{v}")
    assert out["reason"].startswith("stopped by SIGTERM during publish")
    assert "SIGTERM received: finishing the step in progress first" in r.stderr
    assert "error: stopped by SIGTERM" in r.stderr
    assert registry.alias_version(cfg, "sig", "production") == v  # the transaction completed
    assert not (cfg.volume.path / ".txn" / "sig.json").exists()
    assert registry.resolve_version(cfg, "sig", version=v).tags["gate.verdict"] == "pass"


def test_sigterm_during_promote_completes_it_then_exits_143(setup, release_adapters):
    """Sibling: `pipeline promote` (any transaction) stopped half-way finishes first, then says it was stopped."""
    cfg, _, _ = setup
    for d, rep in release_adapters[:2]:
        registry.register_adapter(cfg, d, "prom", rep)
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    assert CliRunner().invoke(app, ["promote", "prom", "1"], env=env).exit_code == 0
    env.update(PIPELINE_TEST_KILL_AT="after-state", PIPELINE_TEST_KILL_SIGNAL="SIGINT")
    r = CliRunner().invoke(app, ["promote", "prom", "2", "--json"], env=env)
    assert r.exit_code == 128 + signal.SIGINT, r.output
    assert json.loads(r.stdout) == {"error": "stopped by SIGINT", "type": "Interrupted", "exit_code": 130}
    assert registry.aliases(cfg, "prom") == {"candidate": 2, "production": 2, "previous": 1}
    assert not (cfg.volume.path / ".txn" / "prom.json").exists()


def test_a_publish_killed_outright_is_completed_and_reported_by_the_next_run(setup, release_adapters):
    """Sibling: after SIGKILL (no clean-up possible; here the process 'dies' at the checkpoint, leaving
    what SIGKILL leaves), the next `pipeline run` completes the publish and says so in its last line
    (`notes`) and on stderr; it used to drop publish's recovery notes."""
    cfg, sets, fp = setup
    v = candidate(cfg, "sigk", fp, release_adapters)
    with crash_at("after-aliases"), pytest.raises(Killed):
        run(cfg, TINY, name="sigk", overrides=sets)
    assert (cfg.volume.path / ".txn" / "sigk.json").exists()
    r = CliRunner().invoke(app, run_args("sigk", sets), env={"PIPELINE_CONFIG": str(cfg.source)})
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["status"] == "published" and out["version"] == v
    assert any(n.startswith(f"completed an interrupted publish of sigk v{v}") for n in out["notes"]), out
    assert "completed an interrupted publish" in r.stderr


def _trainers(run_dir: Path) -> list[int]:
    """Processes whose command line names the run directory (the guard, axolotl, its workers)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                if str(run_dir).encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


@pytest.mark.slow  # starts the axolotl trainer (stopped while it loads, long before a step)
def test_sigterm_during_training_stops_the_trainer_and_marks_the_run_killed(setup):
    cfg, sets, fp = setup
    run_dir = cfg.train.runs_dir / f"train-{fp[:12]}"
    sent = threading.Event()

    def stop_when_the_trainer_runs():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not _trainers(run_dir):
            time.sleep(0.2)
        time.sleep(1.0)
        sent.set()
        os.kill(os.getpid(), signal.SIGTERM)  # as systemd does at TimeoutStartSec

    threading.Thread(target=stop_when_the_trainer_runs, daemon=True).start()
    r = CliRunner().invoke(app, run_args("train", sets), env={"PIPELINE_CONFIG": str(cfg.source)})
    assert sent.is_set(), r.output
    assert r.exit_code == 143, r.output
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["status"] == "killed" and out["stage"] == "train" and out["version"] is None
    assert _trainers(run_dir) == []  # the trainer's whole process group is gone
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    assert registry.client(cfg).get_run(run_id).info.status == "KILLED"
    assert "the next run resumes" in r.stderr
