"""The validation report and the fleet profile it is checked against.

`ValidationReport` is what `pipeline validate --json`, `validation.json` and the registry's
`validation.report` tag hold: adapter, base, weights_sha256, checks [{id, severity, message, where}],
stats, created, verdict, and `bound` (what the verdict was computed against: weights, served
checkpoint identity, fleet vLLM version, rules version; `pipeline.validate.publishable` re-checks
when any of them differs at publish time).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.findings import Finding, Report

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
    def verdict(self) -> str:
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


@dataclass
class FleetRules:
    """What the serving fleet accepts (the project config's `fleet` and `served` sections).

    `lora_target_modules` is vLLM's `--lora-target-modules`; `served_model` the exact model
    string given to `vllm serve` (what the filesystem resolver compares with
    `base_model_name_or_path`); `served_path` a local copy of the served checkpoint (config,
    index, headers and tokenizer only are read); `vllm_version` what the instances run
    (release or nightly string; `pipeline.serving.versions`).
    """

    max_lora_rank: int = 16
    lora_target_modules: list[str] | None = None
    allow_embedding_targets: bool = False
    loading_mode: str = "api"
    served_model: str | None = None
    served_path: Path | None = None
    served_checkpoint: str | None = None
    served_revision: str | None = None
    vllm_version: str | None = DEFAULT_VLLM_VERSION

    @classmethod
    def from_config(cls, cfg) -> FleetRules:
        """From a `ProjectConfig`."""
        return cls(
            cfg.fleet.max_lora_rank,
            cfg.fleet.lora_target_modules,
            cfg.fleet.allow_embedding_targets,
            cfg.fleet.loading_mode,
            cfg.served.model,
            cfg.served.path,
            cfg.served.checkpoint,
            cfg.served.revision,
            cfg.fleet.vllm_version,
        )
