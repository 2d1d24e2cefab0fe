"""Tokenizer and chat-template checks (the facts and rendering live in `pipeline.validate.template`).

Shared by `pipeline validate` (adapter tokenizer files, the run's resolved config, the served checkpoint)
and `pipeline train` (the axolotl config's template and special tokens, the base tokenizer, served.path).
"""

from __future__ import annotations

from pipeline.validate.facts import AdapterFacts, Facts
from pipeline.validate.rules import Issue, check
from pipeline.validate.template import CONTEXT_TOKENS, CONVERSATIONS, turn_terminator

BOTH = ("adapter", "train")


# -- checks -------------------------------------------------------------------------------------------------------
@check("tokenizer.unreadable", "error", "tokenizer files shipped with the adapter cannot be loaded")
def unreadable(ctx: AdapterFacts):
    err = ctx.adapter_tokenizer.missing
    if err:
        yield Issue(f"{err}: remove them or copy the served base's", str(ctx.adapter_dir))


@check(
    "tokenizer.served_unreadable",
    "error",
    "the served (or base) checkpoint's tokenizer files cannot be loaded (e.g. corrupt tokenizer.json)",
    scopes=BOTH,
)
def served_unreadable(ctx: Facts):
    err = ctx.served_tokenizer.missing
    if err:
        yield Issue(
            f"{err}: vLLM could not load it either; re-copy the served checkpoint's tokenizer files",
            str(ctx.served_tokenizer_dir),
        )


@check(
    "tokenizer.added_tokens",
    "error",
    "the training tokenizer adds tokens the served base lacks (adapter "
    "tokenizer files; axolotl `special_tokens`/`tokens`)",
    scopes=BOTH,
)
def added_tokens(ctx: Facts):
    added, where = ctx.added_tokens.tokens, ctx.added_tokens.where
    if added:
        yield Issue(
            f"the training tokenizer adds {len(added)} token(s) the served base lacks, e.g. {added[:5]}: they have no "
            "trained embedding in the served model; retrain without adding tokens (no `tokens:`/`special_tokens` "
            "additions in the axolotl config)",
            where,
        )


@check("tokenizer.vocab", "error", "the adapter's tokenizer has another vocabulary than the served one")
def vocab(ctx: AdapterFacts):
    atok, served = ctx.adapter_tokenizer.value, ctx.served_tokenizer.value
    if atok is None or served is None:
        return
    av, sv = atok.vocab(), served.vocab()
    added = {t for t in atok.added() if t not in served.added()}
    other = sorted((i, t) for t, i in av.items() if t not in sv and t not in added)
    moved = sorted((av[t], t, sv[t]) for t in av.keys() & sv.keys() if av[t] != sv[t])
    lacking = sorted((i, t) for t, i in sv.items() if t not in av)
    if other or moved or lacking:
        first = (
            other[:3]
            or [(i, f"{t} (served id {j})") for i, t, j in moved[:3]]
            or [(i, f"{t} (only in served)") for i, t in lacking[:3]]
        )
        yield Issue(
            f"vocabulary differs from the served base ({len(av)} vs {len(sv)} tokens; first differences {first}): the "
            f"adapter was trained with another tokenizer; retrain with the served base's tokenizer ({served.path})",
            str(ctx.adapter_dir / "tokenizer.json"),
        )


@check("template.unchecked", "info", "no training template or no served tokenizer to compare with")
def unchecked(ctx: AdapterFacts):
    reason = ctx.template_unchecked
    if reason:
        yield Issue(reason, ctx.training_where)


@check("template.training", "error", "the training chat template cannot be resolved", scopes=BOTH)
def training(ctx: Facts):
    err = ctx.training.missing
    if err:
        yield Issue(
            f"cannot resolve the training chat template ({err}): fix chat_template in the training config "
            "(or pass --training-config with the run's resolved.yml)",
            ctx.training_where,
        )


