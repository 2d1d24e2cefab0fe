"""Emit scheduler manifests that call `pipeline run` (we fit schedulers, we don't write one).

- Kubernetes: the CronJob (batch/v1: `concurrencyPolicy: Forbid`, `startingDeadlineSeconds`, GPU
  requests, the datasets / adapter volume / state PersistentVolumeClaims, MLflow credentials from
  a Secret, never inline) and the ConfigMap holding `pipeline.yaml` and the training config
  (`training.yml`: read here, its paths rewritten onto the mounts, pipeline.jobs.schedule_pod), in
  one file, headed by a comment that lists what must exist first (image, Secret keys, claims, and
  each file the datasets claim must hold, where). The container runs in the state mount. The config is mounted
  read-only, so the writable places are pinned to the mounts through environment overrides
  (`PIPELINE_STATE_DIR`, `PIPELINE_VOLUME__PATH`, `PIPELINE_TRAIN__RUNS_DIR`): relative paths
  would otherwise resolve next to the config, on the read-only mount. `pipeline run --locked-ok`
  exits 0 when another run holds the lock (a Job fails on any other code; systemd's
  `SuccessExitStatus=3` says the same); 1, 2 and 5 fail the Job without retries (podFailurePolicy);
  an eviction (DisruptionTarget) is retried without counting, and SIGTERM leaves
  `terminationGracePeriodSeconds` for the run to finish a publish (pipeline/interrupt.py).
- systemd service + timer (`Persistent=true`: a run missed while the machine was off starts
  at boot; the calendar carries the time zone, as the CronJob's `timeZone`); `ExecStart=` names the
  `pipeline` executable by absolute path (systemd refuses a bare name it cannot find in its own
  search path); the project is the working directory, and `PIPELINE_CONFIG` is set only to a
  pipeline.yaml that exists (else the job finds its project as every command does); `User=` the
  emitting user (a system unit runs as root otherwise, and would leave root's files in the
  project); secrets through `EnvironmentFile=`; `KillMode=mixed` + `TimeoutStopSec` let SIGTERM end
  the run cleanly.
- Slurm scrontab line with `#SCRON` options (absolute path too: cron's PATH is minimal;
  `--locked-ok`, as Slurm records any other exit as FAILED; `--output` into `<workdir>/logs`, which
  `schedule emit` creates, as Slurm does not).

Before emitting a systemd unit or a scrontab line, `schedule emit` makes the checks the job will
make, from its working directory (pipeline.jobs.schedule_checks), and refuses with the list.

Validated in the tests with the Kubernetes OpenAPI schemas (kubernetes-validate, strict) and
`systemd-analyze verify`.

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
import shutil
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, field_validator

from pipeline.jobs.schedule_pod import TRAINING_KEY, PodConfig, pod_training_config

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


# Where the CronJob's container sees its volumes; the writable ones are pinned to these.
MOUNTS = {
    "datasets": "/data/datasets",
    "adapters": "/data/adapters",
    "state": "/data/state",
    "config": "/etc/lora-pipeline",
}
GRACE_S = 120  # SIGTERM -> SIGKILL: time for a run to complete a publish it is in (seconds)


def default_pipeline_bin() -> str | None:
    """The absolute path of this installation's `pipeline` executable (next to the interpreter), or None."""
    here = Path(sys.executable).parent / "pipeline"
    if here.is_file():
        return str(here)
    found = shutil.which("pipeline")
    return str(Path(found).resolve()) if found else None


