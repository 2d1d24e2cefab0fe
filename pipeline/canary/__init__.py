"""Canary on a staging vLLM instance: does the engine apply the adapter as training did, and how fast?

`run_canary` loads the adapter on the staging instance under a temporary unique name, sends a
fixed canary set (validation-split prompts plus templated tool-call conversations, rendered
with the chat template and sent as token ids), and unloads it whatever happens. For the base
and then for the adapter it measures:

- parity against a PEFT + transformers reference (`pipeline.canary.reference`): greedy tokens
  and top logprobs from `/v1/completions` (temperature 0, `logprobs`, token ids), teacher-forced
  through the reference. Token agreement: share of generated positions where the engine's token
  is the reference's argmax (or within `canary.tie_margin` nats of it); first divergence: the
  first position where greedy decoding by the reference would differ; max logprob diff: over
  all positions and the engine's top tokens, nats. The base's own figures tell an engine or
  precision gap (quantised base, bf16 kernels) from an adapter problem; when the served base is
  quantised, the base's gap sets the tolerance (`canary.base_gap_factor`).
- speed, from `/metrics` scraped before and after each pass (`pipeline.canary.prom`): speculative
  decoding drafts, draft tokens and accepted tokens -> acceptance rate (accepted / draft
  tokens) and mean acceptance length (1 + accepted / drafts, vLLM's own definition); time per
  output token (the engine's per-request histogram, seconds); adapter/base ratios. The MTP
  drafter ignores LoRA (../shared/design/vllm-lora.md), so an adapter that moves the output
  distribution lowers acceptance and speed; the seed fleet measured 161 tok/s without LoRA and
  ~90 with, acceptance length 3.64 (/work/shared/seed/DIGEST.md).

The staging instance must be otherwise idle: vLLM's metrics are per engine, not per adapter
(a pass whose generated-token counter moved more than its own requests is flagged).
`record` stores the result on the MLflow model version; `gate` is the check `publish` runs.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.artifacts.adapter import WEIGHTS_FILE
from pipeline.artifacts.hashing import sha256_file
from pipeline.canary import prom
from pipeline.config import Instance, ProjectConfig
from pipeline.errors import CheckFailed, UsageError

TAG = "canary."
REPORT_TAG = "canary.report"

# Templated tool-call conversations (qwen3_coder XML tool calls in the chat template): the agent
# workload the fleet serves. The last two end after a tool call / a tool result.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]
_SYSTEM = {"role": "system", "content": "You are a careful operations agent. Use tools when they help."}
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Osaka", "unit": "celsius"}},
        }
    ],
}
TOOL_CONVERSATIONS = {
    "tool:ask": [_SYSTEM, {"role": "user", "content": "What is the weather in Osaka right now?"}],
    "tool:sql": [_SYSTEM, {"role": "user", "content": "How many invoices were paid last week?"}],
    "tool:result": [
        _SYSTEM,
        {"role": "user", "content": "What is the weather in Osaka right now?"},
        _CALL,
        {
            "role": "tool",
            "name": "get_weather",
            "content": '{"city": "Osaka", "temp_c": 12, "condition": "rain"}',
        },
    ],
}


class CanaryError(CheckFailed):
    """The canary could not run (staging unreachable, adapter refused, reference unloadable)."""


@dataclass
class Prompt:
    label: str
    ids: list[int]


@dataclass
class EngineOutput:
    tokens: list[int]
    top: list[dict[int, float]]  # per generated position: {token id: logprob}


@dataclass
class Parity:
    """Engine vs reference for one model (base or adapter) over the canary set."""

    positions: int
    agreement: float  # (exact + tied) / positions
    exact: int
    tied: int  # engine token != reference argmax, but within tie_margin nats of it
    first_divergence: int | None  # earliest position (over prompts) where the reference's argmax differs
    first_divergence_prompt: str | None
    diverged_prompts: int
    max_logprob_diff: float
    max_logprob_diff_at: str | None  # "label@position"
    per_prompt: list[dict] = field(default_factory=list)


@dataclass
class Speed:
    """Figures of one pass from the /metrics difference; None where the engine does not report them."""

    requests: int
    output_tokens: int
    drafts: float | None
    draft_tokens: float | None
    accepted_tokens: float | None
    acceptance_rate: float | None  # accepted / draft tokens
    mean_acceptance_length: float | None  # 1 + accepted / drafts (tokens per engine step)
    tpot_s: float | None  # mean per-request time per output token, seconds (engine histogram)
    wall_s_per_token: float  # client wall time / output tokens, seconds (includes prefill and HTTP)
    other_traffic: bool  # the engine generated more tokens than these requests did


@dataclass
class CanaryResult:
    adapter: str
    staging: str
    engine_name: str
    served: dict
    prompts: list[str]
    max_tokens: int
    parity: dict[str, Parity]  # "base", "adapter"
    speed: dict[str, Speed]
    speed_ratio: float | None  # base TPOT / adapter TPOT (adapter speed relative to base)
    acceptance_ratio: float | None  # adapter / base mean acceptance length
    tolerance: dict
    engine_adapter_equals_base: bool
    problems: list[str]
    notes: list[str]
    weights_sha256: str | None
    time: str
    seconds: float
    unloaded: bool = True

    @property
    def verdict(self) -> str:
        return "fail" if self.problems else "pass"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d


# -- canary set -----------------------------------------------------------------------------------------------------
def _render(tok, messages: list[dict], tools) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def canary_set(tok, validation_files: list[Path], n: int) -> tuple[list[Prompt], list[str]]:
    """Up to `n` validation conversations cut before their first assistant turn, then the tool-call ones.

    Returns (prompts, notes). Raises UsageError for a file that is not chat JSONL.
    """
    from pipeline.validate.behaviour import CANARIES

    prompts, notes = [], []
    for f in validation_files:
        for i, line in enumerate(Path(f).read_text().splitlines(), 1):
            if len(prompts) >= n:
                break
            if not line.strip():
                continue
            try:
                conv = json.loads(line)
                msgs = conv["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UsageError(f"{f}:{i}: not a chat JSONL line with 'messages' ({e})") from e
            cut = next((j for j, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
            if cut:
                prompts.append(Prompt(f"{Path(f).name}:{i}", _render(tok, msgs[:cut], conv.get("tools"))))
    if not prompts:
        notes.append(
            "no validation conversations (manifest lists none; pass --validation): using fixed prompts"
        )
        prompts = [Prompt(f"fixed:{i}", _render(tok, m, None)) for i, m in enumerate(CANARIES[:n])]
    prompts += [Prompt(label, _render(tok, msgs, TOOLS)) for label, msgs in TOOL_CONVERSATIONS.items()]
    return prompts, notes


def _tokenizer(adapter_dir: Path, base_dir: Path):
    """The adapter's tokenizer (as trained) when it ships one, else the base's."""
    from transformers import AutoTokenizer

    src = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").exists() else base_dir
    return AutoTokenizer.from_pretrained(str(src))


# -- engine side ----------------------------------------------------------------------------------------------------
def _token_id(s: str) -> int:
    """vLLM's `return_tokens_as_token_ids` form "token_id:123" -> 123."""
    if not s.startswith("token_id:"):
        raise CanaryError(f"engine returned token {s!r}, expected 'token_id:N' (return_tokens_as_token_ids)")
    return int(s.split(":", 1)[1])


