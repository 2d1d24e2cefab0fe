"""Rules on the LoRA settings: shared by `pipeline validate` (adapter_config.json) and `pipeline train`
(the axolotl config, before axolotl starts): one home per rule, one id scheme.

Sources: vllm/lora/peft_helper.py (`_validate_features`, `validate_legal`: the features vLLM refuses,
collected and reported together), vllm/config/lora.py (`MaxLoRARanks`), docs/vllm.md (per-version
behaviour), peft/tuners/lora/config.py (field types).
"""

from __future__ import annotations

import math

from pipeline.artifacts.adapter import pattern_value
from pipeline.artifacts.peft_match import matching_entries
from pipeline.serving.vllm import EMBEDDING_MODULES, REFUSED_CONFIG_KEYS
from pipeline.validate.facts import AdapterFacts, Facts, TrainFacts
from pipeline.validate.lora_view import AXOLOTL_NAMES
from pipeline.validate.peft_features import (
    known_init,
    known_init_names,
    lora_config_fields,
    mutates_base,
    peft_version,
    variant_fields,
)
from pipeline.validate.rules import Issue, Unavailable, check

BOTH = ("adapter", "train")


# -- --fold-rslora (runs first: it rewrites adapter_config.json before anything reads it: `ctx.fold`) -----------
@check(
    "config.rslora_folded",
    "warning",
    "`--fold-rslora` folded rsLoRA into lora_alpha (scale unchanged on every module)",
    option="fold_rslora",
)
def rslora_folded(ctx: AdapterFacts):
    res = ctx.fold.value
    if res is not None and res.folded:
        yield Issue(
            f"rsLoRA folded into lora_alpha in place (effective scale alpha/sqrt(r) -> alpha'/r, unchanged on all "
            f"{res.modules} modules; weights untouched): {res.old} -> {res.new}; register this directory, not the "
            "original",
            ctx.where_config,
        )


@check(
    "config.rslora_parity",
    "error",
    "`--fold-rslora` would change some module's scale (nothing written)",
    option="fold_rslora",
)
def rslora_parity(ctx: AdapterFacts):
    err = ctx.fold.missing
    if err:
        yield Issue(
            f"{err}: fold by hand with exact alpha_pattern entries or retrain without rsLoRA",
            ctx.where_config,
        )


# -- reading the file -------------------------------------------------------------------------------------------
@check("config.missing", "error", "no `adapter_config.json` (or it is not a regular file)")
def missing(ctx: AdapterFacts):
    fact = ctx.config_fact
    if fact.reason == "missing":
        yield Issue(fact.missing, ctx.where_config)


@check("config.invalid", "error", "`adapter_config.json` is not JSON or not an object (file:line)")
def invalid(ctx: AdapterFacts):
    fact = ctx.config_fact
    if fact.reason == "invalid":
        yield Issue(f"{fact.missing}: fix the JSON or re-save with peft", ctx.where_config)


def _problems(ctx: Facts, kind: str):
    return [p for p in ctx.lora_problems if p.kind == kind]


@check(
    "config.type",
    "error",
    'a field has another type than PEFT\'s `LoraConfig` declares (e.g. `"r": "eight"`)',
)
def wrong_type(ctx: AdapterFacts):
    if ctx.lora_source_kind != "adapter":
        return  # axolotl's own schema types the training config
    for p in _problems(ctx, "type"):
        yield Issue(
            f"{p.message}: fix adapter_config.json or re-save the adapter with peft", ctx.where_config
        )


@check("config.nonfinite", "error", "`r`, `lora_alpha` or a pattern value is NaN or Infinity")
def nonfinite(ctx: AdapterFacts):
    if ctx.lora_source_kind != "adapter":
        return
    for p in _problems(ctx, "nonfinite"):
        yield Issue(
            f"{p.message}; vLLM would serve NaN scales (empty completions, failing logprobs): set the value "
            "the adapter was trained with",
            ctx.where_config,
        )