class ScheduleSpec(BaseModel):
    """What the emitted manifests run, when, and with which resources."""

    name: str = Field(description="adapter name (`pipeline run --name`)")
    config: str = Field(description="axolotl config path as seen by the job")
    schedule: str = Field("0 3 * * *", description="cron expression, 5 fields")
    timezone: str = "Etc/UTC"
    gpus: int = Field(1, ge=0)
    image: str | None = Field(None, description="container image with lora-pipeline installed (CronJob)")
    namespace: str = "ml"
    pipeline_bin: str | None = Field(
        None,
        description="`pipeline` executable: absolute for systemd/Slurm (default: this installation's); "
        "`pipeline` on the image's PATH for the CronJob",
    )
    workdir: str = Field("/srv/lora-pipeline", description="systemd/Slurm: the job's working directory")
    project_config: str | None = Field(
        None,
        description="pipeline.yaml as the job sees it ($PIPELINE_CONFIG; default: none, the job finds its "
        "project from its working directory as every command does; the CronJob: the ConfigMap's "
        "/etc/lora-pipeline/pipeline.yaml)",
    )
    user: str | None = Field(None, description="systemd `User=`: who the job runs as (default: root)")
    needs: list[str] = Field(default_factory=list, description="what must exist where (the header)")
    project_dir: str | None = Field(
        None,
        description="CronJob: where `config` and its relative paths are read here (default: the working "
        "directory); the config goes into the ConfigMap, its paths rewritten onto the mounts",
    )
    pipeline_yaml: str = Field("", description="pipeline.yaml content for the CronJob's ConfigMap")
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

    @field_validator("pipeline_bin")
    @classmethod
    def _bin(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(c.isspace() for c in v)):
            raise ValueError(f"pipeline_bin {v!r}: give a path without white space")
        return v

    def config_path(self, kind: str) -> str | None:
        """`$PIPELINE_CONFIG` of the job; None: the job finds its project from its working directory
        (a pinned `<workdir>/pipeline.yaml` that was never created failed every run with exit 2)."""
        if self.project_config:
            return self.project_config
        return f"{MOUNTS['config']}/pipeline.yaml" if kind == "cronjob" else None

    def executable(self, kind: str) -> str:
        """The `pipeline` the job runs: an absolute path for systemd and Slurm (ValueError otherwise)."""
        if kind == "cronjob":
            return self.pipeline_bin or "pipeline"
        exe = self.pipeline_bin or default_pipeline_bin()
        if not exe or not exe.startswith("/"):
            raise ValueError(
                f"--pipeline-bin {exe or '(none found)'}: {kind} needs the absolute path of the `pipeline` "
                "executable (e.g. /srv/lora-pipeline/.venv/bin/pipeline): it does not search PATH the way a shell does"
            )
        return exe

    def command(self, kind: str = "systemd") -> list[str]:
        config = f"{MOUNTS['config']}/{TRAINING_KEY}" if kind == "cronjob" else self.config
        cmd = [self.executable(kind), "run", config, "--name", self.name]
        if self.gpus > 1:  # the job trains on the GPUs it reserves (`pipeline run --gpus`)
            cmd += ["--gpus", str(self.gpus)]
        # systemd says "3 is success" itself (SuccessExitStatus=3); a Job and Slurm count any non-zero as failed
        return cmd if kind == "systemd" else [*cmd, "--locked-ok"]


def pod_config(spec: ScheduleSpec) -> PodConfig:
    """The training config for the ConfigMap (pipeline.jobs.schedule_pod); ValueError listing what
    is missing or would collide."""
    pod = pod_training_config(Path(spec.config), Path(spec.project_dir or Path.cwd()), MOUNTS)
    if pod.problems:
        raise ValueError("the CronJob's pod could not find its inputs:\n  " + "\n  ".join(pod.problems))
    return pod


def cronjob(spec: ScheduleSpec) -> dict:
    """A Kubernetes batch/v1 CronJob as a dict: `pipeline run` of the ConfigMap's training config,
    in the state mount (writable, and there in every pod, unlike a directory of the image)."""
    if not spec.image:
        raise ValueError(
            "--image: the CronJob needs the container image that has lora-pipeline installed "
            "(`pipeline` on its PATH; README, 'Scheduled retraining')"
        )
    gpu = {"nvidia.com/gpu": str(spec.gpus)} if spec.gpus else {}
    mounts = [
        {"name": "datasets", "mountPath": MOUNTS["datasets"], "readOnly": True},
        {"name": "adapters", "mountPath": MOUNTS["adapters"]},
        {"name": "state", "mountPath": MOUNTS["state"]},
        {"name": "config", "mountPath": MOUNTS["config"], "readOnly": True},
    ]
    state = MOUNTS["state"]
    container = {
        "name": "pipeline",
        "image": spec.image,
        "command": spec.command("cronjob"),
        "workingDir": MOUNTS["state"],
        "env": [
            {"name": "PIPELINE_CONFIG", "value": spec.config_path("cronjob")},
            # the config is mounted read-only: what the job writes goes to the writable mounts
            {"name": "PIPELINE_STATE_DIR", "value": state},
            {"name": "PIPELINE_VOLUME__PATH", "value": MOUNTS["adapters"]},
            {"name": "PIPELINE_TRAIN__RUNS_DIR", "value": f"{state}/runs"},
            {"name": "HF_HOME", "value": f"{state}/hf-home"},
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
        "terminationGracePeriodSeconds": GRACE_S,
        "containers": [container],
        "volumes": [
            {
                "name": "datasets",
                "persistentVolumeClaim": {"claimName": spec.datasets_claim, "readOnly": True},
            },
            {"name": "adapters", "persistentVolumeClaim": {"claimName": spec.adapters_claim}},
            {"name": "state", "persistentVolumeClaim": {"claimName": spec.state_claim}},
            {"name": "config", "configMap": {"name": configmap_name(spec)}},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {
            "name": f"lora-retrain-{spec.name}",
            "namespace": spec.namespace,
            "labels": _labels(spec),
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
                    "podFailurePolicy": {
                        "rules": [
                            # check failed, usage, gated: answers, not crashes; a retry gives the same
                            {
                                "action": "FailJob",
                                "onExitCodes": {
                                    "containerName": "pipeline",
                                    "operator": "In",
                                    "values": [1, 2, 5],
                                },
                            },
                            # evicted or preempted: start again (it resumes), without using up retries
                            {
                                "action": "Ignore",
                                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                            },
                        ]
                    },
                    "template": {"metadata": {"labels": {"lora-pipeline/adapter": spec.name}}, "spec": pod},
                }
            },
        },
    }


