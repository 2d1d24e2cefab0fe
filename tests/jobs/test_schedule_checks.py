"""`schedule emit` makes the checks the job will make, from the README's first-day layout (issue 41).

Kind 1 (a schedule that fails every night): the systemd unit pinned `PIPELINE_CONFIG=<workdir>/pipeline.yaml`,
which the first-day flow never creates; `--config nosuch.yml` emitted exit 0; the scrontab's log
directory did not exist; the default working directory was /srv/lora-pipeline; the timer had no
time zone. Kind 2 (a CronJob that cannot find its inputs): the container ran `pipeline run
my-task.yml` from a directory of the image. The emitted command lines are run in
tests/jobs/test_schedule_runs.py.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from tests.support.helpers import REPO, seed_store


def first_day(root: Path, tiny_base: Path) -> Path:
    """The README's "A first day" layout after `make demo`: a git checkout with `.state/tiny-base` and
    the embedded store `.state/mlflow.db`, the user's files in data/, and my-task.yml made by the
    README's `cp` + `sed`. No pipeline.yaml (the flow never writes one)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / ".git").mkdir()
    (root / "data").mkdir()
    shutil.copy(REPO / "datasets" / "agent_chat_train.jsonl", root / "data" / "train.jsonl")
    shutil.copy(REPO / "datasets" / "agent_chat_validation.jsonl", root / "data" / "validation.jsonl")
    shutil.copytree(tiny_base, root / ".state" / "tiny-base")
    seed_store(root / ".state")
    shutil.copy(REPO / "axolotl_configs" / "tiny-cpu.yml", root / "my-task.yml")
    subprocess.run(  # the README's line, as written there
        [
            "sed",
            "-i",
            "s#datasets/agent_chat_train.jsonl#data/train.jsonl#; "
            "s#datasets/agent_chat_validation.jsonl#data/validation.jsonl#",
            "my-task.yml",
        ],
        cwd=root,
        check=True,
    )
    return root


@pytest.fixture()
def day(tmp_path, tiny_base, monkeypatch):
    root = first_day(tmp_path / "proj", tiny_base)
    monkeypatch.chdir(root)
    return root


def emit(*args: str):
    return CliRunner().invoke(app, ["schedule", "emit", "--name", "my-task", *args])


def unit(text: str) -> dict[str, str]:
    """The [Service]/[Timer] keys of a unit file (last value wins; comments skipped)."""
    out = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v
    return out


def test_the_first_day_unit_pins_no_missing_pipeline_yaml(day):
    """The issue's instance: `PIPELINE_CONFIG=<workdir>/pipeline.yaml`, a file the first day never
    creates: every run exited 2. The job finds the project as every command does (`.state/mlflow.db`)."""
    r = emit("--kind", "systemd", "--config", "my-task.yml", "--workdir", str(day), "--out", "schedule")
    assert r.exit_code == 0, r.output
    service = (day / "schedule" / "lora-retrain-my-task.service").read_text()
    assert "PIPELINE_CONFIG" not in unit(service)["Environment"]
    assert unit(service)["WorkingDirectory"] == str(day)
    # a pipeline.yaml that is there is pinned, by absolute path
    (day / "pipeline.yaml").write_text("run: {eval_loss_margin: 0.05}\n")
    r = emit("--kind", "systemd", "--config", "my-task.yml", "--out", "schedule")
    assert r.exit_code == 0, r.output
    env = unit((day / "schedule" / "lora-retrain-my-task.service").read_text())["Environment"]
    assert f"PIPELINE_CONFIG={day / 'pipeline.yaml'}" in env


