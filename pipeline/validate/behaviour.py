"""Behavioural checks (`pipeline validate --behaviour`): the adapter changes the model, for the better.

Loads the bf16 base with transformers and the adapter with peft (CPU for tiny models; a GPU
if torch sees one), then
- eval loss: mean negative log-likelihood (nats per token) of the assistant turns of the
  validation set, with the adapter and with it disabled; the adapter must not be worse;
- canaries: greedy continuations of fixed prompts must differ from the base's somewhere
  (identical outputs mean the adapter is not applied: zero/near-zero B, wrong scale, or keys
  that do not match the base's module names);
- MTP acceptance: the base's MTP layer drafting for the base and for base + adapter on the validation
  prompts (`pipeline.validate.acceptance`; its rule `behaviour.acceptance` lives there).

Assistant tokens are found by rendering conversation prefixes with the base tokenizer's
chat template (the tiny template is prefix-stable, like axolotl's masking assumes).
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.artifacts.bounded import MIB, loads_json
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.artifacts.peft_model import load_peft
from pipeline.validate import acceptance
from pipeline.validate.chat import render_hf
from pipeline.validate.facts import AdapterFacts
from pipeline.validate.rules import Issue, check

MAX_NEW_TOKENS = 8
BATCH = 8
MAX_EVAL_CONVERSATIONS = 64
CANARIES = [
    [{"role": "user", "content": "What is the weather in Tokyo right now?"}],
    [
        {"role": "system", "content": "You are a careful operations agent."},
        {"role": "user", "content": "How many rows in invoices were created yesterday?"},
    ],
    [{"role": "user", "content": "Find docs about nvfp4."}],
]


def listed_validation_files(adapter_dir: Path) -> list[Path]:
    """The validation JSONL files the adapter's manifest.json lists (none without a readable manifest)."""
    try:
        return read_adapter_manifest(adapter_dir).dataset.validation_files()
    except (FileNotFoundError, ValueError):
        return []


def validation_files_from_manifest(adapter_dir: Path) -> list[Path]:
    """The validation JSONL files recorded in the adapter's manifest.json (those that still exist)."""
    return [f for f in listed_validation_files(adapter_dir) if f.is_file()]


def _conversations(files: list[Path]) -> list[dict]:
    out = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                out.append(loads_json(line, str(f), 16 * MIB))  # BoundsError: a ValueError naming the file
    return out[:MAX_EVAL_CONVERSATIONS]


def _assistant_mask(tok, messages, tools) -> tuple[list[int], list[int]]:
    """(input ids, 1 for tokens of assistant turns) by rendering growing prefixes."""

    def ids(msgs):
        text = render_hf(tok, msgs, tools)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    full = ids(messages)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start, end = len(ids(messages[:i])) if i else 0, len(ids(messages[: i + 1]))
        for j in range(start, min(end, len(full))):
            mask[j] = 1
    return full, mask


def _batches(items, n):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _forward_logprobs(model, seqs: list[list[int]], pad_id: int):
    """Right-padded batched forward; yields (sequence index, log-softmax [len-1, vocab]) per sequence.

    Right padding is exact for a causal model: pad tokens come after every real token.
    """
    import torch

    for chunk_start, batch in zip(range(0, len(seqs), BATCH), _batches(seqs, BATCH), strict=True):
        width = max(len(s) for s in batch)
        x = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            x[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=x, attention_mask=mask).logits.float()
        for i, s in enumerate(batch):
            yield chunk_start + i, torch.log_softmax(logits[i, : len(s) - 1], -1)


def eval_loss(model, tok, conversations: list[dict]) -> tuple[float, int]:
    """Mean NLL (nats/token) over assistant tokens, and the token count."""
    import torch

    seqs, masks = [], []
    for conv in conversations:
        ids, mask = _assistant_mask(tok, conv["messages"], conv.get("tools"))
        if sum(mask[1:]) and len(ids) >= 2:
            seqs.append(ids)
            masks.append(mask)
    total, count = 0.0, 0
    for i, lp in _forward_logprobs(model, seqs, tok.pad_token_id or 0):
        target = torch.tensor(seqs[i][1:])
        m = torch.tensor(masks[i][1:], dtype=torch.bool)
        total -= float(lp[m].gather(1, target[m].unsqueeze(1)).sum())
        count += int(m.sum())
    return (total / count if count else math.nan), count