def _labels(spec: ScheduleSpec) -> dict:
    return {"app.kubernetes.io/name": "lora-pipeline", "lora-pipeline/adapter": spec.name}


def configmap_name(spec: ScheduleSpec) -> str:
    return f"lora-pipeline-{spec.name}"


def configmap(spec: ScheduleSpec, pod: PodConfig) -> dict:
    """The ConfigMap the CronJob mounts at /etc/lora-pipeline: `pipeline.yaml` (the project's, as given)
    and the training config `training.yml` (its paths on the mounts)."""
    text = spec.pipeline_yaml or (
        "# lora-pipeline project config (pipeline.yaml): served, fleet, registry, run sections.\n"
        "# state_dir, volume.path and train.runs_dir are set by the CronJob's environment (the mounts).\n"
        "{}\n"
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap_name(spec), "namespace": spec.namespace, "labels": _labels(spec)},
        "data": {"pipeline.yaml": text, TRAINING_KEY: pod.text},
    }


def cronjob_requirements(spec: ScheduleSpec, pod: PodConfig) -> str:
    """The comment heading the emitted file: what must exist in the namespace before `kubectl apply`."""
    copies = "".join(f"#     {pod_path}  <- {local}\n" for local, pod_path in pod.copies)
    hub = "".join(
        f"#   the hub model {h} in the hub cache of {spec.state_claim} ({MOUNTS['state']}/hf-home/hub; "
        "HF_HUB_OFFLINE=1 in the pod)\n"
        for h in pod.hub
    )
    return f"""# lora-pipeline: scheduled retraining of adapter {spec.name} (`kubectl apply -f` this file).
# Emitted here: ConfigMap {configmap_name(spec)} (pipeline.yaml, and {TRAINING_KEY}: {spec.config} with its
# paths on the mounts) and CronJob lora-retrain-{spec.name} (`pipeline run {MOUNTS["config"]}/{TRAINING_KEY}`).
# Must exist in namespace {spec.namespace} first:
#   image {spec.image}: lora-pipeline installed (`pipeline` on PATH), CUDA torch, axolotl
#   Secret {spec.mlflow_secret}, keys become environment variables, e.g.
#     kubectl -n {spec.namespace} create secret generic {spec.mlflow_secret} \\
#       --from-literal=MLFLOW_TRACKING_URI=https://mlflow.internal \\
#       --from-literal=MLFLOW_TRACKING_USERNAME=... --from-literal=MLFLOW_TRACKING_PASSWORD=...
#     plus one key per fleet instance's api_key_env (pipeline.yaml fleet.instances)
#   PersistentVolumeClaim {spec.datasets_claim}: the job's inputs, mounted read-only at {MOUNTS["datasets"]};
#     it must hold (path in the pod <- the file here):
{copies}{hub}#   PersistentVolumeClaim {spec.adapters_claim}: the fleet's adapter volume (ReadWriteMany), at {MOUNTS["adapters"]}
#   PersistentVolumeClaim {spec.state_claim}: pipeline state (runs, checkpoints, locks), at {MOUNTS["state"]}
"""