def _generate(client, model: str, prompt: Prompt, max_tokens: int, top: int) -> tuple[EngineOutput, int]:
    reply = client.completion(model, prompt.ids, max_tokens, logprobs=top, return_tokens_as_token_ids=True)
    ch = reply["choices"][0]
    lp = ch.get("logprobs") or {}
    tokens = [_token_id(t) for t in lp.get("tokens") or []]
    tops = [{_token_id(k): float(v) for k, v in (d or {}).items()} for d in lp.get("top_logprobs") or []]
    n = int((reply.get("usage") or {}).get("completion_tokens") or len(tokens))
    return EngineOutput(tokens, tops), n


def _pass(
    client, model: str, prompts: list[Prompt], max_tokens: int, top: int
) -> tuple[list[EngineOutput], Speed]:
    """One warm-up request (not measured), then every prompt in turn between two /metrics scrapes."""
    _generate(client, model, prompts[0], 2, top)
    before = prom.counters(client.metrics_text())
    t0 = time.perf_counter()
    outs, n_tokens = [], 0
    for p in prompts:
        o, n = _generate(client, model, p, max_tokens, top)
        outs.append(o)
        n_tokens += n
    wall = time.perf_counter() - t0
    d = prom.delta(before, prom.counters(client.metrics_text()))

    def get(k):
        return d.get(k)

    drafts, draft_toks, acc = get(prom.SPEC_DRAFTS), get(prom.SPEC_DRAFT_TOKENS), get(prom.SPEC_ACCEPTED)
    tpot_n = get(prom.TPOT_COUNT)
    speed = Speed(
        requests=len(prompts),
        output_tokens=n_tokens,
        drafts=drafts,
        draft_tokens=draft_toks,
        accepted_tokens=acc,
        acceptance_rate=(acc / draft_toks) if acc is not None and draft_toks else None,
        mean_acceptance_length=(1 + acc / drafts) if acc is not None and drafts else None,
        tpot_s=(get(prom.TPOT_SUM) / tpot_n) if tpot_n else None,
        wall_s_per_token=wall / max(n_tokens, 1),
        other_traffic=(get(prom.GENERATION_TOKENS) or 0) > n_tokens,
    )
    return outs, speed