@check(
    "config.regex",
    "error",
    "`target_modules`/`exclude_modules` string, a `rank_pattern`/`alpha_pattern` key "
    "or `layers_pattern` is not a valid regex",
    scopes=BOTH,
)
def bad_regex(ctx: Facts):
    for p in _problems(ctx, "regex"):
        yield Issue(f"{p.message}: peft and vLLM match it as a regex; escape it", ctx.where_config)


@check(
    "config.alpha_negative",
    "error",
    "`lora_alpha` or an `alpha_pattern` value is negative (the update's sign flips; PEFT and vLLM apply it silently)",
    scopes=BOTH,
)
def alpha_negative(ctx: Facts):
    lv = ctx.lora
    patterns = lv.get("alpha_pattern")
    alphas = {lv.name("lora_alpha"): lv.get("lora_alpha")} | {
        f"{lv.name('alpha_pattern')}[{k}]": v
        for k, v in (patterns if isinstance(patterns, dict) else {}).items()
    }
    for what, a in alphas.items():
        if isinstance(a, int | float) and not isinstance(a, bool) and a < 0:
            yield Issue(
                f"{what} = {a!r} is negative: scale = alpha/r < 0 subtracts the trained update; training "
                "never needs this (a typo or a wrong sign in the config): set the positive value",
                lv.source,
            )


# -- what vLLM refuses (peft_helper.py) -------------------------------------------------------------------------
@check(
    "config.peft_type",
    "error",
    "not a LoRA adapter (`peft_type` != LORA; axolotl `adapter` not lora)",
    scopes=BOTH,
)
def peft_type(ctx: Facts):
    lv = ctx.lora
    if lv.get("peft_type") != "LORA":
        if lv.kind == "train":
            yield Issue(
                f"adapter is {lv.get('peft_type')!r}; the fleet hot-loads LoRA: set `adapter: lora`",
                lv.source,
            )
        else:
            yield Issue(
                f"peft_type is {lv.get('peft_type')!r}; vLLM serves only LORA adapters: save a LoRA (peft LoraConfig) "
                "adapter",
                lv.source,
            )


@check("config.required", "error", "`r`, `lora_alpha` or `target_modules` missing", scopes=BOTH)
def required(ctx: Facts):
    lv = ctx.lora
    for key in ("r", "lora_alpha", "target_modules"):
        if lv.get(key) in (None, [], ""):
            if lv.kind == "train" and key == "target_modules":
                yield Issue(
                    f"no {lv.name(key)} (and no lora_target_linear): list the projections to adapt", lv.source
                )
            else:
                state = "is missing" if lv.get(key) is None else f"is empty ({lv.get(key)!r})"
                yield Issue(
                    f"{lv.name(key)} {state}; vLLM requires r, lora_alpha and target_modules: "
                    + ("set it" if lv.kind == "train" else "re-save the adapter with peft"),
                    lv.source,
                )


@check(
    "config.rank",
    "error",
    "`r` or a `rank_pattern` value is not a positive integer, or above the fleet's `max_lora_rank` (any rank up "
    "to it is served: only `--max-lora-rank` itself is one of {1,8,16,32,64,128,256,320,512})",
    scopes=BOTH,
)
def rank(ctx: Facts):
    """vllm/lora/peft_helper.py `validate_legal` refuses `r` (0.32+: and every rank_pattern value) above
    --max-lora-rank, nothing else: the LoRA buffers are --max-lora-rank wide and a smaller adapter is copied into
    their first rows (lora/layers/base_linear.py set_lora), so r=4 serves as its zero-padded r=8 equivalent
    (measured on vLLM CPU 0.32: the same greedy tokens and logprobs). `MaxLoRARanks` (config/lora.py) lists the
    values the server flag takes (pipeline.yaml fleet.max_lora_rank is checked against it)."""
    lv, rules = ctx.lora, ctx.rules
    ranks = {lv.name("r"): lv.get("r")} | {
        f"{lv.name('rank_pattern')}[{k}]": v for k, v in (lv.get("rank_pattern") or {}).items()
    }
    for what, r in ranks.items():
        if r is None:
            continue
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            yield Issue(
                f"{what} = {r!r} is not a positive integer rank: retrain with a rank of at most the fleet's "
                f"--max-lora-rank {rules.max_lora_rank}",
                lv.source,
            )
        elif r > rules.max_lora_rank:
            yield Issue(
                f"{what} = {r} exceeds the fleet's --max-lora-rank {rules.max_lora_rank}: retrain with a smaller r "
                "or raise fleet.max_lora_rank (and --max-lora-rank on every instance)",
                lv.source,
            )