@pytest.mark.parametrize("kind", ["systemd", "scrontab"])
def test_a_config_the_job_would_not_find_is_refused(day, kind):
    """`emit --config nosuch.yml` exited 0. Siblings: a data file the config names that is not there, a
    pipeline.yaml ($PIPELINE_CONFIG) that is not there; nothing is written."""
    r = emit("--kind", kind, "--config", "nosuch.yml", "--out", "schedule")
    assert r.exit_code == 2 and "nosuch.yml" in r.output and "would fail" in r.output, r.output
    (day / "gone.yml").write_text(
        (day / "my-task.yml").read_text().replace("data/train.jsonl", "data/nope.jsonl")
    )
    r = emit("--kind", kind, "--config", "gone.yml", "--out", "schedule")
    assert r.exit_code == 2 and "data/nope.jsonl does not exist" in r.output, r.output
    r = CliRunner().invoke(
        app,
        [
            "schedule",
            "emit",
            "--name",
            "my-task",
            "--kind",
            kind,
            "--config",
            "my-task.yml",
            "--out",
            "schedule",
        ],
        env={"PIPELINE_CONFIG": str(day / "elsewhere.yaml")},
    )
    assert r.exit_code == 2 and "elsewhere.yaml: config file not found" in r.output, r.output
    assert not (day / "schedule").exists()


def test_a_place_the_job_cannot_write_is_refused(day):
    """Sibling: the volume (or state, runs, prepared datasets) behind a file: the job's publish would fail."""
    (day / "blocker").write_text("")
    (day / "pipeline.yaml").write_text(yaml.safe_dump({"volume": {"path": str(day / "blocker" / "volume")}}))
    r = emit("--kind", "systemd", "--config", "my-task.yml")
    assert r.exit_code == 2 and "volume.path" in r.output and "blocker is in the way" in r.output, r.output
    r = emit(
        "--kind", "systemd", "--config", "my-task.yml", "--no-check"
    )  # for another machine: it says what
    assert r.exit_code == 0 and "NOT FOUND WHEN EMITTED: volume.path" in r.output, r.output


