"""The training config as the CronJob's pod sees it: shipped in the ConfigMap, its paths on the mounts.

The container runs `pipeline run CONFIG`: a config that is only on the machine that emitted the
manifest, or whose relative paths (`datasets/train.jsonl`, `.state/tiny-base`) resolve against the
pod's working directory, fails every night with exit 2 (file not found). `pod_training_config`
reads the axolotl config here and rewrites every path it reads or writes onto the pod's mounts
(`pipeline.jobs.schedule.MOUNTS`):

- what the job reads (each `datasets` / `test_datasets` entry's `path`, a `base_model`,
  `tokenizer_config`, `deepspeed` or `lora_model_dir` that is a path here): onto the read-only
  datasets claim, at its path relative to the project directory (`data/train.jsonl` ->
  `/data/datasets/data/train.jsonl`), or by its file name when it lies outside the project; the
  copies the claim must hold are listed (`PodConfig.copies`, the manifest's header);
- what it writes: `dataset_prepared_path` -> `/data/state/prepared` (a relative one resolved next
  to pipeline.yaml, on the read-only ConfigMap mount); `output_dir` is the run's own;
- a hub `base_model` stays a hub id: the pod runs with `HF_HUB_OFFLINE=1`, so it must be in the
  hub cache on the state claim (`HF_HOME=/data/state/hf-home`), pinned by `base_model_revision`.

A path that is not here (the config itself, a data file, a base directory) or two files that
would land on the same path are `PodConfig.problems`: `schedule emit` refuses with the list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from pipeline.errors import PipelineError
from pipeline.train.config import check_dataset_entries, load_training_config

READ_KEYS = ("base_model", "tokenizer_config", "deepspeed", "lora_model_dir")
TRAINING_KEY = "training.yml"  # the ConfigMap key (and file name under the config mount)


@dataclass
class PodConfig:
    """The rewritten config (`text`, YAML), what must be copied onto the datasets claim
    (local path, path in the pod), what must be in the pod's hub cache, and what is wrong."""

    text: str = ""
    copies: list[tuple[str, str]] = field(default_factory=list)
    hub: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _on_claim(local: Path, project: Path, mount: str) -> str:
    """Where `local` (a path read from `project`) lands on the datasets claim mounted at `mount`."""
    full = Path(os.path.normpath(project / local))
    try:
        rel = full.relative_to(project)
    except ValueError:  # outside the project: by its name
        rel = Path(full.name)
    return str(PurePosixPath(mount, *rel.parts))


def pod_training_config(config: Path, project: Path, mounts: dict[str, str]) -> PodConfig:
    """`config` (read from `project`, the directory the job's relative paths are taken from here)
    rewritten for the pod whose `mounts` are `pipeline.jobs.schedule.MOUNTS` (module doc).
    Reads no data file; raises nothing: what is wrong is in `problems`."""
    out = PodConfig()
    project = project.resolve()
    path = config if config.is_absolute() else project / config
    try:
        tc = load_training_config(path)
        check_dataset_entries(tc)
    except PipelineError as e:
        out.problems.append(f"--config {config}: {str(e).splitlines()[0]}")
        return out
    data = tc.data
    targets: dict[str, str] = {}

    def move(value: str, what: str, must_exist: bool = True) -> str:
        local = Path(value)
        here = local if local.is_absolute() else project / local
        if not here.exists():
            if must_exist:
                out.problems.append(f"{what} {value}: not found (from {project}); the pod needs a copy of it")
            return value
        pod = _on_claim(local, project, mounts["datasets"])
        if targets.setdefault(pod, str(here)) != str(here):
            out.problems.append(
                f"{what} {value} and {targets[pod]} would both be {pod} on the datasets claim"
            )
        elif (str(here), pod) not in out.copies:
            out.copies.append((str(here), pod))
        return pod

    for key in ("datasets", "test_datasets"):
        for i, entry in enumerate(data.get(key) or []):
            if isinstance(entry, dict) and entry.get("path"):
                entry["path"] = move(str(entry["path"]), f"{key}[{i}].path")
    for key in READ_KEYS:
        value = data.get(key)
        if not value or not isinstance(value, str):
            continue
        if key == "base_model" and not Path(value).exists() and not value.startswith(("/", ".")):
            rev = data.get("base_model_revision") or data.get("revision_of_model")
            out.hub.append(f"{value}@{rev}" if rev else value)  # a hub id: from the pod's cache
            continue
        data[key] = move(value, key)
    data["dataset_prepared_path"] = f"{mounts['state']}/prepared"
    head = (
        f"# {path.name} for the CronJob: paths rewritten onto the pod's mounts by `pipeline schedule emit`\n"
    )
    out.text = head + yaml.safe_dump(data, sort_keys=False)
    return out
