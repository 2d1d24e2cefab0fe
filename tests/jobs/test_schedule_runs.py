"""The emitted schedules' command lines run, as emitted, from the README's first-day layout (issue 41).

Each test parses the command line out of the emitted file (systemd: `ExecStart=`, `Environment=`,
`WorkingDirectory=`; Slurm: the scrontab line and `--chdir`; Kubernetes: the container's `command`,
`env` and `workingDir`, in a directory laid out like the pod) and starts it with that environment
and nothing of this process's but PATH, HOME, PYTHONPATH (this checkout's code) and
AXOLOTL_DO_NOT_TRACK. The session's one training (`trained`) is put where the job trains these
inputs, so the run validates, registers and publishes it (`reusing finished training`) instead of
training again; the next run skips the unchanged inputs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import chdir
from pathlib import Path

import pytest
import yaml

from pipeline.artifacts.fingerprint import training_inputs
from pipeline.train.config import load_training_config
from pipeline.train.dataset import files_fingerprint
from tests.jobs.test_schedule_checks import first_day, unit
from tests.support.helpers import REPO

pytestmark = pytest.mark.slow


def harness_env(job_env: dict[str, str]) -> dict[str, str]:
    """The job's own environment plus what this test needs to run this checkout's code offline."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO),
        "AXOLOTL_DO_NOT_TRACK": "1",
        **job_env,
    }


def place_training(trained, runs_dir: Path, config: Path, cwd: Path) -> None:
    """Put the session's training where `pipeline run` trains `config`'s inputs (read from `cwd`)."""
    with chdir(cwd):
        tc = load_training_config(config)
        quick = files_fingerprint(tc.dataset_paths("datasets"), tc.dataset_paths("test_datasets"))
        fp = training_inputs(quick, tc.data)["fingerprint"]
    shutil.copytree(trained[1].adapter_dir, runs_dir / f"my-task-{fp[:12]}" / "adapter")


def outcome(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def emit(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "schedule",
            "emit",
            "--name",
            "my-task",
            "--config",
            "my-task.yml",
            *args,
        ],
        cwd=cwd,
        env=harness_env({}),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_the_emitted_systemd_unit_and_scrontab_line_run(tmp_path, tiny_base, trained):
    day = first_day(tmp_path / "proj", tiny_base)
    emit(day, "--kind", "systemd", "--workdir", str(day), "--out", "schedule")  # the README's line
    service = unit((day / "schedule" / "lora-retrain-my-task.service").read_text())
    env = dict(kv.split("=", 1) for kv in shlex.split(service["Environment"]))
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute() and argv[1:] == ["run", "my-task.yml", "--name", "my-task"]
    place_training(trained, day / "adapters" / "runs", Path("my-task.yml"), day)
    r = subprocess.run(
        argv,
        cwd=service["WorkingDirectory"],
        env=harness_env(env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = outcome(r)
    assert out["status"] == "published" and out["version"] == 1, out
    assert (day / "adapters" / "volume" / "my-task-v1" / "manifest.json").is_file()

    emit(day, "--kind", "scrontab", "--out", "schedule")
    text = (day / "schedule" / "lora-retrain-my-task.scrontab").read_text()
    chdir_to = re.search(r"^#SCRON --chdir=(.+)$", text, re.M).group(1)
    log = re.search(r"^#SCRON --output=(.+)$", text, re.M).group(1)
    line = text.strip().splitlines()[-1]
    command = line.split(None, 5)[5]  # after the five schedule fields; Slurm runs it with /bin/sh
    assert Path(log).parent.is_dir()
    r = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=chdir_to,
        env=harness_env({}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = outcome(r)
    assert out["status"] == "skipped" and out["version"] == 1, out


MOUNT = re.compile(r"(/data/datasets|/data/adapters|/data/state|/etc/lora-pipeline)\b")


def test_the_emitted_cronjob_runs_in_a_pod_layout(tmp_path, tiny_base, trained):
    """The container's command, env and workingDir, in a directory laid out like the pod: the ConfigMap's
    files at the config mount, the header's copies on the datasets claim, empty state and adapter claims.
    The pod's absolute mount paths are moved under `pod/` (the test cannot mount at /data)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    day = first_day(tmp_path / "proj", tiny_base)
    text = emit(day, "--kind", "cronjob", "--image", "registry.internal/lora-pipeline:1").stdout
    text = text.split("\n", 1)[1]
    cm, cj = yaml.safe_load_all(text)
    for d in (cm, cj):
        kv.validate(d, "1.31.0", strict=True)
    pod = tmp_path / "pod"

    def here(s: str) -> str:
        return MOUNT.sub(lambda m: f"{pod}{m.group(1)}", s)

    conf = Path(here("/etc/lora-pipeline"))
    conf.mkdir(parents=True)
    for key, value in cm["data"].items():
        (conf / key).write_text(here(value))
    for m in re.finditer(r"^#\s+(/data/datasets/\S+)  <- (\S+)$", text, re.M):  # the header's copies
        dst, src = Path(here(m.group(1))), Path(m.group(2))
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    for d in ("/data/state", "/data/adapters"):
        Path(here(d)).mkdir(parents=True)
    conf.chmod(0o555)  # mounted read-only
    c = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: here(e["value"]) for e in c["env"]}
    argv = [here(a) for a in c["command"]]
    workdir = Path(here(c["workingDir"]))
    place_training(trained, Path(env["PIPELINE_TRAIN__RUNS_DIR"]), Path(argv[2]), workdir)
    r = subprocess.run(argv, cwd=workdir, env=harness_env(env), capture_output=True, text=True, timeout=900)
    out = outcome(r)
    assert out["status"] == "published" and out["version"] == 1, out
    assert (pod / "data" / "adapters" / "my-task-v1" / "manifest.json").is_file()
    assert not any(p.name == "prepared" for p in conf.rglob("*"))