def served_info(cfg: ProjectConfig, client) -> dict:
    """What the staging engine serves (`/v1/models` base card, `/version`) next to the fleet profile."""
    base = next((c for c in client.models() if c.parent is None), None)
    if base is None:
        raise CanaryError(f"{client.instance.url}: /v1/models lists no base model")
    raw = client._request("GET", "/v1/models").json().get("data", [])
    card = next((c for c in raw if c.get("id") == base.id), {})
    return {
        "engine_model": base.id,
        "engine_root": base.root,
        "max_model_len": card.get("max_model_len"),
        "vllm_version": client.version(),
        "checkpoint": cfg.served.checkpoint,
        "revision": cfg.served.revision,
        "profile_model": cfg.served_base_name,
        "quantised": _quantised(cfg, base.root),
    }


def _quantised(cfg: ProjectConfig, engine_root: str | None) -> bool:
    """`canary.quantised`, else whether the served checkpoint's config declares a quantisation."""
    if cfg.canary.quantised is not None:
        return cfg.canary.quantised
    for d in (cfg.served.path, Path(engine_root) if engine_root else None):
        if d is None or not Path(d).is_dir():
            continue
        if (Path(d) / "hf_quant_config.json").exists():
            return True
        try:
            return "quantization_config" in json.loads((Path(d) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return False


# -- comparison -----------------------------------------------------------------------------------------------------
def compare(prompts: list[Prompt], outs: list[EngineOutput], scores, tie_margin: float) -> Parity:
    """Parity figures from engine outputs and the reference's `PositionScore`s (same order)."""
    positions = exact = tied = diverged = 0
    first, first_at, max_diff, max_at, per = None, None, 0.0, None, []
    for p, o, sc in zip(prompts, outs, scores, strict=True):
        div = None
        p_max = 0.0
        for j, (tok, s) in enumerate(zip(o.tokens, sc, strict=True)):
            positions += 1
            if s.argmax == tok:
                exact += 1
            else:
                div = j if div is None else div
                if s.argmax_logprob - s.logprobs.get(tok, -math.inf) <= tie_margin:
                    tied += 1
            for t, lp in (o.top[j] if j < len(o.top) else {}).items():
                if math.isfinite(lp) and t in s.logprobs:
                    diff = abs(lp - s.logprobs[t])
                    p_max = max(p_max, diff)
                    if diff > max_diff:
                        max_diff, max_at = diff, f"{p.label}@{j}"
        if div is not None:
            diverged += 1
            if first is None or div < first:
                first, first_at = div, p.label
        per.append(
            {
                "prompt": p.label,
                "tokens": len(o.tokens),
                "first_divergence": div,
                "max_logprob_diff": round(p_max, 6),
            }
        )
    return Parity(
        positions=positions,
        agreement=(exact + tied) / positions if positions else 1.0,
        exact=exact,
        tied=tied,
        first_divergence=first,
        first_divergence_prompt=first_at,
        diverged_prompts=diverged,
        max_logprob_diff=max_diff,
        max_logprob_diff_at=max_at,
        per_prompt=per,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def judge(cfg: ProjectConfig, res: CanaryResult, rank_notes: list[str], outside: list[str]) -> None:
    """Fill `res.tolerance` and `res.problems` (each a full sentence: what, where, how to fix)."""
    c = cfg.canary
    base, ad = res.parity["base"], res.parity["adapter"]
    quantised = bool(res.served.get("quantised"))
    min_agree, max_diff = c.min_token_agreement, c.max_logprob_diff
    base_ok = base.agreement >= min_agree and base.max_logprob_diff <= max_diff
    if quantised:  # the engine's own gap on the base is the floor of what the adapter can reach
        min_agree = min(min_agree, base.agreement - (1 - c.min_token_agreement))
        max_diff = max(max_diff, c.base_gap_factor * base.max_logprob_diff)
    res.tolerance = {
        "min_token_agreement": round(min_agree, 6),
        "max_logprob_diff": round(max_diff, 6),
        "quantised": quantised,
        "from_base_gap": quantised,
    }
    where = f"staging {res.staging} ({res.served.get('engine_model')})"
    if not base_ok and not quantised:
        res.problems.append(
            f"engine/precision gap on the BASE alone: token agreement {base.agreement:.3f} (min {c.min_token_agreement}), "
            f"max logprob diff {base.max_logprob_diff:.4f} nats (max {c.max_logprob_diff}) at {base.max_logprob_diff_at} "
            f"on {where}: the engine and the reference disagree before any adapter; check the checkpoint it serves, "
            f"--dtype, and the vLLM version (set canary.quantised: true if the served base is quantised)"
        )
    bad_agree, bad_diff = ad.agreement < min_agree, ad.max_logprob_diff > max_diff
    if not (bad_agree or bad_diff):
        pass
    elif res.engine_adapter_equals_base:
        hint = (
            f"modules outside the instance's --lora-target-modules ({', '.join(outside)})"
            if outside
            else "modules outside the instance's --lora-target-modules, or tensors the engine ignores"
        )
        res.problems.append(
            f"the engine serves the adapter as the base: its greedy output equals the base's on all "
            f"{len(res.prompts)} canary prompts, but PEFT's differs (token agreement {ad.agreement:.3f}, first "
            f"divergence at token {ad.first_divergence} of {ad.first_divergence_prompt}): {hint}; "
            f"retrain with target modules the fleet applies, or change the fleet's --lora-target-modules"
        )
    else:
        if rank_notes:
            why = " ".join(rank_notes) + (
                "; vLLM scales by lora_alpha / r from the config, so it serves another "
                "scale: fix r in adapter_config.json"
            )
        else:
            why = "the engine applies the adapter differently from PEFT (wrong scale, modules missing, another base)"
        res.problems.append(
            f"adapter parity failed on {where}: token agreement {ad.agreement:.3f} (min {min_agree:.3f}), max logprob "
            f"diff {ad.max_logprob_diff:.4f} nats (max {max_diff:.4f}) at {ad.max_logprob_diff_at}, first divergence at "
            f"token {ad.first_divergence} of {ad.first_divergence_prompt}; the base alone agrees {base.agreement:.3f} "
            f"(max diff {base.max_logprob_diff:.4f}): {why}"
        )
    if c.min_speed_ratio is not None and res.speed_ratio is not None and res.speed_ratio < c.min_speed_ratio:
        res.problems.append(
            f"decode speed with the adapter is {res.speed_ratio:.2f}x the base's (time per output token "
            f"{_ms(res.speed['adapter'].tpot_s)} vs {_ms(res.speed['base'].tpot_s)}), below canary.min_speed_ratio "
            f"{c.min_speed_ratio}"
        )
    if (
        c.min_acceptance_ratio is not None
        and res.acceptance_ratio is not None
        and res.acceptance_ratio < c.min_acceptance_ratio
    ):
        res.problems.append(
            f"mean acceptance length with the adapter {res.speed['adapter'].mean_acceptance_length:.2f} is "
            f"{res.acceptance_ratio:.2f}x the base's {res.speed['base'].mean_acceptance_length:.2f}, below "
            f"canary.min_acceptance_ratio {c.min_acceptance_ratio}: the drafter (no LoRA) no longer predicts it"
        )


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.1f} ms"


# -- the canary -----------------------------------------------------------------------------------------------------
def staging_instance(cfg: ProjectConfig, url: str | None) -> Instance:
    url = url or cfg.canary.staging_url
    if not url:
        raise UsageError("no staging instance: pass --staging URL or set canary.staging_url in pipeline.yaml")
    return Instance(name="staging", url=url, api_key_env=cfg.canary.staging_api_key_env)


def run_canary(
    cfg: ProjectConfig,
    adapter_dir: Path,
    base_dir: Path,
    staging_url: str | None = None,
    instance_path: str | None = None,
    validation_files: list[Path] | None = None,
) -> CanaryResult:
    """Run the canary of `adapter_dir` on the staging instance; nothing is recorded here (see `record`).

    Args:
        adapter_dir: PEFT adapter directory (read by the reference, and by the engine at `instance_path`).
        base_dir: transformers-loadable bf16 base for the PEFT reference.
        staging_url: the staging vLLM instance (default `canary.staging_url`).
        instance_path: the adapter's absolute path as the staging instance sees it (default: `adapter_dir`).
        validation_files: chat JSONL (default: the validation files in the adapter's manifest.json).

    Raises:
        UsageError: no staging URL, unreadable validation file.
        CanaryError: the instance refused the adapter or a request (the temporary name is unloaded).
        InstanceError / Unreachable: the staging instance failed or did not answer.
    """
    from pipeline.canary.reference import Reference, trained_rank_copy
    from pipeline.fleet.client import InstanceClient, InstanceError
    from pipeline.validate import fleet_applies
    from pipeline.validate.behaviour import validation_files_from_manifest

    t0 = time.time()
    adapter_dir = Path(adapter_dir).resolve()
    c = cfg.canary
    inst = staging_instance(cfg, staging_url)
    files = validation_files if validation_files is not None else validation_files_from_manifest(adapter_dir)
    tok = _tokenizer(adapter_dir, base_dir)
    prompts, notes = canary_set(tok, files, c.prompts)
    name = f"canary-{uuid.uuid4().hex[:12]}"
    unloaded = True
    with InstanceClient(inst, c.timeout_s) as client:
        served = served_info(cfg, client)
        if served["engine_model"] != cfg.served_base_name:
            notes.append(
                f"staging serves {served['engine_model']!r}, the fleet profile names "
                f"{cfg.served_base_name!r} (served.model / served.served_model_name)"
            )
        limit = served.get("max_model_len")
        if limit:
            kept = [p for p in prompts if len(p.ids) + c.max_tokens <= limit]
            if len(kept) < len(prompts):
                notes.append(
                    f"{len(prompts) - len(kept)} prompt(s) longer than max_model_len {limit} - "
                    f"{c.max_tokens} left out"
                )
            prompts = kept
        if not prompts:
            raise UsageError(f"no canary prompt fits the staging max_model_len {limit}")
        try:
            try:
                client.load(name, instance_path or str(adapter_dir))
            except InstanceError as e:
                raise CanaryError(
                    f"staging refused adapter {adapter_dir} (as {instance_path or adapter_dir}): {e}"
                ) from e
            unloaded = False
            base_out, base_speed = _pass(
                client, served["engine_model"], prompts, c.max_tokens, c.top_logprobs
            )
            ad_out, ad_speed = _pass(client, name, prompts, c.max_tokens, c.top_logprobs)
        finally:
            if not unloaded:
                try:
                    client.unload(name)
                    unloaded = True
                except InstanceError as e:
                    notes.append(f"could not unload the temporary adapter {name!r}: {e}")

    with tempfile.TemporaryDirectory(prefix="canary-ref-") as work:
        ref_dir, rank_notes = trained_rank_copy(adapter_dir, Path(work))
        try:
            ref = Reference(base_dir, ref_dir, c.reference_dtype)
        except Exception as e:  # noqa: BLE001 - any load failure of transformers/peft
            raise CanaryError(
                f"cannot load the PEFT reference (base {base_dir}, adapter {adapter_dir}): "
                f"{type(e).__name__}: {e}; pass --base with a transformers-loadable checkpoint"
            ) from e
        scores = {}
        for key, outs, with_adapter in (("base", base_out, False), ("adapter", ad_out, True)):
            scores[key] = [
                ref.score(p.ids, o.tokens, [list(t) for t in o.top], with_adapter) if o.tokens else []
                for p, o in zip(prompts, outs, strict=True)
            ]
    parity = {
        k: compare(prompts, o, scores[k], c.tie_margin) for k, o in (("base", base_out), ("adapter", ad_out))
    }
    notes += rank_notes
    for k, s in (("base", base_speed), ("adapter", ad_speed)):
        if s.other_traffic:
            notes.append(
                f"the {k} pass ran while the staging engine served other requests: speed figures are mixed"
            )
    if base_speed.drafts is None:
        notes.append("the staging engine runs without speculative decoding: acceptance not measured")
    from pipeline.artifacts.adapter import adapter_tensors, parse_key

    modules = {k.module.rsplit(".", 1)[-1] for t in adapter_tensors(adapter_dir) if (k := parse_key(t))}
    outside = sorted(m for m in modules if not fleet_applies(m, cfg.fleet.lora_target_modules))
    res = CanaryResult(
        adapter=str(adapter_dir),
        staging=inst.url,
        engine_name=name,
        served=served,
        prompts=[p.label for p in prompts],
        max_tokens=c.max_tokens,
        parity=parity,
        speed={"base": base_speed, "adapter": ad_speed},
        speed_ratio=_ratio(base_speed.tpot_s, ad_speed.tpot_s),
        acceptance_ratio=_ratio(ad_speed.mean_acceptance_length, base_speed.mean_acceptance_length),
        tolerance={},
        engine_adapter_equals_base=all(a.tokens == b.tokens for a, b in zip(ad_out, base_out, strict=True)),
        problems=[],
        notes=notes,
        weights_sha256=_weights_sha256(adapter_dir),
        time=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        seconds=0.0,
        unloaded=unloaded,
    )
    judge(cfg, res, rank_notes, outside)
    res.seconds = round(time.time() - t0, 2)
    return res


def canary_version(
    cfg: ProjectConfig,
    name: str,
    version: int | None = None,
    alias: str | None = None,
    staging_url: str | None = None,
    base_dir: Path | None = None,
    validation_files: list[Path] | None = None,
    save: bool = True,
) -> tuple[object, CanaryResult]:
    """Canary of a registered version (default alias `candidate`), recorded on it unless `save=False`.

    The artifact is unpacked under `canary.staging_dir` (default `<state_dir>/canary`), which the
    staging instance sees at `canary.staging_mount` (default: the same path), and removed afterwards.
    Returns (ModelVersion, result). Raises as `run_canary`, and UsageError for an unknown
    model/version/alias or when no base is found.
    """
    import shutil

    from pipeline import registry
    from pipeline.validate import default_base

    if version is None and alias is None:
        alias = registry.ALIAS_CANDIDATE
    mv = registry.resolve_version(cfg, name, version, alias)
    root = cfg.canary.staging_dir or (cfg.state_dir / "canary")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-v{mv.version}.", dir=root))
    try:
        src = registry.download_version(cfg, mv, work / "adapter")
        base_dir = base_dir or default_base(cfg, src)
        if base_dir is None:
            raise UsageError("no base checkpoint for the PEFT reference: pass --base DIR or set base.path")
        mount = cfg.canary.staging_mount
        inst_path = f"{mount.rstrip('/')}/{src.relative_to(root)}" if mount else str(src.resolve())
        res = run_canary(cfg, src, base_dir, staging_url, inst_path, validation_files)
        res.adapter = f"{name} v{mv.version}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if save:
        record(cfg, name, int(mv.version), res)
    return mv, res


def _weights_sha256(adapter_dir: Path) -> str | None:
    p = Path(adapter_dir) / WEIGHTS_FILE
    return sha256_file(p) if p.exists() else None


# -- registry: record, show, gate -------------------------------------------------------------------------------------
def _r(x: float | None, n: int = 4) -> str:
    return "" if x is None else str(round(x, n))


def summary_tags(res: CanaryResult) -> dict[str, str]:
    """The model-version tags of a canary result (`canary.*`); empty values are left out."""
    b, a = res.parity["base"], res.parity["adapter"]
    sb, sa = res.speed["base"], res.speed["adapter"]
    srv = res.served
    tags = {
        "verdict": res.verdict,
        "time": res.time,
        "staging": res.staging,
        "weights_sha256": res.weights_sha256 or "",
        "checkpoint": f"{srv.get('checkpoint')}@{srv.get('revision') or '-'}",
        "engine_model": srv.get("engine_model") or "",
        "engine_root": srv.get("engine_root") or "",
        "vllm_version": srv.get("vllm_version") or "",
        "token_agreement": _r(a.agreement),
        "base_token_agreement": _r(b.agreement),
        "max_logprob_diff": _r(a.max_logprob_diff, 6),
        "base_max_logprob_diff": _r(b.max_logprob_diff, 6),
        "first_divergence": "" if a.first_divergence is None else str(a.first_divergence),
        "acceptance_rate": _r(sa.acceptance_rate),
        "base_acceptance_rate": _r(sb.acceptance_rate),
        "acceptance_length": _r(sa.mean_acceptance_length),
        "base_acceptance_length": _r(sb.mean_acceptance_length),
        "tpot_ms": _r(sa.tpot_s * 1000 if sa.tpot_s is not None else None, 3),
        "base_tpot_ms": _r(sb.tpot_s * 1000 if sb.tpot_s is not None else None, 3),
        "speed_ratio": _r(res.speed_ratio),
        "acceptance_ratio": _r(res.acceptance_ratio),
        "problems": " | ".join(res.problems)[:4900],
    }
    return {TAG + k: v for k, v in tags.items() if v != ""}


def record(cfg: ProjectConfig, name: str, version: int, res: CanaryResult) -> None:
    """Store the result on model version `name` v`version`: `canary.*` tags, the report JSON
    (tag `canary.report`, trimmed to MLflow's tag size; whole in the training run's artifacts
    as `canary/<name>/v<N>.json` when the version has a run), and a `canary` event.
    Stale tags of an earlier canary (figures this one did not measure) are removed.
    """
    from pipeline import registry

    client = registry._mlflow(cfg).MlflowClient()
    mv = client.get_model_version(name, str(version))
    tags = summary_tags(res)
    for k in mv.tags or {}:
        if k.startswith(TAG) and k not in tags and k != REPORT_TAG:
            client.delete_model_version_tag(name, str(version), k)
    d = res.to_dict()
    compact = {k: v for k, v in d.items() if k not in ("parity", "notes")}
    compact["parity"] = {k: {f: v for f, v in p.items() if f != "per_prompt"} for k, p in d["parity"].items()}
    tags[REPORT_TAG] = json.dumps(compact, sort_keys=True, default=str)[:4900]
    registry.set_version_tags(cfg, name, version, tags)
    if mv.run_id:
        try:
            client.log_text(mv.run_id, json.dumps(d, indent=2, default=str), f"canary/{name}/v{version}.json")
        except Exception:  # noqa: BLE001 - the run may live in another store; the tags hold the figures
            pass
    registry.record_event(
        cfg,
        name,
        version,
        {
            "type": "canary",
            "verdict": res.verdict,
            "staging": res.staging,
            "checkpoint": tags[TAG + "checkpoint"],
        },
    )


def show(tags: dict) -> dict | None:
    """The canary figures `pipeline status` shows, from a version's tags (None: no canary recorded)."""
    if TAG + "verdict" not in tags:
        return None
    keys = (
        "verdict",
        "time",
        "checkpoint",
        "engine_model",
        "token_agreement",
        "base_token_agreement",
        "max_logprob_diff",
        "acceptance_length",
        "base_acceptance_length",
        "speed_ratio",
        "acceptance_ratio",
        "weights_sha256",
    )
    return {k: tags.get(TAG + k) for k in keys}


def gate(cfg: ProjectConfig, mv) -> list[str]:
    """The publish check on a version's recorded canary; returns warnings.

    Raises CheckFailed: the recorded canary failed; its figures fall below the configured
    floors; or `canary.required` and no canary was recorded for the version's weights.
    Warns when the served checkpoint the canary measured differs from the fleet profile
    (`served.checkpoint`/`revision`) or from what a configured fleet instance serves
    (`/v1/models` base card).
    """
    t = mv.tags or {}
    c = cfg.canary
    where = f"{mv.name} v{mv.version}"
    verdict = t.get(TAG + "verdict")
    if verdict is not None and t.get(TAG + "weights_sha256") not in (
        None,
        t.get("validation.weights_sha256"),
    ):
        verdict = None  # measured other weights than the validated artifact
    how = f"run `pipeline canary {mv.name} --version {mv.version} --staging URL`"
    if verdict is None:
        if c.required:
            raise CheckFailed(
                f"{where}: no canary recorded for its weights and canary.required is set: {how}"
            )
        return []
    if verdict != "pass":
        raise CheckFailed(
            f"{where}: canary failed: {t.get(TAG + 'problems', '(no details)')}; fix and re-register, "
            f"then {how}"
        )
    for floor, key, what in (
        (c.min_speed_ratio, "speed_ratio", "canary.min_speed_ratio"),
        (c.min_acceptance_ratio, "acceptance_ratio", "canary.min_acceptance_ratio"),
    ):
        if floor is not None and t.get(TAG + key) and float(t[TAG + key]) < floor:
            raise CheckFailed(f"{where}: canary {key} {float(t[TAG + key]):.3f} is below {what} {floor}")
    warnings = []
    measured = t.get(TAG + "checkpoint")
    profile = f"{cfg.served.checkpoint}@{cfg.served.revision or '-'}"
    if measured and measured != profile:
        warnings.append(
            f"{where}: the canary measured served checkpoint {measured}, the fleet profile now says "
            f"{profile}: re-run the canary"
        )
    engine = (t.get(TAG + "engine_model"), t.get(TAG + "engine_root"))
    if cfg.fleet.instances and engine[0]:
        from pipeline.fleet.client import InstanceClient, InstanceError

        for inst in cfg.fleet.instances:
            try:
                with InstanceClient(inst, cfg.fleet.timeout_s) as client:
                    base = next((x for x in client.models() if x.parent is None), None)
            except (InstanceError, UsageError):
                continue  # the rollout reports instances it cannot reach
            if base is not None and (base.id, base.root) != engine:
                warnings.append(
                    f"{where}: fleet instance {inst.name} serves {base.id} ({base.root}), the canary "
                    f"measured {engine[0]} ({engine[1]}) on staging: its figures may not hold there"
                )
    return warnings
