"""Emit scheduler manifests that call `pipeline run` (we fit schedulers, we don't write one).

- Kubernetes CronJob (batch/v1): `concurrencyPolicy: Forbid`, `startingDeadlineSeconds`, GPU
  requests, volumes for datasets / the adapter volume / the pipeline state, MLflow
  credentials from a Secret (never inline), and a podFailurePolicy that does not retry the
  exit codes that are answers rather than failures (3 locked, 5 gated).
- systemd service + timer (`Persistent=true`: a run missed while the machine was off starts
  at boot); secrets through `EnvironmentFile=`.
- Slurm scrontab line with `#SCRON` options.

Exit codes of `pipeline run` (README): 0 published or skipped, 1 check failed, 2 usage,
3 locked, 4 fleet did not converge, 5 gated.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator

CRON_FIELD = re.compile(r"^[\d*/,\-A-Za-z?LW#]+$")


class ScheduleSpec(BaseModel):
    """What the emitted manifests run, when, and with which resources."""

    name: str = Field(description="adapter name (`pipeline run --name`)")
    config: str = Field(description="axolotl config path as seen by the job")
    schedule: str = Field("0 3 * * *", description="cron expression, 5 fields")
    timezone: str = "Etc/UTC"
    gpus: int = Field(1, ge=0)
    image: str = "registry.example.com/lora-pipeline:latest"
    namespace: str = "ml"
    pipeline_bin: str = "pipeline"
    workdir: str = "/srv/lora-pipeline"
    project_config: str = "/etc/lora-pipeline/pipeline.yaml"
    datasets_claim: str = "lora-datasets"
    adapters_claim: str = "lora-adapters"
    state_claim: str = "lora-pipeline-state"
    mlflow_secret: str = "mlflow-credentials"
    env_file: str = "/etc/lora-pipeline/secrets.env"
    starting_deadline_s: int = 3600
    time_limit_h: int = 12
    cpu: str = "8"
    memory: str = "64Gi"

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str) -> str:
        parts = v.split()
        if len(parts) != 5 or not all(CRON_FIELD.match(p) for p in parts):
            raise ValueError(f"schedule {v!r} is not a 5-field cron expression like '0 3 * * *'")
        return v

    @field_validator("name")
    @classmethod
    def _dns(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", v):
            raise ValueError(
                f"name {v!r}: use lower-case letters, digits and '-' (it names Kubernetes objects)"
            )
        return v

    def command(self) -> list[str]:
        return [self.pipeline_bin, "run", self.config, "--name", self.name]


def cronjob(spec: ScheduleSpec) -> dict:
    """A Kubernetes batch/v1 CronJob as a dict."""
    gpu = {"nvidia.com/gpu": str(spec.gpus)} if spec.gpus else {}
    mounts = [
        {"name": "datasets", "mountPath": "/data/datasets", "readOnly": True},
        {"name": "adapters", "mountPath": "/data/adapters"},
        {"name": "state", "mountPath": "/data/state"},
        {"name": "config", "mountPath": str(Path(spec.project_config).parent), "readOnly": True},
    ]
    container = {
        "name": "pipeline",
        "image": spec.image,
        "command": spec.command(),
        "workingDir": spec.workdir,
        "env": [
            {"name": "PIPELINE_CONFIG", "value": spec.project_config},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        # MLFLOW_TRACKING_URI / _USERNAME / _PASSWORD and fleet API keys come from the Secret.
        "envFrom": [{"secretRef": {"name": spec.mlflow_secret}}],
        "resources": {
            "requests": {"cpu": spec.cpu, "memory": spec.memory, **gpu},
            "limits": {"memory": spec.memory, **gpu},
        },
        "volumeMounts": mounts,
    }
    pod = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {
                "name": "datasets",
                "persistentVolumeClaim": {"claimName": spec.datasets_claim, "readOnly": True},
            },
            {"name": "adapters", "persistentVolumeClaim": {"claimName": spec.adapters_claim}},
            {"name": "state", "persistentVolumeClaim": {"claimName": spec.state_claim}},
            {"name": "config", "configMap": {"name": f"lora-pipeline-{spec.name}"}},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {
            "name": f"lora-retrain-{spec.name}",
            "namespace": spec.namespace,
            "labels": {"app.kubernetes.io/name": "lora-pipeline", "lora-pipeline/adapter": spec.name},
        },
        "spec": {
            "schedule": spec.schedule,
            "timeZone": spec.timezone,
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": spec.starting_deadline_s,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 5,
            "jobTemplate": {
                "spec": {
                    "backoffLimit": 2,
                    "activeDeadlineSeconds": spec.time_limit_h * 3600,
                    # 3 (locked) and 5 (gated) are answers, not crashes: never retry them.
                    "podFailurePolicy": {
                        "rules": [
                            {
                                "action": "FailJob",
                                "onExitCodes": {
                                    "containerName": "pipeline",
                                    "operator": "In",
                                    "values": [1, 2, 3, 5],
                                },
                            }
                        ]
                    },
                    "template": {"metadata": {"labels": {"lora-pipeline/adapter": spec.name}}, "spec": pod},
                }
            },
        },
    }


def systemd_units(spec: ScheduleSpec) -> dict[str, str]:
    """{'lora-retrain-NAME.service': ..., 'lora-retrain-NAME.timer': ...}."""
    unit = f"lora-retrain-{spec.name}"
    m, h, dom, mon, dow = spec.schedule.split()
    on_calendar = _cron_to_oncalendar(m, h, dom, mon, dow)
    service = f"""[Unit]
