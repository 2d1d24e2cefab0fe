"""Tensor names: vLLM's key grammar, module pairing, the base's modules and shapes, and what the served
vLLM version applies. The module set from the config (PEFT's matching), the set in the tensors and the
set the served version applies must be the same.

Checks run in registration order; one that refuses a module calls `ctx.reject(m)` so later checks do not
report it again. Sources: vllm/lora/utils.py (`parse_fine_tuned_lora_name`, `is_in_target_modules`),
vllm/model_executor/models/qwen3_5.py (modules, packing, weight mapper), peft `check_target_module_exists`.
"""

from __future__ import annotations

from pipeline.artifacts.peft_match import peft_targets
from pipeline.serving.modules import runtime_target, served_key_prefix
from pipeline.serving.vllm import EMBEDDING_MODULES, fleet_applies, runtime_module
from pipeline.validate.facts import AdapterFacts
from pipeline.validate.rules import Issue, Unavailable, check, grouped


def ranges(xs) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    xs = sorted(set(xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _where(ctx, m) -> str:
    return f"{ctx.wfile}:{m.module}"


@check(
    "keys.unknown", "error", "a tensor that is no LoRA A/B factor (e.g. a base weight saved into the adapter)"
)
def unknown(ctx: AdapterFacts):
    for name in ctx.unknown_tensors:
        yield Issue(
            "not a LoRA A/B tensor name (expected ...<module>.lora_A.weight): remove it or re-save with peft",
            f"{ctx.wfile}:{name}",
        )


@check(
    "keys.base_copy",
    "error",
    "peft's copy of the base embed_tokens/lm_head (`...base_layer.weight`, saved when they are targeted) differs "
    "from the base in shape or values: vLLM skips these tensors (lora/utils.py is_base_embedding_weights), so a "
    "resized or trained embedding is not served; an exact copy is a warning (bytes nobody reads)",
    severity_doc="error (warning for an exact copy)",
)
def base_copy(ctx: AdapterFacts):
    copies = ctx.base_copies
    if not copies:
        return
    exact = []
    for name in sorted(copies):
        why = ctx.base_copy_difference(name)
        if why is None:
            exact.append(name)
            continue
        yield Issue(
            f"{name}: {why}. peft saved this copy of the base layer because embed_tokens/lm_head were targeted, and "
            "would load it over the base; vLLM skips it (lora/utils.py is_base_embedding_weights) and serves the "
            "base's own weights, so training and serving differ (a resized vocabulary or trained embeddings): "
            "retrain on the served tokenizer with embed_tokens/lm_head adapted by LoRA only",
            f"{ctx.wfile}:{name}",
        )
    if exact:
        size = sum(copies[n].nbytes for n in exact)
        yield Issue(
            f"{len(exact)} copies of the base's embedding weights ({size:,} bytes, e.g. {exact[0]}): identical to the "
            "base and skipped by vLLM (lora/utils.py is_base_embedding_weights), but copied to the registry and every "
            "published version; re-save with save_pretrained(save_embedding_layers=False)",
            f"{ctx.wfile}:{exact[0]}",
            "warning",
        )


@check(
    "keys.grammar",
    "error",
    "a LoRA tensor name vLLM's parser refuses (`lora_A.default.weight`, `lora_A` without `.weight`...)",
)
def grammar(ctx: AdapterFacts):
    yield from grouped(
        Issue(
            f"{why}: vLLM refuses to load the adapter (HTTP 500); re-save it with peft's save_pretrained, which "
            "writes `<module>.lora_A.weight`",
            f"{ctx.wfile}:{name}",
        )
        for name, why in ctx.malformed_tensors.items()
        if "bias" not in why
    )


@check(
    "keys.bias",
    "error",
    "`lora_B.bias` tensors (lora_bias): PEFT drops them when `lora_bias` is false, vLLM refuses them",
)
def bias_tensors(ctx: AdapterFacts):
    names = [n for n, why in ctx.malformed_tensors.items() if "bias" in why]
    if names:
        lb = ctx.config_fact.value.raw.get("lora_bias") if ctx.config_fact.known else None
        yield Issue(
            f"{len(names)} LoRA bias tensor(s), e.g. {names[0]} (adapter_config.json lora_bias = {lb!r}): vLLM "
            "refuses LoRA bias (HTTP 500 at load) and PEFT ignores them unless lora_bias is true; retrain without "
            "LoRA bias",
            str(ctx.wfile),
        )


@check("keys.pair", "error", "lora_A without lora_B (or the reverse)")
def pair(ctx: AdapterFacts):
    for m in ctx.live():
        if m.a is None or m.b is None:
            ctx.reject(m)
            missing = "lora_B" if m.b is None else "lora_A"
            yield Issue(
                f"{missing} missing for {m.module}: the adapter is truncated or mis-saved; re-save it from the "
                "training output",
                _where(ctx, m),
            )


@check(
    "keys.embedding",
    "error",
    "embed_tokens/lm_head LoRA while the fleet does not serve it "
    "(`fleet.allow_embedding_targets`, and vLLM 0.19-0.25 reject it)",
)
def embedding(ctx: AdapterFacts):
    for m in ctx.live():
        if m.head not in EMBEDDING_MODULES:
            continue
        if not ctx.rules.allow_embedding_targets:
            ctx.reject(m)
            yield Issue(
                f"{m.module} LoRA: the fleet does not serve embedding/lm_head adapters (fleet.allow_embedding_targets): "
                "retrain without it in lora_target_modules",
                _where(ctx, m),
            )
            continue
        try:
            rng = ctx.vllm
        except Unavailable:
            ctx.reject(m)
            continue
        if not rng.embedding_lora:
            ctx.reject(m)
            yield Issue(
                f"{m.module} LoRA: vLLM {ctx.rules.vllm_version} ({rng.name}) has no embedding LoRA for Qwen3.5 "
                "(empty embedding_modules): retrain without it, or upgrade the fleet to 0.32+",
                _where(ctx, m),
            )


@check(
    "keys.embedding_shape",
    "error",
    "served embed_tokens/lm_head LoRA whose shapes do not fit the base's vocabulary and hidden size "
    "(`lora_embedding_A` [r, vocab], `lora_embedding_B` [hidden, r]; lm_head `lora_A` [r, hidden], "
    "`lora_B` [vocab, r]): vLLM raises at load (lora/lora_model.py) or applies part of it",
)
def embedding_shape(ctx: AdapterFacts):
    """vllm/lora/lora_model.py from_lora_tensors (0.32+): `lora_embedding_A` whose shape[1] differs from the
    model's vocabulary raises RuntimeError at load; an lm_head `lora_B` of another vocabulary does not fit
    the logits wrapper's buffers (lora/layers/logits_processor.py)."""
    found = [m for m in ctx.live() if m.head in EMBEDDING_MODULES]
    for m in found:
        ctx.reject(m)  # no decoder-layer module: the later module/shape checks do not apply
    base = ctx.base
    vocab = base.text_config.get("vocab_size")
    emb = base.modules.get("embed_tokens")
    hidden = base.text_config.get("hidden_size") or (emb.shape[1] if emb is not None else None)
    for m in found:
        if m.a is None or m.b is None:
            continue
        a, b = list(m.a.shape), list(m.b.shape)
        if m.head == "embed_tokens":
            want_a, want_b = [a[0] if a else None, vocab], [hidden, b[1] if len(b) == 2 else None]
            names = ("lora_embedding_A", "lora_embedding_B")
        else:
            want_a, want_b = [a[0] if a else None, hidden], [vocab, b[1] if len(b) == 2 else None]
            names = ("lora_A", "lora_B")
        for name, have, want in ((names[0], a, want_a), (names[1], b, want_b)):
            if len(have) != 2 or have != want:
                yield Issue(
                    f"{m.module} {name} is {have} but the base has vocabulary {vocab} and hidden size {hidden} "
                    f"(expected {want}): vLLM refuses or mis-applies it at load (the embedding LoRA must match the "
                    "served vocabulary); retrain on this base's tokenizer without added tokens",
                    f"{ctx.wfile}:{m.module}",
                )


@check("keys.mtp", "error", "`mtp.*` LoRA (vLLM's MTP drafter has none: loads, never applied)")
def mtp(ctx: AdapterFacts):
    for m in ctx.live():
        if m.head == "mtp":
            ctx.reject(m)
            yield Issue(
                f"{m.module}: vLLM's MTP drafter has no LoRA support; drop mtp.* from the targets and retrain",
                _where(ctx, m),
            )


@check("keys.visual", "error", "vision-tower LoRA (accepted by vLLM, never applied on a text fleet)")
def visual(ctx: AdapterFacts):
    for m in ctx.live():
        if m.head == "visual":
            ctx.reject(m)
            yield Issue(
                f"{m.module}: vision-tower LoRA is not served by a text fleet: restrict lora_target_modules to "
                "language-model modules",
                _where(ctx, m),
            )


@check("keys.conv1d", "error", "`conv1d` LoRA (vLLM's kernel reads the weight directly: no effect)")
def conv1d(ctx: AdapterFacts):
    for m in ctx.live():
        if m.sub and m.sub.endswith("conv1d"):
            ctx.reject(m)
            yield Issue(
                f"{m.module}: vLLM accepts conv1d LoRA but applies nothing: drop conv1d from lora_target_modules and "
                "retrain",
                _where(ctx, m),
            )


@check("keys.layer", "error", "a layer index >= the base's layer count")
def layer(ctx: AdapterFacts):
    n = ctx.base.num_layers
    beyond = [m for m in ctx.live() if m.layer is not None and m.layer >= n]
    for m in beyond:
        ctx.reject(m)
    if beyond:
        layers = sorted({m.layer for m in beyond})
        yield Issue(
            f"layer{'s' if len(layers) > 1 else ''} {ranges(layers)} >= the base's {n} layers ({len(beyond)} "
            "modules): the adapter is for another base; retrain on this one",
            _where(ctx, beyond[0]),
        )


@check(
    "keys.module",
    "error",
    "not a decoder-layer module, or a module that layer type lacks (q_proj only on "
    "full attention, in_proj_* only on Gated DeltaNet)",
)
def module(ctx: AdapterFacts):
    for m in ctx.live():
        if m.layer is None:
            ctx.reject(m)
            yield Issue(
                f"{m.module} is not a decoder-layer module of the base: remove it from the targets",
                _where(ctx, m),
            )
    try:
        base = ctx.base
    except Unavailable:
        return
    for m in ctx.live():
        allowed = ctx.allowed_modules(m.layer)
        lt = base.layer_types[m.layer] if m.layer < len(base.layer_types) else "?"
        if m.sub not in allowed:
            ctx.reject(m)
            yield Issue(
                f"{m.sub} does not exist on layer {m.layer} ({lt}) or vLLM cannot patch it; modules on {lt} layers: "
                f"{sorted(allowed)}",
                _where(ctx, m),
            )
        elif base.linear_shape(m.module) is None:
            ctx.reject(m)
            yield Issue(
                f"base has no 2-D weight for {m.module}: the adapter is for another base", _where(ctx, m)
            )


@check("keys.shape", "error", "A/B shapes do not fit the base's `[out, in]`, or A and B disagree on the rank")
def shape(ctx: AdapterFacts):
    base = ctx.base
    for m in ctx.live():
        out_f, in_f = base.linear_shape(m.module)
        a, b = m.a.shape, m.b.shape
        if len(a) != 2 or a[1] != in_f:
            msg = (
                f"lora_A {list(a)} does not fit base in_features {in_f} (expected [r, {in_f}]): adapter for "
                "another base; retrain on this base"
            )
        elif len(b) != 2 or b[0] != out_f:
            msg = (
                f"lora_B {list(b)} does not fit base out_features {out_f} (expected [{out_f}, r]): adapter for "
                "another base; retrain on this base"
            )
        elif b[1] != a[0]:
            msg = f"lora_A rank {a[0]} != lora_B rank {b[1]}: mis-saved adapter"
        else:
            continue
        ctx.reject(m)
        yield Issue(msg, _where(ctx, m))


@check(
    "keys.rank", "error", "a tensor's rank differs from `r` / `rank_pattern` (served with the wrong scale)"
)
def rank(ctx: AdapterFacts):
    cfg = ctx.typed_cfg
    found = []
    for m in ctx.live():
        want = cfg.rank_for(m.peft_module)
        if want < 1:
            continue  # no rank is right for `r` <= 0: config.rank reports the config once
        if m.rank is not None and m.rank != want:
            ctx.reject(m)
            found.append(
                Issue(
                    f"tensor rank {m.rank} != configured r {want} (rank_pattern honoured): vLLM would serve it with "
                    "the wrong scale; set r (or rank_pattern) in adapter_config.json to the tensors' rank",
                    _where(ctx, m),
                )
            )
    yield from grouped(found, "modules")


@check(
    "keys.fleet_targets",
    "error",
    "a module outside `--lora-target-modules` as the fleet's vLLM matches it (0.19: runtime names only, "
    "`qkv_proj` not `q_proj`; 0.20+: packed-aware, listing `q_proj` opens `qkv_proj`)",
)
def fleet_targets(ctx: AdapterFacts):
    rng, targets = ctx.vllm, ctx.rules.lora_target_modules
    live = ctx.live()
    outside: dict[str, list[int]] = {}
    for m in live:
        short = m.sub.split(".")[-1]
        if not fleet_applies(short, targets, rng):
            outside.setdefault(short, []).append(m.layer)
    if not outside:
        return
    dropped = sum(len(v) for v in outside.values())
    runtime_only = not rng.target_modules_packed_aware
    parts = []
    for short, layers in sorted(outside.items()):
        runtime = runtime_module(short, rng)
        via = f" (applied through {runtime!r})" if runtime_only and runtime != short else ""
        parts.append(f"{short}{via} on layers {ranges(layers)}")
    needed = sorted({runtime_module(s, rng) if runtime_only else s for s in outside})
    how = (
        f"vLLM {ctx.rules.vllm_version} ({rng.name}) matches --lora-target-modules against its runtime module names "
        "only (lora/utils.py is_in_target_modules), not the adapter's PEFT names: "
        if runtime_only
        else ""
    )
    yield Issue(
        f"{dropped} of {len(live)} adapted modules are outside the fleet's --lora-target-modules {targets}: "
        f"{'; '.join(parts)}. vLLM loads the adapter and silently does not apply them; {how}add {needed} to "
        "fleet.lora_target_modules (and the instances' flags) or retrain without them",
        str(ctx.wfile),
    )


_GDN_PAIR = ("in_proj_qkv", "in_proj_z")  # the adapter modules vLLM packs into the fused in_proj_qkvz


@check(
    "keys.gdn_partial",
    "error",
    "`in_proj_qkv` adapted without `in_proj_z` on a layer (or the reverse) where the fleet's vLLM crashes "
    "activating it (0.21-0.27 either way, vllm#47639; 0.32-0.33 `in_proj_z` alone)",
)
def gdn_partial(ctx: AdapterFacts):
    """vllm/lora/layers/column_parallel_linear.py `expand_packed_lora` (0.21+) splits the adapter's two GDN
    groups over the fused layer's 4 slices; a missing member is None and `b_i.shape` raises (0.21-0.27); from
    0.32 a missing in_proj_z is a placeholder, but a missing in_proj_qkv covers every slice and in_proj_z
    finds none (ValueError). 0.19/0.20 split the fused layer when LoRA is on: no crash."""
    rng = ctx.vllm
    by_layer: dict[int, set[str]] = {}
    for m in ctx.live():
        short = m.sub.split(".")[-1]
        if short in _GDN_PAIR:
            by_layer.setdefault(m.layer, set()).add(short)
    alone: dict[str, list[int]] = {}
    for layer, have in by_layer.items():
        if len(have) == 1 and (only := next(iter(have))) in rng.gdn_partial_crash:
            alone.setdefault(only, []).append(layer)
    for only, layers in sorted(alone.items()):
        other = next(x for x in _GDN_PAIR if x != only)
        yield Issue(
            f"{only} is adapted without {other} on layers {ranges(layers)}: vLLM {ctx.rules.vllm_version} "
            f"({rng.name}) packs both into in_proj_qkvz and crashes activating this adapter "
            "(lora/layers/column_parallel_linear.py expand_packed_lora; vllm-project/vllm#47639); retrain with "
            f"both {only} and {other} in lora_target_modules (or neither)",
            str(ctx.wfile),
        )


@check(
    "keys.fully_sharded",
    "error",
    "`in_proj_qkv` LoRA on a fleet started with `--fully-sharded-loras` whose vLLM skips it (0.19.x: no sharded "
    "wrapper for the 3-slice layer)",
)
def fully_sharded(ctx: AdapterFacts):
    rng = ctx.vllm
    if not (ctx.rules.fully_sharded_loras and rng.fully_sharded_skips_in_proj_qkv):
        return
    layers = [m.layer for m in ctx.live() if m.sub and m.sub.endswith("in_proj_qkv")]
    if layers:
        yield Issue(
            f"in_proj_qkv is adapted on layers {ranges(layers)} but vLLM {ctx.rules.vllm_version} ({rng.name}) with "
            "--fully-sharded-loras has no sharded LoRA wrapper for the 3-slice in_proj_qkv "
            "(lora/layers/column_parallel_linear.py) and silently serves those modules without the adapter: "
            "start the instances without --fully-sharded-loras (fleet.fully_sharded_loras: false) or upgrade "
            "the fleet to 0.20+",
            str(ctx.wfile),
        )


@check(
    "keys.mixed_layout",
    "error",
    "the same module under both the text (`model.layers.N`) and the VL "
    "(`model.language_model.layers.N`) prefix",
)
def mixed_layout(ctx: AdapterFacts):
    seen: dict[str, list] = {}
    for m in ctx.live():
        seen.setdefault(m.module, []).append(m)
    for module, ms in sorted(seen.items()):
        if len(ms) > 1:
            for m in ms:
                ctx.reject(m)
            yield Issue(
                f"{module} is stored under {len(ms)} prefixes ({', '.join(m.peft_module for m in ms)}): which one "
                "vLLM applies depends on the served class; re-save the adapter from the training output",
                str(ctx.wfile),
            )


@check(
    "keys.served_layout",
    "warning",
    "keys in a layout the served class never applies (text-layout "
    "`model.layers.N` keys against `Qwen3_5ForConditionalGeneration`): they load and change nothing; publish "
    "renames them (parity proven)",
    severity_doc="warning (error on a published directory)",
)
def served_layout(ctx: AdapterFacts):
    """The served class is the served checkpoint's; without one, the only class the fleet's vLLM registers for
    qwen3_5 (0.19-0.26: the VL class, whatever checkpoint the instances were started on)."""
    rng, arch = ctx.vllm, ctx.serving_architecture
    prefix = served_key_prefix(arch)
    if prefix is None or arch not in rng.qwen35_classes:
        return
    wrong = [m for m in ctx.live() if runtime_target(m.peft_module, arch, rng).status != "applied"]
    if not wrong:
        return
    mixed = len(wrong) < len(ctx.live())
    first = wrong[0].peft_module
    inferred = (
        f" (no served checkpoint given: {arch} is the only class vLLM {rng.name} registers for qwen3_5)"
        if ctx.served_dir is None
        else ""
    )
    what = (
        f"{len(wrong)} of {len(ctx.live())} modules (e.g. {first}) are keyed in a layout {arch} never applies on "
        f"vLLM {ctx.rules.vllm_version} ({rng.name}){inferred}: they load with HTTP 200 and change nothing"
        + (" (the adapter mixes layouts)" if mixed else "")
        + f"; the served layout is {prefix}N"
    )
    if ctx.published:
        yield Issue(
            f"{what}: re-publish from the registry (publish renames the keys)", str(ctx.wfile), "error"
        )
    else:
        yield Issue(
            f"{what}. `pipeline publish` renames the keys to {prefix}N (tensors byte-identical, parity "
            "proven, recorded in the manifest)",
            str(ctx.wfile),
        )


def _layout_prefix(ctx) -> str:
    layouts = {m.layout for m in ctx.modules if m.layout}
    return "model.language_model." if layouts == {"vl"} else "model."


def _expected(ctx) -> dict[str, set[int]]:
    """{sub: layers} where PEFT's matching of the config puts a LoRA on the base's LoRA-able modules."""
    cfg, base = ctx.typed_cfg, ctx.base
    prefix = _layout_prefix(ctx)
    out: dict[str, set[int]] = {}
    for i in range(base.num_layers):
        for sub in ctx.base_layer_modules[i] & ctx.allowed_modules(i):
            if peft_targets(cfg.raw, f"{prefix}layers.{i}.{sub}"):
                out.setdefault(sub, set()).add(i)
    return out


def _present(ctx, *, rejected_too: bool = False) -> dict[str, set[int]]:
    """{sub: layers} with tensors; `rejected_too` counts modules another keys check refused (their
    tensors exist: that check already says what is wrong with them, so coverage must not say it again)."""
    out: dict[str, set[int]] = {}
    for m in ctx.modules if rejected_too else ctx.live():
        if m.sub is not None:
            out.setdefault(m.sub, set()).add(m.layer)
    return out


@check(
    "keys.not_targeted",
    "error",
    "tensors for modules PEFT's matching of the config does not target "
    "(`target_modules`, `layers_to_transform`, `layers_pattern`, `exclude_modules`): PEFT would not apply them, "
    "vLLM would",
)
def not_targeted(ctx: AdapterFacts):
    cfg = ctx.typed_cfg
    for m in ctx.modules:  # embed_tokens / lm_head: left out of the decoder-layer sets below
        if m.head in EMBEDDING_MODULES and m.layer is None and not cfg.targets(m.peft_module):
            rng = ctx.vllm_fact.value
            served = ctx.rules.allow_embedding_targets and rng is not None and rng.embedding_lora
            yield Issue(
                f"tensors adapt {m.peft_module} but adapter_config.json does not target it (target_modules "
                f"{cfg.raw.get('target_modules')!r}): PEFT would not apply them"
                + (", and the fleet's vLLM would, so training and serving differ" if served else "")
                + "; fix adapter_config.json or re-save the adapter",
                f"{ctx.wfile}:{m.module}",
            )
    expected, present = _expected(ctx), _present(ctx)
    for sub, layers in sorted(present.items()):
        extra = layers - expected.get(sub, set())
        if extra:
            yield Issue(
                f"tensors adapt {sub} on layers {ranges(extra)} but adapter_config.json does not target them (PEFT's "
                "target_modules / layers_to_transform / exclude_modules matching): PEFT would skip them and vLLM "
                "would apply them, so training and serving differ; fix adapter_config.json or re-save the adapter",
                ctx.where_config,
            )


@check("keys.declared_absent", "error", "the config targets a module type no tensor adapts")
def declared_absent(ctx: AdapterFacts):
    expected, present = _expected(ctx), _present(ctx, rejected_too=True)
    for sub in sorted(set(expected) - set(present)):
        yield Issue(
            f"target_modules covers {sub} (layers {ranges(expected[sub])}) but no tensor adapts it: the adapter was "
            "mis-saved or target_modules is wrong",
            ctx.where_config,
        )


@check("keys.partial", "error", "a targeted module type is missing on some layers (partial coverage)")
def partial(ctx: AdapterFacts):
    expected, present = _expected(ctx), _present(ctx, rejected_too=True)
    for sub, layers in sorted(present.items()):
        missing = sorted(expected.get(sub, set()) - layers)
        # no layer in range at all: keys.layer already names the indices the tensors use
        if sub in expected and missing and layers & expected[sub]:
            yield Issue(
                f"partial adapter: {sub} adapted on {len(layers & expected[sub])} of {len(expected[sub])} layers; "
                f"missing on layers {ranges(missing)}: re-save from the training output or set layers_to_transform",
                ctx.where_config,
            )
