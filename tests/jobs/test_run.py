"""`pipeline run` as a scheduler calls it: skip unchanged inputs, lock, resume after SIGKILL, gate.

Real axolotl training on the tiny base (a few steps each), real sqlite MLflow. The first run
publishes the session's one training (`trained`, reused as a run killed after training leaves
it: `reusing finished training`); the second test trains through `pipeline run` itself (killed
mid-training, resumed, gated), so each path runs once and the suite pays for two trainings here,
not three (issue 26 item 6).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pipeline import registry
from pipeline.artifacts.fingerprint import training_inputs
from pipeline.config import load_config
from pipeline.train.config import load_training_config
from pipeline.train.launch import check_inputs
from tests.support.helpers import REPO, write_project_config

pytestmark = pytest.mark.slow
TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


@pytest.fixture(scope="module")
def proj(tmp_path_factory, tiny_base):
    root = tmp_path_factory.mktemp("run")
    data = root / "data"
    data.mkdir()
    for f in ("agent_chat_train.jsonl", "agent_chat_validation.jsonl"):
        shutil.copy(REPO / "datasets" / f, data / f)
    cfg_path = write_project_config(root)
    sets = [
        f"base_model={tiny_base}",
        f"dataset_prepared_path={root / 'prepared'}",
        "max_steps=6",
        "eval_steps=6",
        "save_steps=2",
        f"datasets=[{{path: {data / 'agent_chat_train.jsonl'}, ds_type: json, type: chat_template, "
        "field_messages: messages, roles_to_train: [assistant]}]",
        f"test_datasets=[{{path: {data / 'agent_chat_validation.jsonl'}, ds_type: json, split: train, "
        "type: chat_template, field_messages: messages, roles_to_train: [assistant]}]",
    ]
    return {"root": root, "cfg_path": cfg_path, "sets": sets, "data": data}


def cli_run(proj, *extra, wait=True, env_extra=None):
    args = [sys.executable, "-m", "pipeline", "run", str(TINY), "--name", "agent-tools"]
    for s in proj["sets"]:
        args += ["--set", s]
    env = dict(os.environ, PIPELINE_CONFIG=str(proj["cfg_path"]), **(env_extra or {}))
    if not wait:
        return subprocess.Popen(
            [*args, *extra],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    return subprocess.run([*args, *extra], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def n_runs(cfg) -> int:
    from mlflow import MlflowClient

    c = MlflowClient(cfg.tracking_uri)
    exp = c.get_experiment_by_name(cfg.registry.experiment)
    return len(c.search_runs([exp.experiment_id])) if exp else 0


def test_first_run_publishes_then_unchanged_inputs_skip(proj, trained):
    cfg = load_config(proj["cfg_path"])
    tc = load_training_config(TINY, proj["sets"], [])
    fp = training_inputs(check_inputs(cfg, tc, set()).fingerprint, tc.data)["fingerprint"]
    # where `pipeline run` trains these inputs: a finished training there is published, not redone
    shutil.copytree(trained[1].adapter_dir, cfg.train.runs_dir / f"agent-tools-{fp[:12]}" / "adapter")
    r = cli_run(proj)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reusing finished training" in r.stderr
    out = last_json(r.stdout)
    assert (
        out["status"] == "published" and out["version"] == 1 and out["published"].endswith("agent-tools-v1")
    )
    assert {"check", "train", "validate", "register", "publish", "total"} <= set(out["seconds"])
    runs = n_runs(cfg)

    r = cli_run(proj)
    assert r.returncode == 0, r.stderr[-3000:]
    out = last_json(r.stdout)
    assert out["status"] == "skipped" and out["version"] == 1
    assert n_runs(cfg) == runs  # no new MLflow run
    assert [int(v.version) for v in registry.versions(cfg, "agent-tools")] == [1]


def test_concurrent_run_locked_then_sigkill_resumes_and_gate_holds(proj):
    cfg = load_config(proj["cfg_path"])
    if not (cfg.volume.path / "agent-tools-v1").exists():  # run alone: needs a production version
        assert cli_run(proj).returncode == 0
    with open(proj["data"] / "agent_chat_train.jsonl", "a") as f:  # new data: a new fingerprint
        f.write(
            json.dumps(
                {"messages": [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]}
            )
            + "\n"
        )
    runs_before = n_runs(cfg)
    old_dirs = set(cfg.train.runs_dir.iterdir())
    longer = ("--set", "max_steps=12", "--set", "eval_steps=12")  # so the killed run cannot finish first
    a = cli_run(proj, *longer, wait=False)
    try:
        # wait until the new run is training and has a checkpoint to resume from
        deadline = time.time() + 600
        ckpt = None
        while time.time() < deadline and ckpt is None:
            new = [d for d in cfg.train.runs_dir.iterdir() if d not in old_dirs]
            ckpt = next((c for d in new for c in d.glob("output/checkpoint-*/trainer_state.json")), None)
            assert a.poll() is None, a.communicate()[1][-3000:]
            time.sleep(1)
        assert ckpt is not None, "no checkpoint written"

        b = cli_run(proj)  # a second concurrent run: exits at once, locked
        assert b.returncode == 3, b.stderr[-2000:]
        assert last_json(b.stdout)["status"] == "locked" and "holds" in b.stderr
    finally:
        os.killpg(a.pid, signal.SIGKILL)  # the whole job dies, as when a pod is evicted
        a.wait()
    time.sleep(1)

    # production's eval loss made unbeatable: the resumed candidate must be gated, not shipped
    registry.set_version_tags(cfg, "agent-tools", 1, {"eval_loss": "0.001"})
    r = cli_run(proj, *longer)
    assert r.returncode == 5, r.stderr[-3000:]
    out = last_json(r.stdout)
    assert out["status"] == "gated" and "eval_loss" in out["reason"] and out["version"] == 2
    assert "resuming from" in r.stderr
    assert [int(v.version) for v in registry.versions(cfg, "agent-tools")] == [2, 1]  # one new version
    assert registry.aliases(cfg, "agent-tools") == {"candidate": 2, "production": 1}
    assert not (cfg.volume.path / "agent-tools-v2").exists()
    # the resumed run continued the same training directory and MLflow run
    assert len(list(cfg.train.runs_dir.glob("agent-tools-*"))) == 2
    assert n_runs(cfg) == runs_before + 1
    # the gate's verdict and reason are on the version and in `status` (issue 17 item 4)
    env = dict(os.environ, PIPELINE_CONFIG=str(proj["cfg_path"]))
    st = subprocess.run(
        [sys.executable, "-m", "pipeline", "status", "agent-tools", "--json"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert st.returncode == 0, st.stderr
    rows = {v["version"]: v for v in json.loads(st.stdout)["models"][0]["versions"]}
    assert rows[2]["gate"] == {"verdict": "gated", "reason": out["reason"]}
    assert rows[1]["gate"]["verdict"] == "pass" and isinstance(rows[2]["eval_loss"], float)
    st = subprocess.run(
        [sys.executable, "-m", "pipeline", "status", "agent-tools"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert st.returncode == 0 and "gated" in st.stdout


# Without training (tests/jobs/test_run_resume.py): a run killed between register and publish is
# published by the next run; a refusal from publish's own gates is a gated run (exit 5).