def test_defaults_name_this_machine_and_the_timer_its_zone(day):
    """Without --workdir the unit ran in /srv/lora-pipeline with this machine's virtualenv; the timer
    had no time zone while the CronJob pins one."""
    r = emit("--kind", "systemd", "--config", "my-task.yml", "--timezone", "Europe/Berlin", "--out", "s")
    assert r.exit_code == 0, r.output
    service = unit((day / "s" / "lora-retrain-my-task.service").read_text())
    timer = (day / "s" / "lora-retrain-my-task.timer").read_text()
    assert service["WorkingDirectory"] == str(day) and "/srv/" not in service["ExecStart"]
    assert "OnCalendar=*-*-* 03:00:00 Europe/Berlin" in timer
    if shutil.which("systemd-analyze"):
        files = [str(p) for p in (day / "s").iterdir()]
        v = subprocess.run(["systemd-analyze", "verify", *files], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr


def test_the_scrontab_log_directory_exists(day):
    """Slurm does not create `--output`'s directory: the job could not open its log."""
    r = emit("--kind", "scrontab", "--config", "my-task.yml")
    assert r.exit_code == 0, r.output
    out = next(ln for ln in r.output.splitlines() if ln.startswith("#SCRON --output="))
    assert Path(out.split("=", 1)[1]).parent == day / "logs" and (day / "logs").is_dir()
    assert "slurmctld's local time" in r.output  # scrontab has no time zone of its own


def test_the_scrontab_line_survives_a_missing_secrets_file(day):
    """Sibling: `set -a; . /etc/lora-pipeline/secrets.env 2>/dev/null` ends dash (Slurm's /bin/sh here)
    with exit 2 when the file is not there, silently, before `pipeline` starts."""
    r = emit("--kind", "scrontab", "--config", "my-task.yml")
    command = r.output.strip().splitlines()[-1].split(None, 5)[5]
    assert "; fi; " in command and not Path("/etc/lora-pipeline/secrets.env").exists()
    exe = next(t for t in shlex.split(command.split("; fi; ", 1)[1]) if "=" not in t)  # after VAR=value
    sh = subprocess.run(["/bin/sh", "-c", command.replace(exe, "echo", 1)], capture_output=True, text=True)
    assert sh.returncode == 0 and "run my-task.yml --name my-task" in sh.stdout, sh.stderr


# -- kind 2: the CronJob's inputs ------------------------------------------------------------------------
def cronjob_docs(r) -> tuple[str, dict, dict]:
    text = r.output.split("\n", 1)[1]  # after the `# --- NAME` line
    cm, cj = yaml.safe_load_all(text)
    return text, cm, cj


def test_the_cronjob_ships_its_training_config_on_the_mounts(day):
    """The issue's instance: the container ran `pipeline run my-task.yml` in /srv/lora-pipeline, a file
    nothing put there. Now the ConfigMap holds it, its data and base paths on the datasets claim and
    dataset_prepared_path on the state claim (a relative one resolved next to the read-only config mount)."""
    r = emit("--kind", "cronjob", "--config", "my-task.yml", "--image", "r/lora:1")
    assert r.exit_code == 0, r.output
    text, cm, cj = cronjob_docs(r)
    c = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["pipeline", "run", "/etc/lora-pipeline/training.yml"]
    assert c["workingDir"] == "/data/state"
    training = yaml.safe_load(cm["data"]["training.yml"])
    assert training["datasets"][0]["path"] == "/data/datasets/data/train.jsonl"
    assert training["test_datasets"][0]["path"] == "/data/datasets/data/validation.jsonl"
    assert training["base_model"] == "/data/datasets/.state/tiny-base"
    assert training["dataset_prepared_path"] == "/data/state/prepared"
    header = text.split("apiVersion")[0]
    assert f"/data/datasets/data/train.jsonl  <- {day / 'data' / 'train.jsonl'}" in header
    assert f"/data/datasets/.state/tiny-base  <- {day / '.state' / 'tiny-base'}" in header


def test_the_cronjob_refuses_inputs_it_cannot_place(day, tmp_path):
    """Siblings: a data file that is not here, two files that would land on the same claim path
    (outside the project: by name), and a config that is not here: refused with the exact list."""
    cfg = yaml.safe_load((day / "my-task.yml").read_text())
    cfg["datasets"].append({**cfg["datasets"][0], "path": "data/missing.jsonl"})
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        shutil.copy(day / "data" / "train.jsonl", tmp_path / sub / "extra.jsonl")
        cfg["datasets"].append({**cfg["datasets"][0], "path": str(tmp_path / sub / "extra.jsonl")})
    (day / "bad.yml").write_text(yaml.safe_dump(cfg))
    r = emit("--kind", "cronjob", "--config", "bad.yml", "--image", "r/lora:1", "--out", "k8s")
    assert r.exit_code == 2, r.output
    assert "datasets[1].path data/missing.jsonl: not found" in r.output
    assert "would both be /data/datasets/extra.jsonl" in r.output
    r = emit("--kind", "cronjob", "--config", "nosuch.yml", "--image", "r/lora:1", "--out", "k8s")
    assert r.exit_code == 2 and "nosuch.yml" in r.output
    assert not (day / "k8s").exists()


def test_a_hub_base_is_named_for_the_pods_cache(monkeypatch):
    """Sibling: the production config's hub base reaches the pod only through the hub cache on the state
    claim (HF_HUB_OFFLINE=1): the header says so, with the revision."""
    monkeypatch.chdir(REPO)
    r = emit("--kind", "cronjob", "--config", "axolotl_configs/qwen3.6-27b-lora.yml", "--image", "r/lora:1")
    assert r.exit_code == 0, r.output
    text, cm, _ = cronjob_docs(r)
    assert "the hub model Qwen/Qwen3.6-27B@" in text.split("apiVersion")[0]
    assert yaml.safe_load(cm["data"]["training.yml"])["base_model"] == "Qwen/Qwen3.6-27B"


def test_the_unit_runs_as_the_user_who_emitted_it(day, monkeypatch):
    """Sibling: a system unit without `User=` runs as root, leaving root's lock files and store in the
    operator's project (0600: the operator's own commands then fail on them). The checks ran as this user."""
    import pwd

    import pipeline.cli.schedule as cli_schedule

    monkeypatch.setattr(cli_schedule.os, "geteuid", lambda: 65534)
    r = emit("--kind", "systemd", "--config", "my-task.yml")
    assert r.exit_code == 0, r.output
    assert f"User={pwd.getpwuid(65534).pw_name}" in r.output.splitlines()
