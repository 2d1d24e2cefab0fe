"""The declared interface validation rules read: `Facts` (every rule), `AdapterFacts` (rules on an adapter
directory), `TrainFacts` (rules on an axolotl config), and `Fact`, one established fact or why it is missing.

A rule names the protocol it reads in its signature (`def rule(ctx: Facts)`) and reads only what the
protocol declares: no private attribute, no `getattr` probing, no cache of its own on the context
(`tests/test_architecture.py` enforces it). Getters never write into the report; a rule records stats
through `ctx.stats`. Models: peft's `LoraVariant` (a static interface per variant) and vLLM's
`PEFTHelper` (one object holding the facts of an adapter config, validated once).

`CheckpointFacts` is the one home of the facts both contexts share: the fleet's vLLM range and the base
and served checkpoints (headers only), each read at most once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pipeline.artifacts.checkpoint import Checkpoint, read_checkpoint
from pipeline.artifacts.manifest import AdapterManifest
from pipeline.serving.modules import serving_class
from pipeline.serving.versions import UnknownVllmVersion, VllmRange, rules_for

if TYPE_CHECKING:  # annotations only: the report module imports nothing from here
    from pipeline.validate.report import FleetRules

T = TypeVar("T")


class Unavailable(Exception):
    """A fact a check needs is missing (reported by another check): skip this check."""


@dataclass(frozen=True)
class Fact(Generic[T]):
    """A value, or why it is missing.

    `missing` is the message saying why the fact could not be established (None with no value: it was
    not asked for, e.g. no base given); `reason` a short category where a rule needs one
    ("missing", "invalid").
    """

    value: T | None = None
    missing: str | None = None
    reason: str | None = None

    @property
    def known(self) -> bool:
        return self.value is not None

    def get(self) -> T:
        """The value; raises `Unavailable` (the rule asking is skipped) when there is none."""
        if self.value is None:
            raise Unavailable
        return self.value

    @classmethod
    def of(cls, fn: Callable[[], T], *errors: type[BaseException]) -> Fact[T]:
        """`fn()` as a fact; one of `errors` becomes the reason it is missing."""
        try:
            return cls(fn())
        except errors as e:
            return cls(None, str(e))


def _checkpoint(path: Path | None) -> Fact[Checkpoint]:
    if path is None:
        return Fact()
    return Fact.of(lambda: read_checkpoint(Path(path)), FileNotFoundError, ValueError, OSError)


class CheckpointFacts:
    """The fleet's vLLM range and the base and served checkpoints: shared by both contexts, read once.

    Needs `rules` (FleetRules), `base_dir` and `served_dir` on the subclass.
    """

    rules: FleetRules
    base_dir: Path | None
    served_dir: Path | None

    @cached_property
    def vllm_fact(self) -> Fact[VllmRange]:
        if not self.rules.vllm_version:
            return Fact(
                None, "fleet.vllm_version is empty: set it to what the instances run (`GET /version`)"
            )
        return Fact.of(lambda: rules_for(self.rules.vllm_version), UnknownVllmVersion)

    @property
    def vllm(self) -> VllmRange:
        return self.vllm_fact.get()

    @cached_property
    def base_fact(self) -> Fact[Checkpoint]:
        return _checkpoint(self.base_dir)

    @property
    def base(self) -> Checkpoint:
        return self.base_fact.get()

    @cached_property
    def served_fact(self) -> Fact[Checkpoint]:
        return _checkpoint(self.served_dir)

    @property
    def served(self) -> Checkpoint:
        return self.served_fact.get()

    @property
    def served_architecture(self) -> str | None:
        arch = self.served.config.get("architectures") or [None]
        return arch[0] if isinstance(arch, list) else None  # a string is no list of classes: vLLM finds none

    @property
    def serving_architecture(self) -> str:
        """The class the fleet serves the adapter with: the served checkpoint's, else (no served checkpoint
        given) the one class the fleet's vLLM registers for a Qwen3.5 base (`serving.modules.serving_class`).
        Unavailable when neither tells."""
        if self.served_dir is not None:
            return self.served_architecture
        arch = serving_class(
            None, self.vllm, self.base.text_config.get("model_type") or self.base.config.get("model_type")
        )
        if arch is None:
            raise Unavailable
        return arch


class Facts(Protocol):
    """What every rule may read (both the adapter and the training-config context provide it)."""

    rules: FleetRules
    base_dir: Path | None
    served_dir: Path | None
    published: bool  # the directory is a published version (fixable problems are errors there)
    lora_source_kind: str  # "adapter" | "train"

    @property
    def options(self) -> Any: ...  # pipeline.validate.context.Options
    @property
    def stats(self) -> dict: ...  # the report's stats: rules record summary figures here
    @property
    def where_config(self) -> str: ...
    @property
    def lora(self) -> Any: ...  # pipeline.validate.lora_view.LoraView
    @property
    def lora_problems(self) -> list: ...  # pipeline.artifacts.adapter.ConfigProblem
    @property
    def vllm_fact(self) -> Fact[VllmRange]: ...
    @property
    def vllm(self) -> VllmRange: ...
    @property
    def base_fact(self) -> Fact[Checkpoint]: ...
    @property
    def base(self) -> Checkpoint: ...
    @property
    def served_fact(self) -> Fact[Checkpoint]: ...
    @property
    def served(self) -> Checkpoint: ...
    @property
    def served_architecture(self) -> str | None: ...
    @property
    def serving_architecture(self) -> str: ...
    # tokenizer and template (pipeline.validate.template.TemplateFacts)
    @property
    def served_tokenizer(self) -> Fact: ...
    @property
    def served_tokenizer_dir(self) -> Path | None: ...
    @property
    def training(self) -> Fact: ...
    @property
    def training_where(self) -> str: ...
    @property
    def added_tokens(self) -> Any: ...
    @property
    def template_comparison(self) -> Any: ...
    @property
    def template_unchecked(self) -> str | None: ...
    @property
    def modules_or_none(self) -> list | None: ...  # adapted modules (adapter) or None (training config)


class AdapterFacts(Facts, Protocol):
    """What rules on an adapter directory may read in addition (pipeline.validate.context.Context)."""

    adapter_dir: Path

    @property
    def scan(self) -> Any: ...
    @property
    def config_fact(self) -> Fact: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def typed_cfg(self) -> Any: ...
    @property
    def wfile(self) -> Path: ...
    @property
    def weights_state(self) -> Any: ...
    @property
    def header(self) -> dict: ...
    @property
    def metadata(self) -> dict | None: ...
    @property
    def unknown_tensors(self) -> list[str]: ...
    @property
    def malformed_tensors(self) -> dict[str, str]: ...
    @property
    def base_copies(self) -> dict: ...
    def base_copy_difference(self, name: str) -> str | None: ...
    @property
    def modules(self) -> list: ...
    def live(self) -> list: ...
    def reject(self, m) -> None: ...
    def allowed_modules(self, layer: int) -> set[str]: ...
    @property
    def base_layer_modules(self) -> list[set[str]]: ...
    @property
    def manifest(self) -> AdapterManifest | None: ...
    @property
    def manifest_problem(self) -> str | None: ...
    @property
    def nonfinite(self) -> dict[str, int]: ...
    @property
    def update_norms(self) -> dict[str, float]: ...
    @property
    def value_peaks(self) -> dict[str, float]: ...
    @property
    def relative_effect(self) -> dict[str, float]: ...
    @property
    def expected_weights(self) -> tuple[int | None, int]: ...
    @property
    def expected_weights_bytes(self) -> int | None: ...
    @property
    def serving_dtype(self) -> str: ...
    def configured_rank(self, m) -> int | None: ...
    @property
    def adapter_tokenizer(self) -> Fact: ...
    @property
    def fold(self) -> Fact: ...
    @property
    def behaviour(self) -> Any: ...
    @property
    def served_geometry_diffs(self) -> list[str]: ...


class TrainFacts(Facts, Protocol):
    """What rules on an axolotl training config may read in addition (train_checks.TrainContext)."""

    data: dict
    source: str
    packing: list[str] | None
