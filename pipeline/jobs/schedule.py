"""Emit scheduler manifests that call `pipeline run` (we fit schedulers, we don't write one).

- Kubernetes CronJob (batch/v1): `concurrencyPolicy: Forbid`, `startingDeadlineSeconds`, GPU
  requests, volumes for datasets / the adapter volume / the pipeline state, MLflow
  credentials from a Secret (never inline), and a podFailurePolicy that does not retry the
  exit codes that are answers rather than failures (3 locked, 5 gated).
- systemd service + timer (`Persistent=true`: a run missed while the machine was off starts
  at boot); secrets through `EnvironmentFile=`.
- Slurm scrontab line with `#SCRON` options.

Schedules are checked before anything is emitted (`parse_cron`): five fields parsed by croniter
(the maintained cron parser used by Airflow and others), values in range, an expression that
fires at least once (not `0 3 31 2 *`), and only the syntax every target scheduler shares (no
Quartz/Jenkins extensions `L W # ? H`). The systemd calendar is generated from the expanded
fields, so it means what cron means (including cron's day-of-month OR day-of-week rule).

Exit codes of `pipeline run` (README): 0 published or skipped, 1 check failed, 2 usage,
3 locked, 4 fleet did not converge, 5 gated.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator

# Macros every target understands less uniformly than five fields: emitted as their 5-field form.
CRON_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# Extensions croniter accepts that Kubernetes, systemd or Slurm do not all share.
_EXTENSIONS = re.compile(r"[LW#?HR]", re.IGNORECASE)
_NAMES = re.compile(
    r"\b(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec|sun|mon|tue|wed|thu|fri|sat)\b", re.I
)
FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")


def parse_cron(expr: str) -> tuple[str, list[list]]:
    """(normalised 5-field expression, croniter's expanded fields) of a cron schedule.

    Raises ValueError with one line saying what is wrong, e.g. `minute 61 is out of range 0-59`.
    """
    from croniter import croniter
    from croniter.croniter import CroniterBadCronError, CroniterBadDateError

    text = " ".join(str(expr).split())
    text = CRON_MACROS.get(text.lower(), text)
    parts = text.split(" ")
    if len(parts) != 5:
        raise ValueError(
            f"schedule {expr!r} has {len(parts)} fields; a cron expression has 5 "
            "(minute hour day-of-month month day-of-week), e.g. '0 3 * * *'"
        )
    if _EXTENSIONS.search(_NAMES.sub("", text)):
        raise ValueError(
            f"schedule {expr!r}: L, W, #, ?, H are not standard cron (Kubernetes, systemd and Slurm "
            "do not all accept them); use numbers, ranges (1-5), lists (1,15) and steps (*/15)"
        )
    try:
        it = croniter(text)
    except CroniterBadCronError as e:
        raise ValueError(f"schedule {expr!r}: {_why(text, e)}") from None
    import datetime as dt

    try:  # never firing (e.g. 31 February) is an error, not a schedule
        croniter(text, dt.datetime(2001, 1, 1), max_years_between_matches=28).get_next(dt.datetime)
    except CroniterBadDateError:
        raise ValueError(
            f"schedule {expr!r} never fires (no such date); check day-of-month and month"
        ) from None
    return text, it.expanded


def _why(text: str, e: Exception) -> str:
    """Which field is wrong, in words (croniter's own message names only the expression)."""
    from croniter import croniter
    from croniter.croniter import CroniterBadCronError

    ranges = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
    probe = ["*"] * 5
    for i, part in enumerate(text.split(" ")):
        probe[i] = part
        try:
            croniter(" ".join(probe))
        except CroniterBadCronError:
            lo, hi = ranges[i]
            return f"{FIELDS[i]} {part!r} is not valid (numbers {lo}-{hi}, ranges, lists, */N steps)"
        probe[i] = "*"
    return str(e)


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
        return parse_cron(v)[0]

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(v)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"timezone {v!r} is not an IANA zone name like 'Etc/UTC' or 'Europe/Berlin'"
            ) from None
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
    on_calendar = "\n".join(f"OnCalendar={c}" for c in oncalendar(spec.schedule))
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
{on_calendar}
Persistent=true
RandomizedDelaySec=5min
Unit={unit}.service

[Install]
WantedBy=timers.target
"""
    return {f"{unit}.service": service, f"{unit}.timer": timer}


def oncalendar(expr: str) -> list[str]:
    """systemd OnCalendar values (`DOW *-MM-DD HH:MM:00`) meaning what cron expression `expr` means.

    Built from croniter's expanded fields. Cron fires when day-of-month OR day-of-week matches
    when both are restricted (systemd ANDs them), so that case gives two calendars.
    """
    _, (mi, hh, dom, mon, dow) = parse_cron(expr)
    days = ("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")

    def j(vals: list, fmt: str = "{:02d}") -> str:
        return "*" if vals == ["*"] else ",".join(fmt.format(int(v)) for v in vals)

    def cal(dom_vals: list, dow_vals: list) -> str:
        wd = "" if dow_vals == ["*"] else ",".join(dict.fromkeys(days[int(d)] for d in dow_vals)) + " "
        return f"{wd}*-{j(mon)}-{j(dom_vals)} {j(hh)}:{j(mi)}:00"

    if dom != ["*"] and dow != ["*"]:
        return [cal(dom, ["*"]), cal(["*"], dow)]
    return [cal(dom, dow)]


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
