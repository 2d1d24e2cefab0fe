"""The validation report and the fleet profile it is checked against.

`ValidationReport` is what `pipeline validate --json`, `validation.json` and the registry's
`validation.report` tag hold: adapter, base, weights_sha256, checks [{id, severity, message, where}],
stats, created, verdict, and `bound` (what the verdict was computed against: weights, served
checkpoint identity, fleet vLLM version, rules version; `pipeline.validate.publishable` re-checks
when any of them differs at publish time).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.findings import Finding, Report

Verdict = Literal["pass", "fail"]

REPORT_FILE = "validation.json"
DEFAULT_VLLM_VERSION = "0.19.2"  # pipeline.yaml fleet.vllm_version's default


@dataclass
class ValidationReport(Report):
    """Findings of one validation, with what was validated and summary stats.

    JSON (`validation.json`, the registry's `validation.report` tag): adapter, base,
    weights_sha256, checks [{id, severity, message, where}], stats, created, verdict, bound.
    """

    adapter: str = ""
    base: str | None = None
    weights_sha256: str | None = None
    stats: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    bound: dict = field(default_factory=dict)

    @property
    def checks(self) -> list[Finding]:
        return self.findings

    @property
    def verdict(self) -> Verdict:
        return "pass" if self.ok else "fail"

    @property
    def passed(self) -> bool:
        return self.ok

    def to_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "base": self.base,
            "weights_sha256": self.weights_sha256,
            "checks": [c.to_dict() for c in self.findings],
            "stats": self.stats,
            "created": self.created,
            "verdict": self.verdict,
            "bound": self.bound,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ValidationReport:
        return cls(
            findings=[Finding(**c) for c in d.get("checks", [])],
            adapter=d["adapter"],
            base=d.get("base"),
            weights_sha256=d.get("weights_sha256"),
            stats=d.get("stats", {}),
            created=d.get("created", ""),
            bound=d.get("bound", {}),
        )

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())


# Each FleetRules field and where pipeline.yaml sets it (section, field): the one fleet profile the rules read.
PROFILE_SOURCES: dict[str, tuple[str, str]] = {
    "max_lora_rank": ("fleet", "max_lora_rank"),
    "lora_target_modules": ("fleet", "lora_target_modules"),
    "allow_embedding_targets": ("fleet", "allow_embedding_targets"),
    "fully_sharded_loras": ("fleet", "fully_sharded_loras"),
    "speculative_mtp": ("fleet", "speculative_mtp"),
    "loading_mode": ("fleet", "loading_mode"),
    "min_acceptance_ratio": ("fleet", "min_acceptance_ratio"),
    "lora_speed_factor": ("fleet", "lora_speed_factor"),
    "vllm_version": ("fleet", "vllm_version"),
    "served_model": ("served", "model"),
    "served_path": ("served", "path"),
    "served_checkpoint": ("served", "checkpoint"),
    "served_revision": ("served", "revision"),
}


@dataclass
class FleetRules:
    """What the serving fleet accepts: the fleet profile every rule reads (pipeline.yaml `fleet` and `served`).

    `lora_target_modules` is vLLM's `--lora-target-modules`; `fully_sharded_loras` `--fully-sharded-loras`;
    `speculative_mtp` whether the instances draft with the checkpoint's MTP layer (`--speculative-config
    '{"method": "mtp"}'`); `served_model` the exact model string given to `vllm serve` (what the filesystem
    resolver compares with `base_model_name_or_path`); `served_path` a local copy of the served checkpoint
    (config, index, headers and tokenizer only are read); `vllm_version` what the instances run (release or
    nightly string; `pipeline.serving.versions`); `min_acceptance_ratio` the floor of the predicted MTP acceptance
    ratio and `lora_speed_factor` the LoRA kernels' decode cost factor (`pipeline.validate.acceptance`). Built from a config by field name (`PROFILE_SOURCES`);
    `profile()` is what a verdict is bound to.
    """

    max_lora_rank: int = 16
    lora_target_modules: list[str] | None = None
    allow_embedding_targets: bool = False
    fully_sharded_loras: bool = False
    speculative_mtp: bool = True
    loading_mode: str = "api"
    min_acceptance_ratio: float | None = None
    lora_speed_factor: float = 0.93
    served_model: str | None = None
    served_path: Path | None = None
    served_checkpoint: str | None = None
    served_revision: str | None = None
    vllm_version: str | None = DEFAULT_VLLM_VERSION

    @classmethod
    def from_config(cls, cfg) -> FleetRules:
        """From a `ProjectConfig`, field by field (`PROFILE_SOURCES`)."""
        return cls(**{f: getattr(getattr(cfg, sec), name) for f, (sec, name) in PROFILE_SOURCES.items()})

    def profile(self) -> dict:
        """Every field as JSON values (paths as strings): what a verdict was computed against."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = str(v) if isinstance(v, Path) else (list(v) if isinstance(v, tuple) else v)
        return out