def _needs_header(spec: ScheduleSpec) -> str:
    """Comment lines naming what the job needs to exist where (pipeline.jobs.schedule_checks)."""
    if not spec.needs:
        return ""
    return "# The job needs, before its first run:\n" + "".join(f"#   {n}\n" for n in spec.needs)


def _environment(spec: ScheduleSpec, kind: str) -> list[str]:
    """KEY=value of the job's environment (systemd/Slurm): the pinned project config, if any."""
    env = [f"PIPELINE_CONFIG={c}"] if (c := spec.config_path(kind)) else []
    return [*env, "HF_HUB_OFFLINE=1", "PYTHONUNBUFFERED=1"]


def systemd_units(spec: ScheduleSpec) -> dict[str, str]:
    """{'lora-retrain-NAME.service': ..., 'lora-retrain-NAME.timer': ...}. The timer's calendar
    carries `spec.timezone` (systemd >= 235), as the CronJob's `timeZone` does."""
    unit = f"lora-retrain-{spec.name}"
    on_calendar = "\n".join(f"OnCalendar={c} {spec.timezone}" for c in oncalendar(spec.schedule))
    user = f"User={spec.user}\n" if spec.user else ""
    env = " ".join(
        shlex.quote(e) if any(c.isspace() for c in e) else e for e in _environment(spec, "systemd")
    )
    service = f"""{_needs_header(spec)}[Unit]
Description=lora-pipeline scheduled retraining of adapter {spec.name}
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
{user}WorkingDirectory={spec.workdir}
Environment={env}
# MLflow credentials and fleet API keys: KEY=value lines, mode 0600, never in this unit.
EnvironmentFile=-{spec.env_file}
ExecStart={" ".join(shlex.quote(c) for c in spec.command("systemd"))}
# 3 = another run holds the lock: not a failure of this activation.
SuccessExitStatus=3
TimeoutStartSec={spec.time_limit_h}h
# SIGTERM to `pipeline` alone, which stops its trainer and completes a publish in progress;
# SIGKILL to what is left after TimeoutStopSec.
KillMode=mixed
TimeoutStopSec={GRACE_S}s
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


def scrontab_log_dir(spec: ScheduleSpec) -> str:
    """Where the scrontab's `--output` goes (Slurm does not create it: `schedule emit` does)."""
    return f"{spec.workdir}/logs"


def scrontab(spec: ScheduleSpec) -> str:
    """A Slurm scrontab entry (`scrontab -e`). Its times are slurmctld's local time: scrontab has no
    time-zone setting, so a comment says which zone was intended."""
    gres = f"#SCRON --gres=gpu:{spec.gpus}\n" if spec.gpus else ""
    env = " ".join(shlex.quote(e) for e in _environment(spec, "scrontab"))
    return (
        f"{_needs_header(spec)}"
        f"# Times are slurmctld's local time zone (scrontab has none of its own); {spec.timezone} intended.\n"
        f"#SCRON --job-name=lora-retrain-{spec.name}\n"
        f"#SCRON --time={spec.time_limit_h}:00:00\n"
        f"{gres}"
        f"#SCRON --chdir={spec.workdir}\n"
        f"#SCRON --output={scrontab_log_dir(spec)}/retrain-{spec.name}-%j.log\n"
        # `. FILE` of a missing file ends a POSIX sh (dash) with exit 2 before the job starts: only if readable
        f"{spec.schedule} if [ -r {shlex.quote(spec.env_file)} ]; then set -a; . {shlex.quote(spec.env_file)}; set +a; fi; "
        f"{env} "
        f"{' '.join(shlex.quote(c) for c in spec.command('scrontab'))}\n"
    )


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (the ConfigMap's pipeline.yaml) as `|` blocks."""


_Dumper.add_representer(
    str,
    lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None),
)


def emit(kind: str, spec: ScheduleSpec) -> dict[str, str]:
    """{file name: content} for `kind` in cronjob | systemd | scrontab. Raises ValueError otherwise."""
    if kind == "cronjob":
        doc = cronjob(spec)  # the image first: the cheapest refusal
        pod = pod_config(spec)
        docs = [configmap(spec, pod), doc]
        text = cronjob_requirements(spec, pod) + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)
        return {f"lora-retrain-{spec.name}.cronjob.yaml": text}
    if kind == "systemd":
        return systemd_units(spec)
    if kind == "scrontab":
        return {f"lora-retrain-{spec.name}.scrontab": scrontab(spec)}
    raise ValueError(f"unknown kind {kind!r}: use cronjob, systemd or scrontab")