def _refused(key: str, field_name: str, feature: str):
    """One rule per feature vLLM's PEFTHelper._validate_features refuses (`REFUSED_CONFIG_KEYS`)."""
    axolotl = AXOLOTL_NAMES.get(field_name)
    doc = f"{feature}: `{field_name}`" + (f" (axolotl `{axolotl}`)" if axolotl else "")

    @check(f"config.{key}", "error", doc, scopes=BOTH)
    def rule(ctx: Facts):
        lv = ctx.lora
        value = lv.get(field_name)
        if value:
            fix = f"remove {lv.name(field_name)}" if lv.kind == "train" else "retrain without it"
            yield Issue(
                f"{lv.name(field_name)} = {value!r}: vLLM refuses {feature} (vllm/lora/peft_helper.py): {fix}",
                lv.source,
            )

    rule.__name__ = key
    return rule


for _key, _field, _feature in REFUSED_CONFIG_KEYS:
    _refused(_key, _field, _feature)


@check("config.bias", "error", "`bias` is not 'none' (vLLM needs bias 'none')", scopes=BOTH)
def bias(ctx: Facts):
    lv = ctx.lora
    if lv.get("bias", "none") != "none":
        yield Issue(f"bias = {lv.get('bias')!r}; vLLM needs bias 'none': retrain with bias='none'", lv.source)


