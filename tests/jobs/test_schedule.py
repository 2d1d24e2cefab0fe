"""Emitted scheduler manifests parse and pass their schedulers' schema checks."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.jobs.schedule import ScheduleSpec, cronjob, emit
from tests.support.helpers import REPO

PROD = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"


def spec(**kw):
    kw.setdefault("image", "registry.internal/lora-pipeline:1.0")
    kw.setdefault("project_dir", str(REPO))
    return ScheduleSpec(name="agent-tools", config="axolotl_configs/qwen3.6-27b-lora.yml", **kw)


def cronjob_docs(**kw) -> list[dict]:
    return list(yaml.safe_load_all(emit("cronjob", spec(**kw))["lora-retrain-agent-tools.cronjob.yaml"]))


# batch/v1 CronJob `timeZone` is GA from 1.27, `podFailurePolicy` from 1.31: the oldest release the
# manifest is for, and the newest schema the validator ships.
K8S_VERSIONS = ("1.31.0", "latest")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_emitted_configmap_and_cronjob_pass_the_kubernetes_schema(version):
    """Issue 27 item 5: validated with the Kubernetes OpenAPI schema (kubernetes-validate, strict:
    an unknown or misplaced field is an error), not only parsed."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    docs = cronjob_docs(gpus=2)
    assert [d["kind"] for d in docs] == ["ConfigMap", "CronJob"]
    for d in docs:
        kv.validate(d, kv.latest_version() if version == "latest" else version, strict=True)


def test_the_schema_check_catches_a_typo():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    doc = cronjob(spec())
    doc["spec"]["concurrencyPolicyy"] = doc["spec"].pop("concurrencyPolicy")
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, "1.31.0", strict=True)
    doc = cronjob(spec())
    doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = "8Gi"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, "1.31.0", strict=True)