@check("template.served_missing", "error", "the served tokenizer has no chat template", scopes=BOTH)
def served_missing(ctx: Facts):
    served = ctx.served_tokenizer.value
    if served is not None and ctx.training.known and not served.template:
        yield Issue(
            f"the served tokenizer ({served.path}) has no chat template: vLLM chat requests would fail; ship "
            "chat_template.jinja with the served checkpoint",
            str(served.path),
        )


@check(
    "template.render", "error", "a fixed conversation fails to render with one of the templates", scopes=BOTH
)
def render_fails(ctx: Facts):
    cmp = ctx.template_comparison
    for name, err in cmp.failed:
        yield Issue(
            f"conversation {name!r} does not render ({err}): the two templates do not support the same messages; "
            "serve with the training template",
            cmp.where,
        )


@check(
    "template.divergence",
    "error",
    "a fixed conversation (plain, multi-turn, system, tool call + result, "
    "reasoning) or its generation prompt tokenizes differently with the training vs served template",
    scopes=BOTH,
)
def divergence(ctx: Facts):
    cmp = ctx.template_comparison
    diverged, where, train, served = cmp.diverged, cmp.where, cmp.train, cmp.served
    ctx.stats["template_conversations"] = {
        "rendered": len(CONVERSATIONS),
        "diverged": sorted({n.split(" (")[0] for n, *_ in diverged}),
    }
    ctx.stats["template_source"] = {"training": train.source, "served": str(served.path)}
    ttok = train.tokenizer or served
    for name, a, b, i in diverged:
        ctx_txt = ttok.decode(a[max(0, i - CONTEXT_TOKENS) : i])
        yield Issue(
            f"conversation {name!r}: token {i} differs; after {ctx_txt!r} training renders "
            f"{ttok.decode(a[i : i + CONTEXT_TOKENS])!r} but the fleet renders "
            f"{served.decode(b[i : i + CONTEXT_TOKENS])!r}: "
            + (
                f"training rendered it with chat_template_kwargs {train.kwargs} (axolotl), which vLLM applies only "
                "to requests that send them: have every client send them (or the instances' "
                "--default-chat-template-kwargs), or retrain without them"
                if train.kwargs
                else "serve with the training template (vLLM --chat-template) or retrain with the served "
                "checkpoint's template"
            ),
            where,
        )


@check(
    "template.eos_terminator",
    "error",
    "the token ending an assistant turn is not the training tokenizer's "
    "`eos_token` (axolotl then never trains it: the adapter does not stop) or not one the served engine stops at",
    scopes=BOTH,
)
def eos_terminator(ctx: Facts):
    train, served = ctx.training.value, ctx.served_tokenizer.value
    if train is None:
        return
    tok = train.tokenizer or served
    if tok is None:
        return
    try:
        term = turn_terminator(tok, train.template)
    except Exception:  # noqa: BLE001 - a template that does not render is template.render's finding
        return
    if term is None:
        return
    eos = tok.special.get("eos_token")
    if train.tokenizer is not None and eos != term:
        yield Issue(
            f"assistant turns end with {term!r} but the training tokenizer's eos_token is {eos!r}: axolotl trains the "
            "EOS token at the end of each turn, so the turn terminator is never learned and the adapter does not stop "
            f"(it loops, e.g. on tool calls); set eos_token to {term!r} (axolotl `special_tokens: {{eos_token: "
            f'"{term}"}}`) and retrain',
            train.source,
        )
    if served is not None:
        tid = served.tokenizer.token_to_id(term)
        if tid is not None and served.eos_ids and tid not in served.eos_ids:
            yield Issue(
                f"assistant turns end with {term!r} (id {tid}) but the served checkpoint stops only at ids "
                f"{sorted(served.eos_ids)} (eos_token / generation_config.json eos_token_id): generation would run "
                f"past the turn; add {tid} to the served generation_config.json eos_token_id",
                str(served.path),
            )
