"""Emitted scheduler manifests parse and pass their schedulers' schema checks."""

import shutil
import subprocess
import sys

import pytest
import yaml

from pipeline.jobs.schedule import ScheduleSpec, cronjob, emit
from tests.support.helpers import REPO


def spec(**kw):
    return ScheduleSpec(name="agent-tools", config="axolotl_configs/qwen3.6-27b-lora.yml", **kw)


def test_cronjob_matches_kubernetes_schema():
    """Deserialise into the kubernetes client's V1CronJob and back: a misspelt or misplaced field
    is dropped by the model, so the round trip must equal the emitted document."""
    from kubernetes.client import ApiClient

    doc = yaml.safe_load(emit("cronjob", spec(gpus=2))["lora-retrain-agent-tools.cronjob.yaml"])

    class Resp:
        data = __import__("json").dumps(doc)

    api = ApiClient()
    obj = api.deserialize(Resp(), "V1CronJob")
    assert api.sanitize_for_serialization(obj) == doc
    s = doc["spec"]
    assert s["concurrencyPolicy"] == "Forbid" and s["startingDeadlineSeconds"] > 0
    pod = s["jobTemplate"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["command"][:3] == ["pipeline", "run", "axolotl_configs/qwen3.6-27b-lora.yml"]
    assert {m["name"] for m in c["volumeMounts"]} >= {"datasets", "adapters", "state"}
    assert c["envFrom"] == [{"secretRef": {"name": "mlflow-credentials"}}]
    # no secret values inline
    assert "PASSWORD" not in yaml.safe_dump(doc) and "TOKEN" not in yaml.safe_dump(doc)


def test_cronjob_schema_check_catches_a_typo():
    from kubernetes.client import ApiClient

    doc = cronjob(spec())
    doc["spec"]["concurrencyPolicyy"] = doc["spec"].pop("concurrencyPolicy")

    class Resp:
        data = __import__("json").dumps(doc)

    api = ApiClient()
    assert api.sanitize_for_serialization(api.deserialize(Resp(), "V1CronJob")) != doc


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path):
    files = emit("systemd", spec(pipeline_bin=sys.executable, workdir=str(tmp_path)))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    timer = files["lora-retrain-agent-tools.timer"]
    assert "Persistent=true" in timer and "OnCalendar=*-*-* 03:00:00" in timer
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    # and the check is real: a broken calendar fails it
    (tmp_path / "lora-retrain-agent-tools.timer").write_text(timer.replace("03:00:00", "notatime"))
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode != 0


def test_scrontab_line():
    text = emit("scrontab", spec(schedule="30 2 * * 1-5"))["lora-retrain-agent-tools.scrontab"]
    lines = text.strip().splitlines()
    assert all(line.startswith("#SCRON ") for line in lines[:-1]) and "--gres=gpu:1" in text
    fields = lines[-1].split(None, 5)
    assert fields[:5] == ["30", "2", "*", "*", "1-5"] and "pipeline run" in fields[5]


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