def test_cronjob_names_its_gpus_secret_claims_and_configmap():
    cm, cj = cronjob_docs(gpus=2)
    s = cj["spec"]
    assert s["concurrencyPolicy"] == "Forbid" and s["startingDeadlineSeconds"] > 0
    pod = s["jobTemplate"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.internal/lora-pipeline:1.0"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["command"][:3] == ["pipeline", "run", "/etc/lora-pipeline/training.yml"]  # from the ConfigMap
    assert {m["name"] for m in c["volumeMounts"]} == {"datasets", "adapters", "state", "config"}
    assert c["envFrom"] == [{"secretRef": {"name": "mlflow-credentials"}}]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == cm["metadata"]["name"] and "pipeline.yaml" in cm["data"]
    text = emit("cronjob", spec())["lora-retrain-agent-tools.cronjob.yaml"]
    for needed in ("Secret mlflow-credentials", "MLFLOW_TRACKING_URI", "lora-datasets", "lora-adapters"):
        assert needed in text.split("apiVersion")[0], needed  # documented in the file's header
    assert "PASSWORD=" not in yaml.safe_dump(cj) and "TOKEN" not in yaml.safe_dump(cj)


def test_a_cronjob_needs_a_real_image():
    """Item 5: the CronJob named a placeholder image (registry.example.com)."""
    with pytest.raises(ValueError, match="--image"):
        cronjob(spec(image=None))
    r = _emit("--kind", "cronjob")
    assert r.returncode == 2 and "--image" in r.stderr


def test_a_read_only_config_mount_does_not_hold_the_store_or_the_volume(tmp_path, monkeypatch):
    """Item 5: pipeline.yaml mounted read-only at /etc/lora-pipeline put `.state` (the MLflow store,
    runs, locks) and `adapters/volume` next to itself, on the read-only mount. The container's
    environment, exactly as emitted, must point every writable place at a writable mount."""
    from pipeline.config import load_config

    cm, cj = cronjob_docs()
    etc = tmp_path / "etc" / "lora-pipeline"
    etc.mkdir(parents=True)
    (etc / "pipeline.yaml").write_text(cm["data"]["pipeline.yaml"])
    etc.chmod(0o555)
    container = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    for e in container["env"]:
        monkeypatch.setenv(e["name"], e["value"])
    monkeypatch.setenv("PIPELINE_CONFIG", str(etc / "pipeline.yaml"))  # where the test mounts it
    cfg = load_config(None)
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    for path in (cfg.state_dir, cfg.volume.path, cfg.train.runs_dir, cfg.embedded_store):
        assert any(str(path).startswith(w + "/") or str(path) == w for w in writable), path


def test_the_cronjob_treats_locked_as_done_and_gated_as_failed():
    """Item 5: exit 3 (another run holds the lock) is success for systemd (SuccessExitStatus=3) but
    failed the Kubernetes Job; `--locked-ok` makes it exit 0 there. 1, 2 and 5 are answers: no retry."""
    _, cj = cronjob_docs()
    job = cj["spec"]["jobTemplate"]["spec"]
    assert "--locked-ok" in job["template"]["spec"]["containers"][0]["command"]
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [1, 2, 5]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert job["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # time to finish a publish
    assert "SuccessExitStatus=3" in emit("systemd", spec())["lora-retrain-agent-tools.service"]


def test_pipeline_run_locked_ok_exits_zero_and_says_locked(tmp_path, monkeypatch):
    from filelock import FileLock
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.support.helpers import write_project_config

    cfg_path = write_project_config(tmp_path)
    lock = FileLock(str(tmp_path / "state" / "locks" / "agent-tools.lock"))
    (tmp_path / "state" / "locks").mkdir(parents=True)
    tiny = str(REPO / "axolotl_configs" / "tiny-cpu.yml")
    with lock:
        env = {"PIPELINE_CONFIG": str(cfg_path)}
        r = CliRunner().invoke(app, ["run", tiny, "--name", "agent-tools", "--locked-ok"], env=env)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout.splitlines()[-1]) == {
            "status": "locked",
            "reason": json.loads(r.stdout.splitlines()[-1])["reason"],
            "exit_code": 0,
        }
        r = CliRunner().invoke(app, ["run", tiny, "--name", "agent-tools"], env=env)
        assert r.exit_code == 3 and json.loads(r.stdout.splitlines()[-1])["status"] == "locked"


def test_the_configmap_refuses_credentials(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("registry: {tracking_uri: 'postgresql://mlflow:hunter2@db:5432/mlflow'}\n")
    r = _emit("--kind", "cronjob", "--image", "r/i:1", "--pipeline-yaml", str(p))
    assert r.returncode == 2 and "credentials" in r.stderr and "hunter2" not in r.stderr + r.stdout
    p.write_text("fleet: {max_lora_rank: 32}\n")
    r = _emit("--kind", "cronjob", "--image", "r/i:1", "--pipeline-yaml", str(p), "--config", str(PROD))
    assert r.returncode == 0, r.stderr
    assert "max_lora_rank: 32" in r.stdout


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_units_verify_as_emitted(tmp_path):
    """Item 5: with the default `pipeline` the unit failed `systemd-analyze verify` ("Command pipeline is
    not executable"): ExecStart= names this installation's executable by absolute path."""
    files = emit("systemd", spec(workdir=str(tmp_path)))
    service = files["lora-retrain-agent-tools.service"]
    exe = next(ln for ln in service.splitlines() if ln.startswith("ExecStart=")).split("=", 1)[1].split()[0]
    assert exe.startswith("/") and Path(exe).is_file() and Path(exe).name == "pipeline"
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    timer = files["lora-retrain-agent-tools.timer"]
    assert "Persistent=true" in timer and "OnCalendar=*-*-* 03:00:00" in timer
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    # and the check is real: a broken calendar fails it, and so does a bare command name
    (tmp_path / "lora-retrain-agent-tools.timer").write_text(timer.replace("03:00:00", "notatime"))
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode != 0
    (tmp_path / "lora-retrain-agent-tools.timer").write_text(timer)
    (tmp_path / "lora-retrain-agent-tools.service").write_text(service.replace(exe, "pipeline-not-on-path"))
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode != 0 and "not executable" in r.stderr


def test_systemd_and_slurm_refuse_a_bare_command_name():
    with pytest.raises(ValueError, match="absolute path"):
        emit("systemd", spec(pipeline_bin="pipeline"))
    r = _emit("--kind", "scrontab", "--pipeline-bin", "pipeline")
    assert r.returncode == 2 and "absolute path" in r.stderr


def test_scrontab_line():
    text = emit("scrontab", spec(schedule="30 2 * * 1-5"))["lora-retrain-agent-tools.scrontab"]
    lines = text.strip().splitlines()
    assert all(line.startswith("#") for line in lines[:-1]) and "#SCRON --gres=gpu:1" in text
    fields = lines[-1].split(None, 5)
    assert fields[:5] == ["30", "2", "*", "*", "1-5"] and "/pipeline run" in fields[5]
    assert fields[5].endswith("--locked-ok")  # a run that finds the lock taken is not a failed job


@pytest.mark.parametrize("bad", ["0 3 * *", "every day", "0 3 * * * *"])
def test_bad_schedule_rejected(bad):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "schedule",
            "emit",
            "--kind",
            "cronjob",
            "--name",
            "a",
            "--config",
            "c.yml",
            "--schedule",
            bad,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and "cron expression" in r.stderr


def _emit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "schedule", "emit", "--name", "a", "--config", "c.yml", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "bad, says",
    [
        ("61 3 * * *", "minute '61' is not valid"),  # the issue's instance
        ("0 24 * * *", "hour '24' is not valid"),  # sibling: another field out of range
        ("0 3 31 2 *", "never fires"),  # sibling: a date that does not exist
        ("0 3 * * 8", "day-of-week '8' is not valid"),
        ("0 3 L * *", "not standard cron"),  # sibling: a croniter/Quartz extension
        ("0 3 * * 1#2", "not standard cron"),
    ],
)
@pytest.mark.parametrize("kind", ["systemd", "cronjob", "scrontab"])
def test_invalid_schedules_fail_before_anything_is_emitted(bad, says, kind, tmp_path):
    """Issue 17 item 10: exit 2, one clear line, nothing written, never a pydantic dump."""
    r = _emit("--kind", kind, "--schedule", bad, "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout
    assert says in r.stderr and "validation error" not in r.stderr and "pydantic" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_other_bad_fields_are_one_clear_line():
    r = _emit("--kind", "systemd", "--name", "Agent_Tools")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "adapter name 'Agent_Tools'" in r.stderr
    r = _emit("--kind", "systemd", "--gpus", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize(
    "expr",
    ["0 3 * * *", "*/15 0-6/2 1,15 jan-mar MON", "30 2 * * 1-5", "0 3 1 * 1", "@weekly", "5 4 * * 7"],
)
def test_systemd_calendar_fires_when_cron_does(expr):
    """The OnCalendar lines are valid for systemd and give the same next elapses as cron (croniter),
    including cron's day-of-month OR day-of-week rule (two calendars)."""
    import datetime as dt

    from croniter import croniter

    from pipeline.jobs.schedule import oncalendar

    cals = oncalendar(expr)
    assert len(cals) == (2 if expr in ("0 3 1 * 1", "*/15 0-6/2 1,15 jan-mar MON") else 1)
    start = dt.datetime(2030, 1, 1, 0, 0, tzinfo=dt.UTC)
    elapses = set()
    for cal in cals:
        r = subprocess.run(
            [
                "systemd-analyze",
                "calendar",
                "--iterations=12",
                "--base-time=2030-01-01 00:00:00 UTC",
                f"{cal} UTC",
            ],
            capture_output=True,
            text=True,
            env={"TZ": "UTC", "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode == 0, (cal, r.stderr)
        for line in r.stdout.splitlines():
            if "UTC" in line and ("Next elapse" in line or "Iter." in line or "Iteration" in line):
                stamp = line.split(":", 1)[1].strip()
                elapses.add(dt.datetime.strptime(" ".join(stamp.split()[1:3]), "%Y-%m-%d %H:%M:%S"))
    it = croniter(expr, start.replace(tzinfo=None))
    expected = [it.get_next(dt.datetime) for _ in range(12)]
    assert sorted(elapses)[:12] == expected


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_weekday_range_is_a_valid_calendar():
    """Regression: cron day-of-week ranges (`1-5`) were copied verbatim into OnCalendar (invalid)."""
    timer = emit("systemd", spec(schedule="*/15 * * * 1-5"))["lora-retrain-agent-tools.timer"]
    cal = next(line.split("=", 1)[1] for line in timer.splitlines() if line.startswith("OnCalendar="))
    assert cal.startswith("Mon,Tue,Wed,Thu,Fri ")
    r = subprocess.run(["systemd-analyze", "calendar", cal], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