@check(
    "config.init",
    "error",
    "`init_lora_weights` is an init whose peft method rewrites the base weights (PiSSA, OLoRA, CorDA, LoftQ, "
    "LoRA-GA), or a string peft does not know (peft raises at load, vLLM 0.32+ refuses it); derived from peft's "
    "LoraLayer: `pipeline.validate.peft_features`",
    scopes=BOTH,
)
def init(ctx: Facts):
    lv = ctx.lora
    v = lv.get("init_lora_weights", True)
    if not known_init(v):
        yield Issue(
            f"{lv.name('init_lora_weights')} = {v!r} is no init peft {peft_version()} knows (peft/tuners/lora/layer.py "
            f"LoraLayer: true, false, {', '.join(known_init_names())}): peft raises `Unknown initialization` when it creates or loads the adapter, and vLLM 0.32+ "
            "refuses it at load (lora/peft_helper.py _init_is_supported); "
            + (
                f"remove {lv.name('init_lora_weights')}"
                if lv.kind == "train"
                else "set it to the init the adapter was trained with (true for plain LoRA)"
            ),
            lv.source,
        )
        return
    method = mutates_base(v)
    if method:
        fix = (
            f"remove {lv.name('init_lora_weights')} (plain LoRA init)"
            if lv.kind == "train"
            else "convert it to a plain LoRA with peft's save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
        yield Issue(
            f"{lv.name('init_lora_weights')} = {v!r}: peft's {method} rewrites the base weights before training, so "
            "the adapter is relative to a modified base; vLLM serves it on the unmodified base (it drops or refuses "
            f"the field): {fix}",
            lv.source,
        )


@check(
    "config.variant",
    "error",
    "a PEFT LoRA variant that replaces LoRA's forward (peft LoraConfig fields tagged `is_lora_variant`: VeLoRA, "
    "MonteCLoRA, Arrow...; DoRA, aLoRA, BD-LoRA have their own ids): vLLM serves plain LoRA",
)
def variant(ctx: AdapterFacts):
    own = {f for _, f, _ in REFUSED_CONFIG_KEYS}
    for f in sorted(variant_fields() - own):
        value = ctx.cfg.raw.get(f)
        if value:
            yield Issue(
                f"{f} = {value!r}: peft runs this LoRA variant instead of plain LoRA (LoraLayer.resolve_lora_variant), "
                "vLLM drops the field and serves a plain LoRA: served output would differ from training; retrain "
                "without it",
                ctx.where_config,
            )


@check(
    "config.unknown_field",
    "error",
    "a set field the pipeline's peft `LoraConfig` does not declare (e.g. `kasa_config` from another PEFT "
    "release): vLLM drops it, so what it changes is not served",
)
def unknown_field(ctx: AdapterFacts):
    known = lora_config_fields()
    if not known:  # peft's source not found: nothing to compare with
        return
    for k, value in sorted(ctx.cfg.raw.items()):
        if k not in known and value not in (None, False, [], {}, ""):
            yield Issue(
                f"{k} = {value!r} is not a field of peft {peft_version()}'s LoraConfig (peft/tuners/lora/config.py): "
                "vLLM's PEFTHelper drops unknown fields, so whatever it changes (a variant that modifies the base, "
                "like KaSA) is not served; retrain without it, or upgrade the pipeline's peft if it is a plain-LoRA "
                "setting",
                ctx.where_config,
            )


@check(
    "config.weight_tying",
    "error",
    "`ensure_weight_tying` on a base whose word embeddings are not tied (`tie_word_embeddings` false): peft "
    "ties nothing (a warning at training time), the embed_tokens / lm_head adapters are not what the config says",
)
def weight_tying(ctx: AdapterFacts):
    if not ctx.cfg.raw.get("ensure_weight_tying"):
        return
    base = ctx.base
    tied = base.config.get("tie_word_embeddings", base.text_config.get("tie_word_embeddings", False))
    if not tied:
        yield Issue(
            f"ensure_weight_tying is true but the base {base.path} has tie_word_embeddings false: peft found no tied "
            "modules and tied nothing (peft/tuners/tuners_utils.py warns), so an adapter meant to adapt the tied "
            "embed_tokens/lm_head pair adapts only the module(s) named in target_modules, and vLLM serves exactly "
            "that; retrain with ensure_weight_tying false and both embed_tokens and lm_head targeted if both should "
            "change",
            ctx.where_config,
        )


@check(
    "config.target_parameters",
    "error",
    "`target_parameters` set (parameter LoRA for MoE experts: the "
    "dense Qwen3.5 fleet applies LoRA to modules only)",
    scopes=BOTH,
)
def target_parameters(ctx: Facts):
    lv = ctx.lora
    if lv.get("target_parameters"):
        yield Issue(
            f"{lv.name('target_parameters')} = {lv.get('target_parameters')!r}: PEFT wraps these parameters, but "
            "vLLM serves LoRA on Qwen3.5's linear modules only, so what was trained there would not be served: use "
            f"{lv.name('target_modules')}",
            lv.source,
        )


# Where PEFT finds the decoder of each Qwen3.5 class: `Qwen3_5ForCausalLM` (model.layers.N) and the class of
# the real checkpoint, `Qwen3_5ForConditionalGeneration` (model.language_model.layers.N; transformers
# models/qwen3_5/modeling_qwen3_5.py). An adapter may be trained on either.
PEFT_TEXT_PREFIXES = ("model.", "model.language_model.")


def _peft_names(base) -> list[str]:
    """The base's linear modules as PEFT names them on either class (`model.layers.N.sub`,
    `model.language_model.layers.N.sub`, `lm_head`...): fully qualified or regex `target_modules` written for
    either class match (ms-swift writes `^(model\\.language_model(?=\\.).*\\.(q_proj|...))$`)."""
    out = []
    for m, info in base.modules.items():
        if len(info.shape) != 2:
            continue
        if m.startswith("layers.") or m == "embed_tokens":
            out.extend(p + m for p in PEFT_TEXT_PREFIXES)
        elif m == "lm_head":
            out.append("lm_head")
    return sorted(out)


@check(
    "config.target_absent",
    "error",
    "a `target_modules` entry matches no module of the base (e.g. `in_proj_qkvz`, a name from another model), "
    "or `layers_to_transform` names a layer the base does not have",
    scopes=BOTH,
)
def target_absent(ctx: Facts):
    lv, base = ctx.lora, ctx.base
    names = _peft_names(base)
    layers = lv.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if isinstance(layers, list):
        beyond = sorted({i for i in layers if isinstance(i, int) and not 0 <= i < base.num_layers})
        if beyond:
            yield Issue(
                f"{lv.name('layers_to_transform')} names layer(s) {beyond} the base does not have (layers 0-"
                f"{base.num_layers - 1}): PEFT adapts nothing there; list the base's layers",
                lv.source,
            )
    targets = lv.get("target_modules")
    if targets in (None, [], ""):
        return  # config.required says so
    for entry, hits in matching_entries({"target_modules": targets}, names).items():
        if not hits:
            if isinstance(targets, str):  # PEFT: a string is one regex, fully matched against the whole name
                fix = (
                    "a string is a regular expression PEFT matches against the full module name "
                    f"(e.g. '.*\\.{entry}'), while a list ['{entry}'] matches name suffixes"
                )
            else:
                fix = "use the base's names (e.g. q_proj, in_proj_qkv, in_proj_z, out_proj, down_proj)"
            yield Issue(
                f"{lv.name('target_modules')} entry {entry!r} matches no module of the base {base.path}: PEFT would "
                f"refuse or skip it; {fix}",
                lv.source,
            )


@check(
    "config.patterns_ignored",
    "warning",
    "`rank_pattern`/`alpha_pattern` give a module another scale than "
    "alpha/r and the fleet's vLLM ignores them (0.19-0.25): publish folds the scale into lora_B",
    scopes=BOTH,
    severity_doc="warning (error on a published directory)",
)
def patterns_ignored(ctx: Facts):
    lv = ctx.lora
    try:
        rng = ctx.vllm
    except Unavailable:
        return
    if rng.honours_patterns:
        return
    r, alpha = lv.get("r"), lv.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        return
    rp, ap = lv.get("rank_pattern") or {}, lv.get("alpha_pattern") or {}
    rs = bool(lv.get("use_rslora"))

    def scale(rank, a):
        return a / math.sqrt(rank) if rs else a / rank

    want = scale(r, alpha)
    try:  # adapter: the modules in the tensors, as PEFT names them; training config: the pattern keys
        modules = ctx.modules_or_none
    except Unavailable:
        modules = None
    names = sorted({m.peft_module for m in modules}) if modules is not None else list(rp) + list(ap)
    differ = [
        k
        for k in names
        if not math.isclose(scale(int(pattern_value(rp, k, r)), float(pattern_value(ap, k, alpha))), want)
    ]
    if not differ:
        return
    published = ctx.published
    yield Issue(
        f"vLLM {ctx.rules.vllm_version} ({rng.name}) ignores rank_pattern/alpha_pattern and scales every module by "
        f"alpha/r = {want:g}, but {len(differ)} module(s) ({', '.join(sorted(differ)[:3])}...) were trained with "
        "another scale: served as-is those modules would "
        + (
            "be wrong; re-publish the registered version (publish folds the trained scale into lora_B)"
            if published
            else "be wrong. `pipeline publish` folds each module's trained scale into lora_B (per-module deltas "
            "proven identical; recorded in the manifest)"
        ),
        lv.source,
        "error" if published else None,
    )


@check(
    "config.embedding_targets",
    "error",
    "`lora_target_modules` lists embed_tokens/lm_head and the fleet "
    "does not serve embedding LoRA (`fleet.allow_embedding_targets`)",
    scopes=("train",),
)
def embedding_targets(ctx: TrainFacts):
    lv = ctx.lora
    emb = sorted(set(lv.targets) & EMBEDDING_MODULES)
    if emb and not ctx.rules.allow_embedding_targets:
        yield Issue(
            f"{lv.name('target_modules')} includes {emb}; not servable by a hot-loading fleet", lv.source
        )
