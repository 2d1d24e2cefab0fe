"""One name check at every door: no adapter takes a name the fleet serves the base model under (issue 40 kind 2).

With `served.served_model_name: qwen-base`, `publish` and `run` refused the adapter name `qwen-base`, but
`register`, `train --name` (54 s of training first) and `schedule emit --name` accepted it; the unit
`schedule emit` wrote exited 2 on every run. Siblings: a name equal but for case, a name whose version N
is served as the base's name (`qwen` with the base served as `qwen-v3`), `served.model` without a served
name, the served name from the environment, the adapter name from the config file's stem, and the
pipeline.yaml the emitted job will read.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.artifacts.names import check_name, served_collision
from pipeline.cli import app
from pipeline.errors import UsageError
from tests.support.helpers import REPO, write_project_config

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"
SERVED = {"model": "org/qwen-base-27b", "served_model_name": "qwen-base"}


def _project(tmp_path: Path, served=SERVED) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_project_config(tmp_path, served=served)


def _cli(cfg: Path, *args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg), **(env or {})})


def _nothing_written(root: Path) -> None:
    for d in ("state", "volume", "runs"):
        assert not (root / d).exists(), f"{d} was created before the name was refused"


@pytest.mark.parametrize(
    "name,served,why",
    [
        ("qwen-base", ["qwen-base"], "is the name the fleet serves"),
        ("qwen-base", ["Qwen-Base"], "differs only in case"),
        ("qwen", ["qwen-v3"], "would serve its version 3 as 'qwen-v3'"),
        ("qwen", ["QWEN-V12"], "would serve its version 12"),
    ],
)
def test_collisions_with_the_served_base(name, served, why):
    assert why in served_collision(name, served)
    with pytest.raises(UsageError, match="choose another adapter name"):
        check_name(name, served=served)


@pytest.mark.parametrize("name", ["qwen-base-2", "qwen-bas", "qwen-v", "qwen3"])
def test_names_near_the_served_base_are_fine(name):
    assert served_collision(name, ["qwen-base", "qwen-v3", "org/qwen-base"]) is None


DOORS = [
    ["register", str(TINY.parent), "--name", "qwen-base"],
    ["train", TINY, "--name", "qwen-base"],
    ["run", TINY, "--name", "qwen-base"],
    ["schedule", "emit", "--kind", "systemd", "--name", "qwen-base", "--config", "c.yml"],
    ["schedule", "emit", "--kind", "cronjob", "--name", "qwen-base", "--config", "c.yml", "--image", "i"],
    ["publish", "qwen-base", "--version", "1"],
    ["promote", "qwen-base", "1"],
    ["rollback", "qwen-base"],
    ["canary", "qwen-base", "--staging", "http://127.0.0.1:9"],
    ["follow-alias", "--once", "--name", "qwen-base"],
    [
        "merge",
        str(TINY.parent),
        "--base",
        str(TINY.parent),
        "--out",
        "m",
        "--name",
        "qwen-base",
        "--version",
        "1",
    ],
    [
        "merge-parity",
        str(TINY.parent),
        "--merged",
        "http://127.0.0.1:9",
        "--name",
        "qwen-base",
        "--version",
        "1",
    ],
    ["demo", "--name", "qwen-base"],
]


@pytest.mark.parametrize("args", DOORS, ids=lambda a: " ".join(map(str, a[:2])))
def test_every_door_refuses_the_served_base_name_first(tmp_path, args):
    cfg = _project(tmp_path / "p")
    r = _cli(cfg, *args)
    assert r.exit_code == 2, r.output
    assert "'qwen-base'" in r.output and "served.served_model_name" in r.output, r.output
    assert "Traceback" not in r.output
    _nothing_written(tmp_path / "p")


@pytest.mark.parametrize(
    "served,name",
    [
        ({"model": "qwen-base"}, "qwen-base"),  # no served name: vLLM serves the model string
        ({"model": "org/base", "served_model_name": "qwen-v3"}, "qwen"),  # qwen's v3 would be the base
    ],
)
def test_siblings_of_the_served_name(tmp_path, served, name):
    cfg = _project(tmp_path / "p", served=served)
    for args in (["register", str(TINY.parent), "--name", name], ["train", TINY, "--name", name]):
        r = _cli(cfg, *args)
        assert r.exit_code == 2 and "choose another adapter name" in r.output, r.output
    _nothing_written(tmp_path / "p")


def test_the_served_name_from_the_environment(tmp_path):
    cfg = _project(tmp_path / "p", served={"model": "org/base"})
    r = _cli(
        cfg,
        "register",
        TINY.parent,
        "--name",
        "qwen-base",
        env={"PIPELINE_SERVED__SERVED_MODEL_NAME": "qwen-base"},
    )
    assert r.exit_code == 2 and "PIPELINE_SERVED__SERVED_MODEL_NAME" in r.output, r.output


@pytest.mark.parametrize("command", ["train", "run"])
def test_a_name_from_the_config_files_stem(tmp_path, command):
    """No --name: the adapter is named after the config file, `qwen-base.yml` -> `qwen-base`."""
    cfg = _project(tmp_path / "p")
    stem = tmp_path / "qwen-base.yml"
    stem.write_text(TINY.read_text())
    r = _cli(cfg, command, stem)
    assert r.exit_code == 2 and "'qwen-base'" in r.output and "config file name" in r.output, r.output
    _nothing_written(tmp_path / "p")


@pytest.mark.parametrize("kind", ["systemd", "cronjob"])
def test_schedule_emit_reads_the_jobs_own_pipeline_yaml(tmp_path, kind):
    """The job runs with another pipeline.yaml (`--workdir`'s, `--pipeline-yaml`) than this project's:
    a name its fleet serves the base under gave a unit whose every run exits 2."""
    here = _project(tmp_path / "here", served={"model": "org/base"})
    job = tmp_path / "job"
    job_yaml = _project(job)
    extra = ["--workdir", job] if kind == "systemd" else ["--pipeline-yaml", job_yaml, "--image", "i"]
    out = tmp_path / "out"
    r = _cli(
        here,
        "schedule",
        "emit",
        "--kind",
        kind,
        "--name",
        "qwen-base",
        "--config",
        "c.yml",
        "--out",
        out,
        *extra,
    )
    assert r.exit_code == 2 and str(job_yaml) in r.output and "'qwen-base'" in r.output, r.output
    assert not out.exists()
    r = _cli(
        here, "schedule", "emit", "--kind", kind, "--name", "agent", "--config", "c.yml", "--out", out, *extra,
        *(["--no-check"] if kind == "systemd" else []),
    )  # fmt: skip
    if kind == "systemd":  # the job's own checks skipped: c.yml is no real config here
        assert r.exit_code == 0, r.output
    else:  # the name passes; the CronJob then refuses the missing c.yml (its inputs), not the name
        assert r.exit_code == 2 and "could not find its inputs" in r.output and "served" not in r.output, (
            r.output
        )


def test_status_of_the_served_name_reads(tmp_path):
    """A read may say not found; it must not crash, and it must not refuse a name registered before the rule."""
    cfg = _project(tmp_path / "p")
    r = _cli(cfg, "status", "qwen-base")
    assert r.exit_code in (0, 2) and "Traceback" not in r.output, r.output


@pytest.mark.parametrize(
    "args",
    [
        ["train", TINY, "--name", "qwen-base"],
        ["schedule", "emit", "--kind", "systemd", "--name", "qwen-base", "--config", "c.yml", "--out", "out"],
    ],
    ids=["train", "schedule emit"],
)
def test_the_refusal_is_fast(tmp_path, args):
    """The issue's inputs as the console runs them: exit 2 in under a second of CPU, before any work
    (`train` trained for 54 s first). CPU time, not wall time: the test machine is shared."""
    cfg = _project(tmp_path / "p")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=tmp_path,
        env={**os.environ, "PIPELINE_CONFIG": str(cfg), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 2, r.stderr
    assert "'qwen-base'" in r.stderr and "served.served_model_name" in r.stderr
    assert cpu < 1.0, f"{cpu:.2f} s of CPU before the refusal"
    assert not (tmp_path / "out").exists()
    _nothing_written(tmp_path / "p")