Description=lora-pipeline scheduled retraining of adapter {spec.name}
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
WorkingDirectory={spec.workdir}
Environment=PIPELINE_CONFIG={spec.project_config} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# MLflow credentials and fleet API keys: KEY=value lines, mode 0600, never in this unit.
EnvironmentFile=-{spec.env_file}
ExecStart={" ".join(shlex.quote(c) for c in spec.command())}
# 3 = another run holds the lock: not a failure of this activation.
SuccessExitStatus=3
TimeoutStartSec={spec.time_limit_h}h
Nice=5
"""
    timer = f"""[Unit]
Description=Schedule for {unit}.service

[Timer]
OnCalendar={on_calendar}
Persistent=true
RandomizedDelaySec=5min
Unit={unit}.service

[Install]
WantedBy=timers.target
"""
    return {f"{unit}.service": service, f"{unit}.timer": timer}


def _cron_to_oncalendar(m: str, h: str, dom: str, mon: str, dow: str) -> str:
    """Translate the common cron forms to systemd OnCalendar (DOW MONTH-DAY HH:MM)."""
    days = {"0": "Sun", "1": "Mon", "2": "Tue", "3": "Wed", "4": "Thu", "5": "Fri", "6": "Sat", "7": "Sun"}

    def f(x: str) -> str:
        if x == "*":
            return "*"
        if x.startswith("*/"):
            return f"0/{x[2:]}"
        return x

    def day(d: str) -> str:  # "1-5" -> "Mon..Fri"; names pass through
        if "-" in d:
            a, b = d.split("-", 1)
            return f"{days.get(a, a)}..{days.get(b, b)}"
        return days.get(d, d)

    dow_s = "" if dow == "*" else ",".join(day(d) for d in dow.split(",")) + " "
    return f"{dow_s}*-{f(mon)}-{f(dom)} {f(h)}:{f(m)}:00"


def scrontab(spec: ScheduleSpec) -> str:
    """A Slurm scrontab entry (`scrontab -e`)."""
    gres = f"#SCRON --gres=gpu:{spec.gpus}\n" if spec.gpus else ""
    return (
        f"#SCRON --job-name=lora-retrain-{spec.name}\n"
        f"#SCRON --time={spec.time_limit_h}:00:00\n"
        f"{gres}"
        f"#SCRON --chdir={spec.workdir}\n"
        f"#SCRON --output={spec.workdir}/logs/retrain-{spec.name}-%j.log\n"
        f"{spec.schedule} set -a; . {shlex.quote(spec.env_file)} 2>/dev/null; set +a; "
        f"PIPELINE_CONFIG={shlex.quote(spec.project_config)} {' '.join(shlex.quote(c) for c in spec.command())}\n"
    )


def emit(kind: str, spec: ScheduleSpec) -> dict[str, str]:
    """{file name: content} for `kind` in cronjob | systemd | scrontab. Raises ValueError otherwise."""
    if kind == "cronjob":
        return {f"lora-retrain-{spec.name}.cronjob.yaml": yaml.safe_dump(cronjob(spec), sort_keys=False)}
    if kind == "systemd":
        return systemd_units(spec)
    if kind == "scrontab":
        return {f"lora-retrain-{spec.name}.scrontab": scrontab(spec)}
    raise ValueError(f"unknown kind {kind!r}: use cronjob, systemd or scrontab")
