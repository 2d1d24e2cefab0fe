"""The same rules on an axolotl training config, before axolotl starts (`pipeline train`, `pipeline run`).

`TrainContext` provides the facts the shared rules read (`lora`, `rules`, `vllm`, `base`, the training
and served tokenizers/templates) from the axolotl config, the project config and the local base; the
`train.*` checks below are the rules only a training config has. A refused setting costs GPU hours
when it is found only after training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pipeline.artifacts.adapter import config_problems
from pipeline.findings import Report
from pipeline.validate import template
from pipeline.validate.chat import ChatTokenizer, TokenizerError, has_tokenizer
from pipeline.validate.context import Options
from pipeline.validate.facts import CheckpointFacts, TrainFacts, Unavailable
from pipeline.validate.lora_view import LoraView
from pipeline.validate.report import FleetRules, ValidationReport
from pipeline.validate.rules import RULES, Issue, check, run
from pipeline.validate.template import AddedTokens, TemplateFacts


@dataclass
class TrainContext(CheckpointFacts, TemplateFacts):
    """Provides `pipeline.validate.facts.TrainFacts` for an axolotl config."""

    data: dict  # the axolotl config (overrides applied)
    source: str  # its file
    rules: FleetRules
    served_dir: Path | None = None
    options: Options = field(default_factory=Options)
    report: ValidationReport = field(default_factory=ValidationReport)
    packing: list[str] | None = (
        None  # pipeline.train.preflight.packing_problems (it needs the GPUs: the caller's)
    )
    lora_source_kind = "train"
    published = False

    @property
    def where_config(self) -> str:
        return self.source

    @cached_property
    def lora_unchecked(self) -> LoraView:
        return LoraView.from_axolotl(self.data, self.source)

    @cached_property
    def lora_problems(self) -> list:
        return config_problems(self.lora_unchecked.as_peft())

    @property
    def lora(self) -> LoraView:
        """The LoRA settings once their regexes compile (`config.regex` reports the others)."""
        if any(p.kind == "regex" for p in self.lora_problems):
            raise Unavailable
        return self.lora_unchecked

    @property
    def stats(self) -> dict:
        return self.report.stats

    @property
    def modules_or_none(self) -> None:
        return None

    @property
    def training_where(self) -> str:
        return self.source

    @cached_property
    def base_dir(self) -> Path | None:
        b = self.data.get("base_model")
        return Path(str(b)) if b and Path(str(b)).is_dir() else None

    @cached_property
    def base_tokenizer(self) -> ChatTokenizer | None:
        src = self.data.get("tokenizer_config") or self.data.get("base_model")
        if not src or not has_tokenizer(Path(str(src))):
            return None
        try:
            return ChatTokenizer.load(Path(str(src)))
        except (TokenizerError, OSError):
            return None

    # TemplateFacts
    def _training_side(self):
        return template.training_side_from_config(self.data, self.source)

    def _added_tokens(self) -> AddedTokens:
        tok = self.base_tokenizer
        if tok is None:
            return AddedTokens([], self.source)
        vocab = tok.vocab()
        wanted = [t for t in self.data.get("tokens") or [] if isinstance(t, str)]
        st = self.data.get("special_tokens") or {}
        wanted += [v for v in (st.values() if isinstance(st, dict) else []) if isinstance(v, str)]
        wanted += [t for t in self.data.get("added_tokens_overrides") or {} if isinstance(t, str)]
        return AddedTokens([(t, None) for t in dict.fromkeys(wanted) if t not in vocab], self.source)

    @property
    def template_unchecked(self) -> str | None:
        return None


# -- rules only a training config has ------------------------------------------------------------------------------
@check(
    "train.qlora",
    "error",
    "`adapter: qlora` (trained against a 4-bit base, not the bf16 base the served "
    "checkpoint was quantized from)",
    scopes=("train",),
)
def qlora(ctx: TrainFacts):
    if ctx.data.get("adapter") == "qlora":
        yield Issue("adapter: qlora trains against a 4-bit base: use `adapter: lora`", ctx.source)


@check("train.base_model", "error", "`base_model` missing", scopes=("train",))
def base_model(ctx: TrainFacts):
    if not str(ctx.data.get("base_model") or ""):
        yield Issue("base_model is missing", ctx.source)


@check("train.unpinned_base", "error", "a hub `base_model` without `base_model_revision`", scopes=("train",))
def unpinned_base(ctx: TrainFacts):
    base = str(ctx.data.get("base_model") or "")
    if base and not Path(base).exists() and not ctx.data.get("base_model_revision"):
        yield Issue(
            f"base_model {base!r} is no directory here, so it is read as a hub id, which needs "
            "base_model_revision: pin a commit sha (a local base that was moved: point base_model at "
            "its directory)",
            ctx.source,
        )


@check(
    "train.sample_packing",
    "error",
    "`sample_packing` (or eval packing) on a Gated-DeltaNet model where the pipeline's exact-packing patch "
    "cannot run (a family it does not cover, e.g. qwen3_next; a GPU without fla's varlen kernels): "
    "recurrent/conv state would leak across packed samples "
    "(facts: `pipeline.train.preflight.packing_problems`, which needs the GPUs)",
    scopes=("train",),
)
def sample_packing(ctx: TrainFacts):
    for msg in ctx.packing or ():
        yield Issue(msg.removeprefix(f"{ctx.source}: "), ctx.source)


def check_training(
    data: dict,
    source: str,
    rules: FleetRules,
    served_dir: Path | None = None,
    allow: set[str] = frozenset(),
    packing: list[str] | None = None,
) -> Report:
    """Run every train-scope rule on an axolotl config; findings whose id is in `allow` are dropped."""
    ctx = TrainContext(data, source, rules, served_dir, Options(allow=frozenset(allow)), packing=packing)
    rep = run(ctx, Report(), scope="train")
    rep.findings = [f for f in rep.findings if f.id not in allow]
    return rep


TRAIN_IDS = sorted(k for k, s in RULES.items() if "train" in s.scopes)
