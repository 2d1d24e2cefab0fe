"""The facts one validation of an adapter directory establishes once and its checks share (read lazily,
each at most once): `Context` provides `pipeline.validate.facts.AdapterFacts`.

A property raises `Unavailable` when its fact cannot be established (no base given, unreadable
weights...): the check that needed it is skipped, and the missing fact itself is reported by the check
that owns it (`base.unreadable`, `weights.header`...). Only headers of the base and served
checkpoints are read; adapter tensors are read through one memory map.

The facts are grouped by what establishes them: the directory, adapter_config.json, manifest.json and
the optional steps here; the weights file in `weights_facts`, the base and served checkpoints in
`base_facts`, the tokenizer files in `tokenizer_facts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pipeline.artifacts.adapter import CONFIG_FILE, AdapterConfig, AdapterConfigError, read_adapter_config
from pipeline.artifacts.hashing import DirectoryScan, scan_directory
from pipeline.artifacts.manifest import MANIFEST, AdapterManifest, read_adapter_manifest
from pipeline.artifacts.normalise import FoldResult, ParityError, fold_rslora
from pipeline.errors import PipelineError
from pipeline.validate import behaviour as behaviour_eval
from pipeline.validate.base_facts import BaseFacts
from pipeline.validate.facts import CheckpointFacts, Fact, Unavailable
from pipeline.validate.lora_view import LoraView
from pipeline.validate.report import FleetRules, ValidationReport
from pipeline.validate.template import TemplateFacts
from pipeline.validate.tokenizer_facts import TokenizerFacts
from pipeline.validate.weights_facts import WeightsFacts


@dataclass
class Options:
    behaviour: bool = False
    fold_rslora: bool = False
    validation_files: list[Path] | None = None
    training_config: Path | None = None
    allow: frozenset[str] = frozenset()


@dataclass
class Context(WeightsFacts, BaseFacts, TokenizerFacts, CheckpointFacts, TemplateFacts):
    adapter_dir: Path
    base_dir: Path | None
    rules: FleetRules
    served_dir: Path | None
    report: ValidationReport
    options: Options = field(default_factory=Options)
    rejected: set[str] = field(default_factory=set)  # modules a keys check refused: later checks skip them
    lora_source_kind = "adapter"

    @property
    def where_config(self) -> str:
        return str(self.adapter_dir / CONFIG_FILE)

    # -- the directory ------------------------------------------------------------------------------------------
    @cached_property
    def scan(self) -> DirectoryScan:
        try:
            return scan_directory(self.adapter_dir)
        except OSError as e:
            raise Unavailable from e

    # -- adapter_config.json ---------------------------------------------------------------------------------------
    @cached_property
    def config_fact(self) -> Fact[AdapterConfig]:
        """adapter_config.json, or why not (reason "missing" | "invalid")."""
        _ = self.scan
        try:
            return Fact(read_adapter_config(self.adapter_dir))
        except FileNotFoundError as e:
            return Fact(None, str(e), "missing")
        except AdapterConfigError as e:
            return Fact(None, str(e), "invalid")
        except OSError as e:
            return Fact(None, f"{self.where_config}: cannot be read ({e})", "invalid")

    @property
    def cfg(self) -> AdapterConfig:
        """adapter_config.json as read (fields may have wrong types: see `typed_cfg`)."""
        return self.config_fact.get()

    @property
    def lora_problems(self) -> list:
        """Fields whose type or value PEFT's LoraConfig refuses (artifacts.adapter.config_problems)."""
        return self.cfg.problems

    @property
    def typed_cfg(self) -> AdapterConfig:
        """adapter_config.json when every field has PEFT's type (regexes compile, numbers finite)."""
        cfg = self.cfg
        if cfg.problems:
            raise Unavailable
        return cfg

    @property
    def lora(self) -> LoraView:
        return LoraView.from_adapter_config(self.typed_cfg)

    @property
    def stats(self) -> dict:
        return self.report.stats

    # -- manifest ---------------------------------------------------------------------------------------------------
    @cached_property
    def manifest_fact(self) -> Fact[AdapterManifest]:
        """manifest.json, or why it could not be read; an empty fact when there is none."""
        if (self.adapter_dir / MANIFEST) not in self.scan.files:  # never open a FIFO or follow a link
            return Fact()
        return Fact.of(
            lambda: read_adapter_manifest(self.adapter_dir), FileNotFoundError, ValueError, OSError
        )

    @property
    def manifest(self) -> AdapterManifest | None:
        return self.manifest_fact.value

    @property
    def manifest_problem(self) -> str | None:
        """Why manifest.json could not be read (not JSON, wrong fields), or None."""
        return self.manifest_fact.missing

    @property
    def published(self) -> bool:
        """The directory is a published version (what the fleet loads): fixable problems are errors here."""
        return self.manifest is not None and self.manifest.published is not None

    # -- what the optional steps established ------------------------------------------------------------------------
    @cached_property
    def fold(self) -> Fact[FoldResult]:
        """`--fold-rslora`: the fold (done once, before anything reads adapter_config.json), or why not.

        reason "parity": folding would change a module's scale (nothing written); an unreadable config or
        weights file is an empty fact (its own checks report it)."""
        try:
            return Fact(fold_rslora(self.adapter_dir))
        except ParityError as e:
            return Fact(None, str(e), "parity")
        except (FileNotFoundError, ValueError, OSError, PipelineError):
            return Fact()

    @cached_property
    def behaviour(self) -> Fact[dict]:
        """`--behaviour`'s measurements (`behaviour.evaluate`), or why not: reason "skip" (no base), "static"
        (static checks failed first), "load" (transformers/peft could not load base + adapter)."""
        if self.base_dir is None:
            return Fact(None, "--behaviour needs the bf16 base: pass --base DIR", "skip")
        if not self.report.passed:
            return Fact(None, None, "static")
        try:
            return Fact(
                behaviour_eval.evaluate(self.adapter_dir, self.base_dir, self.options.validation_files)
            )
        except behaviour_eval.BehaviourUnavailable as e:
            return Fact(None, str(e), "load")