def _prompt_ids(tok, msgs) -> list[int]:
    text = render_hf(tok, msgs, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def greedy(model, tok, prompts=None, max_new_tokens: int | None = None) -> list[list[int]]:
    """Greedy continuations (token ids) of each prompt, generated as one left-padded batch.

    Left padding is exact for Qwen3.5 in transformers: padded positions are masked in attention
    and zeroed before the Gated DeltaNet recurrence (checked against one-by-one generation).
    """
    import torch

    prompts = CANARIES if prompts is None else prompts
    ids = [_prompt_ids(tok, m) for m in prompts]
    width, pad = max(map(len, ids)), tok.pad_token_id or 0
    x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    with torch.inference_mode():
        y = model.generate(
            input_ids=x,
            attention_mask=mask,
            max_new_tokens=max_new_tokens or MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos, tok.eos_token_id])
    out = []
    for row in y[:, width:].tolist():  # cut at the first EOS: later positions are padding
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:cut])
    return out


def greedy_matches(model, tok, prompts, continuations: list[list[int]]) -> list[bool]:
    """Whether `model`'s greedy output equals `continuations`, by one teacher-forced batched forward.

    Exact: greedy decoding reproduces a continuation iff at every step the argmax given the same
    prefix is the continuation's next token.
    """
    prompt_ids = [_prompt_ids(tok, m) for m in prompts]
    seqs = [p + c for p, c in zip(prompt_ids, continuations, strict=True)]
    out = [False] * len(seqs)
    for i, lp in _forward_logprobs(model, seqs, tok.pad_token_id or 0):
        n = len(prompt_ids[i])
        pred = lp[n - 1 :].argmax(-1).tolist()[: len(continuations[i])]
        out[i] = pred == continuations[i]
    return out


class BehaviourUnavailable(Exception):
    """Base + adapter cannot be loaded with transformers/peft (message says why)."""


