"""A merged NVFP4 model against its adapter hot-loaded on the NVFP4 base, both served by vLLM: parity and speed.

The operator's choice for a hot adapter (docs/merge.md): keep it hot-loaded on the shared base
(one instance serves every adapter; LoRA kernels and an MTP drafter that ignores the adapter cost
speed, docs/field-report.md: ~90 vs ~161 tok/s) or serve the merged model on its own instance. This
module measures both on the same canary prompts (`pipeline.canary.canary_set`, greedy,
`pipeline.canary.engine` passes between `/metrics` scrapes):

- hot: the NVFP4 base instance with the adapter loaded under a temporary name (and the base alone);
- merged: an instance serving the `pipeline merge --quantize nvfp4` output with the fleet's flags.

Parity (engine against engine, both quantized): per prompt, the greedy tokens are compared while
the two agree; at the first divergence the step counts as agreeing when it is a near tie (the
merged engine's token is within `tie_margin` nats of the hot engine's top logprob, or the reverse),
and the comparison of that prompt stops there (the contexts differ afterwards). `agreement` =
agreeing steps / compared steps; `max_logprob_diff` = largest |logprob difference| over the top
tokens both engines report at steps where the contexts are equal. The two differ by design: the
merged model rounds `W + scale * B @ A` to NVFP4 once, the hot path rounds `W` and adds the bf16
update, so the gap is one NVFP4 rounding of the update, the size of the NVFP4-vs-bf16 gap of the
base itself. Tolerance (documented in docs/merge.md; `--min-agreement` / `--max-logprob-diff`):
agreement >= `MIN_AGREEMENT` and `max_logprob_diff` <= `MAX_LOGPROB_DIFF`; beyond it the verdict
is `fail` (exit 1). The figures per side: decode tok/s (1 / the engine's mean time per output
token), mean acceptance length and acceptance rate of the MTP drafter.

`record` writes the side-by-side onto the registered version (tags `merge.served.*`, shown by
`pipeline status`) and into the merged directory's manifest (`served_parity`).
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.manifest import MANIFEST, MergedManifest, ServedParity, read_manifest, write_manifest
from pipeline.canary.engine import _pass, served_info, staging_instance  # _pass: the canary's measured pass
from pipeline.canary.prompts import canary_set, load_tokenizer
from pipeline.canary.result import CanaryError, EngineOutput
from pipeline.config import Instance, ProjectConfig, http_base_url
from pipeline.errors import CheckFailed, UsageError
from pipeline.figures import figures
from pipeline.fleet.client import InstanceClient, InstanceError
from pipeline.serving.vllm import usable_logprob
from pipeline.validate.behaviour import validation_files_from_manifest

MIN_AGREEMENT = 0.95
MAX_LOGPROB_DIFF = 1.0  # nats
TAG = "merge.served."


class ServedParityFailed(CheckFailed):
    """The merged model does not behave like the adapter hot-loaded on the base, beyond the tolerance (exit 1)."""


def _gap(a: float, b: float) -> float:
    """|a - b| in nats; a NaN, an infinity or vLLM's -9999 clamp of -inf on either side is an unbounded gap
    (it was skipped, so an engine answering NaN everywhere had max_logprob_diff 0.0)."""
    return abs(a - b) if usable_logprob(a) and usable_logprob(b) else math.inf


def compare_outputs(
    labels: list[str], hot: list[EngineOutput], merged: list[EngineOutput], tie_margin: float
) -> dict:
    """Engine-against-engine parity of two greedy runs over the same prompts (module docstring)."""
    compared = agreeing = identical = ties = 0
    worst, worst_at, per = 0.0, None, []
    for label, h, m in zip(labels, hot, merged, strict=True):
        div = None
        for j, (a, b) in enumerate(zip(h.tokens, m.tokens, strict=False)):
            ht = h.top[j] if j < len(h.top) else {}
            mt = m.top[j] if j < len(m.top) else {}
            for t in set(ht) & set(mt):
                if _gap(ht[t], mt[t]) > worst:
                    worst, worst_at = _gap(ht[t], mt[t]), f"{label}@{j}"
            compared += 1
            if a == b:
                agreeing += 1
                continue
            div = j
            near = any(
                top and tok in top and max(top.values()) - top[tok] <= tie_margin
                for top, tok in ((ht, b), (mt, a))
            )
            if near:
                agreeing += 1
                ties += 1
            break
        if div is None and len(h.tokens) == len(m.tokens):
            identical += 1
        per.append({"prompt": label, "tokens": len(h.tokens), "first_divergence": div})
    return {
        "compared": compared,
        "agreement": agreeing / compared if compared else 0.0,  # no token compared: nothing agreed
        "identical_prompts": identical,
        "prompts": len(labels),
        "near_ties": ties,
        "max_logprob_diff": worst,
        "max_logprob_diff_at": worst_at,
        "per_prompt": per,
    }


def _side(speed, **extra) -> dict:
    s = asdict(speed)
    tpot = s.get("tpot_s")
    return {
        **extra,
        "decode_tok_s": (1 / tpot) if tpot else None,
        "tpot_s": tpot,
        "acceptance_length": s.get("mean_acceptance_length"),
        "acceptance_rate": s.get("acceptance_rate"),
        "output_tokens": s.get("output_tokens"),
        "other_traffic": s.get("other_traffic"),
    }


def _inputs(cfg: ProjectConfig, merged_dir: Path, hot_url: str | None, merged_url: str):
    """(merged manifest, adapter dir, hot instance, merged instance), checked (see run_served_parity)."""
    try:
        man = read_manifest(merged_dir)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"{merged_dir}: {e}; give the output of `pipeline merge --quantize nvfp4`") from e
    if not isinstance(man, MergedManifest) or man.quantization is None:
        what = "a bf16 merge" if isinstance(man, MergedManifest) else f"kind {man.kind!r}"
        raise UsageError(f"{merged_dir}/{MANIFEST}: not a quantized merge ({what})")
    hot_inst = staging_instance(cfg.canary, hot_url, "--hot")
    try:
        merged_inst = Instance(name="merged", url=http_base_url(merged_url))
    except ValueError as e:
        raise UsageError(f"--merged: {e}") from None
    return man, Path(man.adapter.path), hot_inst, merged_inst


def served_parity_plan(cfg: ProjectConfig, merged_dir: Path, hot_url: str | None, merged_url: str) -> dict:
    """What `run_served_parity` would compare, after its checks, sending nothing (`pipeline merge-parity
    --dry-run`): {"merged_dir", "adapter", "registered", "hot", "merged", "prompts", "max_tokens"}.
    Raises UsageError as run_served_parity does before it loads the adapter."""
    man, adapter_dir, hot_inst, merged_inst = _inputs(cfg, Path(merged_dir), hot_url, merged_url)
    reg = man.adapter.registered
    return {"merged_dir": str(merged_dir), "adapter": str(adapter_dir),
            "registered": reg.model_dump() if reg else None, "hot": hot_inst.url,
            "merged": merged_inst.url, "prompts": cfg.canary.prompts, "max_tokens": cfg.canary.max_tokens}  # fmt: skip


def run_served_parity(
    cfg: ProjectConfig,
    merged_dir: Path,
    hot_url: str | None,
    merged_url: str,
    *,
    instance_path: str | None = None,
    min_agreement: float = MIN_AGREEMENT,
    max_logprob_diff: float = MAX_LOGPROB_DIFF,
) -> dict:
    """Measure the merged model (served at `merged_url`) against its adapter hot-loaded at `hot_url`.

    Args:
        merged_dir: the `pipeline merge --quantize nvfp4` output (its manifest names the adapter).
        hot_url: the NVFP4 base instance (default `canary.staging_url`); must allow runtime LoRA loading.
        merged_url: an instance serving `merged_dir` (no LoRA needed).
        instance_path: the adapter's path as the hot instance sees it (default: the manifest's path).

    Returns the record (JSON-able): {time, merged_dir, adapter, registered, hot, base, merged (each:
    engine_model, decode_tok_s, tpot_s, acceptance_length, acceptance_rate), parity (`compare_outputs`
    plus verdict, reasons), tolerance, notes}.

    Raises: UsageError (no manifest / not a quantized merge, bad URL), CanaryError (the hot instance
    refused the adapter), InstanceError / Unreachable (an instance failed or did not answer).
    """
    merged_dir = Path(merged_dir)
    man, adapter_dir, hot_inst, merged_inst = _inputs(cfg, merged_dir, hot_url, merged_url)
    c = cfg.canary
    tok = load_tokenizer(adapter_dir, merged_dir)
    prompts, notes = canary_set(tok, validation_files_from_manifest(adapter_dir), c.prompts)
    t0 = time.time()
    name = f"merge-parity-{uuid.uuid4().hex[:12]}"
    with InstanceClient(hot_inst, c.timeout_s) as hc:
        hot_info = served_info(cfg, hc)
        try:
            hc.load(name, instance_path or str(adapter_dir))
        except InstanceError as e:
            raise CanaryError(f"{hot_inst.url} refused adapter {adapter_dir}: {e}") from e
        try:
            _, base_speed = _pass(hc, hot_info["engine_model"], prompts, c.max_tokens, c.top_logprobs)
            hot_out, hot_speed = _pass(hc, name, prompts, c.max_tokens, c.top_logprobs)
        finally:
            try:
                hc.unload(name)
            except InstanceError as e:
                notes.append(f"could not unload the temporary adapter {name!r}: {e}")
    with InstanceClient(merged_inst, c.timeout_s) as mc:
        merged_info = served_info(cfg, mc)
        merged_out, merged_speed = _pass(
            mc, merged_info["engine_model"], prompts, c.max_tokens, c.top_logprobs
        )
    parity = compare_outputs([p.label for p in prompts], hot_out, merged_out, c.tie_margin)
    reasons = []
    if not parity["compared"]:
        reasons.append("no token compared: an engine generated nothing, or its replies carry no logprobs")
    if parity["agreement"] < min_agreement:
        reasons.append(f"token agreement {figures(parity['agreement'], min_agreement)[0]} < {min_agreement}")
    if parity["max_logprob_diff"] > max_logprob_diff:
        reasons.append(
            f"max logprob difference {figures(parity['max_logprob_diff'], max_logprob_diff)[0]} nats > {max_logprob_diff} "
            f"(at {parity['max_logprob_diff_at']})"
        )
    parity.update({"verdict": "fail" if reasons else "pass", "reasons": reasons})
    if base_speed.drafts is None:
        notes.append("the hot instance runs without speculative decoding: acceptance not measured")
    return {
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "merged_dir": str(merged_dir.resolve()),
        "adapter": str(adapter_dir),
        "registered": man.adapter.registered.model_dump() if man.adapter.registered else None,
        "base": _side(base_speed, engine_model=hot_info["engine_model"], url=hot_inst.url),
        "hot": _side(hot_speed, engine_model=hot_info["engine_model"], url=hot_inst.url),
        "merged": _side(merged_speed, engine_model=merged_info["engine_model"], url=merged_inst.url),
        "vllm_version": {"hot": hot_info.get("vllm_version"), "merged": merged_info.get("vllm_version")},
        "parity": parity,
        "tolerance": {
            "min_agreement": min_agreement,
            "max_logprob_diff": max_logprob_diff,
            "tie_margin": c.tie_margin,
        },
        "prompts": len(prompts),
        "max_tokens": c.max_tokens,
        "seconds": round(time.time() - t0, 2),
        "notes": notes,
    }


def _r(x) -> str:
    return "" if x is None else f"{x:.4g}"


def served_tags(rec: dict) -> dict[str, str]:
    """The model-version tags of a side-by-side record (`pipeline status` reads them back with `show`)."""
    p = rec["parity"]
    return {
        TAG + "verdict": p["verdict"],
        TAG + "time": rec["time"],
        TAG + "agreement": _r(p["agreement"]),
        TAG + "max_logprob_diff": _r(p["max_logprob_diff"]),
        TAG + "hot_tok_s": _r(rec["hot"]["decode_tok_s"]),
        TAG + "merged_tok_s": _r(rec["merged"]["decode_tok_s"]),
        TAG + "base_tok_s": _r(rec["base"]["decode_tok_s"]),
        TAG + "hot_acceptance_length": _r(rec["hot"]["acceptance_length"]),
        TAG + "merged_acceptance_length": _r(rec["merged"]["acceptance_length"]),
        TAG + "merged_dir": rec["merged_dir"],
    }


SHOWN = (
    "verdict",
    "time",
    "agreement",
    "max_logprob_diff",
    "hot_tok_s",
    "merged_tok_s",
    "base_tok_s",
    "hot_acceptance_length",
    "merged_acceptance_length",
    "merged_dir",
)


def show(tags: dict) -> dict | None:
    """The side-by-side figures from a version's tags (None: never measured)."""
    if TAG + "verdict" not in tags:
        return None
    return {k: tags.get(TAG + k) for k in SHOWN}


def record(cfg: ProjectConfig | None, rec: dict, target: dict | None) -> None:
    """Put `rec` into the merged manifest (`served_parity`) and, when `target` {name, version} is given, on the version."""
    d = Path(rec["merged_dir"])
    man = read_manifest(d)
    if not isinstance(man, MergedManifest):
        raise UsageError(f"{d}/{MANIFEST}: a {man.kind} manifest, not a merged checkpoint's")
    man.served_parity = ServedParity(status=rec["parity"]["verdict"], **rec)
    write_manifest(d, man)
    if target and cfg is not None:
        registry.set_version_tags(cfg, target["name"], int(target["version"]), served_tags(rec))
