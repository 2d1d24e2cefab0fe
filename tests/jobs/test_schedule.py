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
    assert "Persistent=true" in timer and "OnCalendar=*-*-* 3:0:00" in timer
    r = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / n) for n in files]], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    # and the check is real: a broken calendar fails it
    (tmp_path / "lora-retrain-agent-tools.timer").write_text(timer.replace("3:0:00", "notatime"))
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


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_weekday_range_is_a_valid_calendar():
    """Regression: cron day-of-week ranges (`1-5`) were copied verbatim into OnCalendar (invalid)."""
    timer = emit("systemd", spec(schedule="*/15 * * * 1-5"))["lora-retrain-agent-tools.timer"]
    cal = next(line.split("=", 1)[1] for line in timer.splitlines() if line.startswith("OnCalendar="))
    assert cal.startswith("Mon..Fri ")
    r = subprocess.run(["systemd-analyze", "calendar", cal], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