def evaluate(adapter_dir: Path, base_dir: Path, validation_files: list[Path] | None = None) -> dict:
    """Load base + adapter and measure: {eval_loss_base, eval_loss_adapter, eval_tokens, conversations,
    validation_files, canaries_identical, acceptance (`acceptance.measure`: the MTP estimate or why not)}.
    Raises BehaviourUnavailable."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(base_dir))
        # the class whose modules the adapter's keys name; a load leaving a tensor unapplied raises
        model = load_peft(base_dir, adapter_dir, "float32")
    except Exception as e:  # noqa: BLE001 - e.g. a VL-layout base transformers cannot load as a causal LM
        raise BehaviourUnavailable(
            f"cannot load base + adapter with transformers/peft ({type(e).__name__}: {e}): pass --base with a "
            "transformers-loadable checkpoint"
        ) from e
    model.eval()
    missing = []
    if validation_files is None:
        listed = listed_validation_files(adapter_dir)
        missing = [str(f) for f in listed if not f.is_file()]
    files = validation_files if validation_files is not None else validation_files_from_manifest(adapter_dir)
    convs = _conversations(files)
    stats: dict = {"validation_files": [str(f) for f in files], "conversations": len(convs)}
    if missing:
        stats["missing_validation_files"] = missing
    if convs:
        with model.disable_adapter():
            base_loss, n = eval_loss(model, tok, convs)
        lora_loss, _ = eval_loss(model, tok, convs)
        stats.update(
            {
                "eval_loss_base": round(base_loss, 5),
                "eval_loss_adapter": round(lora_loss, 5),
                "eval_tokens": n,
            }
        )
    with model.disable_adapter():
        base_out = greedy(model, tok)
    same = sum(greedy_matches(model, tok, CANARIES, base_out))
    stats["canaries_identical"] = f"{same}/{len(CANARIES)}"
    # the speed figure: the base's MTP layer drafting for the base and for base + adapter (validate.acceptance)
    stats["acceptance"] = acceptance.measure(model, tok, convs, base_dir)
    return stats


def estimate_acceptance(
    adapter_dir: Path, base_dir: Path, validation_files: list[Path] | None = None
) -> dict:
    """The MTP acceptance estimate alone (`acceptance.measure`; what `pipeline run` records), or
    {"unavailable": why}: no `mtp.*` tensors in the base (the model is then not loaded), no validation
    conversations, base + adapter not loadable."""
    if not acceptance.has_mtp_layer(base_dir):
        return {"unavailable": f"{base_dir}: no {acceptance.MTP_PREFIX}* tensors"}
    files = validation_files if validation_files is not None else validation_files_from_manifest(adapter_dir)
    convs = _conversations(files)
    if not convs:
        return {"unavailable": "no validation conversations to estimate on"}
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(base_dir))
        model = load_peft(base_dir, adapter_dir, "float32")
    except Exception as e:  # noqa: BLE001 - reported as why not, as evaluate does
        return {"unavailable": f"cannot load base + adapter with transformers/peft ({type(e).__name__}: {e})"}
    return acceptance.measure(model, tok, convs, base_dir)


def _result(ctx: AdapterFacts):
    """(measurements, why not, reason) of `ctx.behaviour`; the measurements are recorded in the stats."""
    fact = ctx.behaviour
    if fact.value is not None:
        ctx.stats["behaviour"] = fact.value
    return fact.value, fact.missing, fact.reason


@check(
    "behaviour.unavailable",
    "error",
    "`--behaviour`: base + adapter cannot be loaded with transformers/peft",
    option="behaviour",
)
def unavailable(ctx: AdapterFacts):
    _, err, _ = _result(ctx)
    if err:
        yield Issue(err, str(ctx.base_dir or ""))


@check("behaviour.skipped", "info", "`--behaviour` not run because static checks failed", option="behaviour")
def skipped(ctx: AdapterFacts):
    if _result(ctx)[2] == "static":
        yield Issue("behaviour checks skipped: static checks failed", str(ctx.adapter_dir))


@check(
    "behaviour.eval_loss",
    "error",
    "adapter's assistant-token NLL on the validation set > the base's (or either non-finite, no "
    "assistant token to measure, or the manifest's validation files missing)",
    option="behaviour",
)
def eval_loss_worse(ctx: AdapterFacts):
    stats = _result(ctx)[0]
    if stats and stats.get("missing_validation_files") and not stats["conversations"]:
        # the manifest names held-out data that is not here: the comparison did not run (a warning
        # saying 'manifest lists none' let the verdict pass)
        yield Issue(
            f"the manifest's validation files are not here ({', '.join(stats['missing_validation_files'][:3])}): "
            "eval loss not compared; run `pipeline validate --behaviour` where the training data is, at the "
            "paths manifest.json records",
            str(ctx.adapter_dir),
        )
        return
    if not stats or "eval_loss_adapter" not in stats:
        return
    lora, base, n = stats["eval_loss_adapter"], stats["eval_loss_base"], stats["eval_tokens"]
    # the comparison needs a measured baseline: with no assistant token both losses are NaN, and a NaN
    # base loss made `lora > base` False, so any adapter passed
    if not n:
        yield Issue(
            f"no assistant tokens in {stats['conversations']} validation conversations: eval loss not measured; "
            "check that the chat template marks assistant turns ({% generation %} or the role markers) and "
            "that the conversations have assistant messages",
            str(ctx.adapter_dir),
        )
    elif not math.isfinite(base):
        yield Issue(
            f"eval loss of the base alone is {base}: no baseline to compare the adapter with; the base "
            "checkpoint (--base) produces non-finite logits on the validation set",
            str(ctx.base_dir or ""),
        )
    elif not math.isfinite(lora):
        yield Issue(
            f"eval loss with the adapter is {lora}: the adapter produces non-finite logits; retrain",
            str(ctx.adapter_dir),
        )
    elif lora > base:
        yield Issue(
            f"eval loss with the adapter {lora:.4f} > base {base:.4f} nats/token on {n} assistant tokens of "
            f"{stats['conversations']} validation conversations: the adapter makes held-out data worse; check the "
            "data, learning rate and chat template",
            str(ctx.adapter_dir),
        )


@check("behaviour.no_data", "warning", "`--behaviour` without validation conversations", option="behaviour")
def no_data(ctx: AdapterFacts):
    stats = _result(ctx)[0]
    missing = (stats or {}).get("missing_validation_files")
    if stats is not None and stats["conversations"] and missing:
        yield Issue(
            f"{len(missing)} of the manifest's validation files are not here ({', '.join(missing[:3])}): eval loss "
            "compared on the rest only",
            str(ctx.adapter_dir),
        )
    if stats is not None and not stats["conversations"] and not missing:
        yield Issue(
            "no validation conversations (manifest lists none): eval loss not compared; train with test_datasets",
            str(ctx.adapter_dir),
        )


@check(
    "behaviour.canary",
    "error",
    "greedy outputs on all canary prompts equal the base's (the adapter has no effect)",
    option="behaviour",
)
def canary(ctx: AdapterFacts):
    stats = _result(ctx)[0]
    if stats is not None and stats["canaries_identical"] == f"{len(CANARIES)}/{len(CANARIES)}":
        yield Issue(
            f"greedy outputs on all {len(CANARIES)} canary prompts equal the base's: the adapter has no effect "
            "(near-zero lora_B, wrong scale, or tensor names that do not match the base's modules)",
            str(ctx.adapter_dir),
        )
