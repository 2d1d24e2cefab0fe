"""Running the canary on a staging vLLM instance: load under a temporary name, two passes, unload."""

from __future__ import annotations

import datetime as dt
import math
import tempfile
import time
import uuid
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.adapter import WEIGHTS_FILE, adapter_tensors, parse_key
from pipeline.artifacts.bounded import MIB, load_json_file
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.modes import make_dir, share_tree
from pipeline.canary import prom
from pipeline.canary.effect import measure
from pipeline.canary.prompts import Prompt, canary_set, load_tokenizer
from pipeline.canary.record import record
from pipeline.canary.reference import Reference, trained_rank_copy
from pipeline.canary.result import CanaryError, CanaryResult, EngineOutput, Speed, compare, judge, ratio
from pipeline.config import CanarySection, Instance, ProjectConfig, http_base_url
from pipeline.errors import UsageError
from pipeline.fleet.client import InstanceClient, InstanceError
from pipeline.serving.versions import find_range
from pipeline.serving.vllm import fleet_applies
from pipeline.validate import default_base
from pipeline.validate.behaviour import validation_files_from_manifest


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
    if n and not tokens:
        raise CanaryError(
            f"{client.instance.url}: {model} generated {n} token(s) but the reply carries no logprobs "
            f"(choices[0].logprobs.tokens): tokens and log-probabilities are compared; serve with "
            f"--max-logprobs >= {top} (canary.top_logprobs) and no proxy that strips them"
        )
    return EngineOutput(tokens, tops), n


def _scrape(client) -> tuple[dict[str, float], dict[str, float]]:
    """(flat counters, accepted tokens per draft position) from one /metrics read."""
    text = client.metrics_text()
    return prom.counters(text), prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position")


def _settled(client, before: dict[str, float], n_tokens: int, wait_s: float = 2.0):
    """The scrape after a pass, once the engine's generation counter holds the pass's tokens.

    The API server records an engine step's stats as it hands out the step's outputs; a scrape can
    run just before the last step of the pass is counted (then its tokens land in the next pass).
    Polls for at most `wait_s`.
    """
    deadline = time.monotonic() + wait_s
    while True:
        after, per_pos = _scrape(client)
        done = after.get(prom.GENERATION_TOKENS, 0.0) - before.get(prom.GENERATION_TOKENS, 0.0) >= n_tokens
        if done or prom.GENERATION_TOKENS not in after or time.monotonic() > deadline:
            return after, per_pos
        time.sleep(0.1)


def _pass(
    client, model: str, prompts: list[Prompt], max_tokens: int, top: int
) -> tuple[list[EngineOutput], Speed]:
    """One warm-up request (not measured), then every prompt in turn between two /metrics scrapes."""
    start, _ = _scrape(client)
    _, warm = _generate(client, model, prompts[0], 2, top)
    before, pos_before = _settled(client, start, warm)
    t0 = time.perf_counter()
    outs, n_tokens = [], 0
    for p in prompts:
        o, n = _generate(client, model, p, max_tokens, top)
        outs.append(o)
        n_tokens += n
    wall = time.perf_counter() - t0
    after, pos_after = _settled(client, before, n_tokens)
    d = prom.delta(before, after)

    def get(k):
        return d.get(k)

    drafts, draft_toks, acc = get(prom.SPEC_DRAFTS), get(prom.SPEC_DRAFT_TOKENS), get(prom.SPEC_ACCEPTED)
    tpot_n = get(prom.TPOT_COUNT)
    per_pos = None
    if drafts and pos_after:
        per_pos = [(pos_after[k] - pos_before.get(k, 0.0)) / drafts for k in sorted(pos_after, key=int)]
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
        acceptance_per_position=per_pos,
    )
    return outs, speed


def _teacher_forced(
    client, model: str, prompts: list[Prompt], continuations: list[list[int]]
) -> list[list[float]]:
    """Per prompt, the engine's log-probs of `continuations[i]` under `model` (nats; NaN where none came)."""
    rows = []
    for p, y in zip(prompts, continuations, strict=True):
        if not y:
            rows.append([])
            continue
        lp = client.prompt_logprobs(model, p.ids + y)[len(p.ids) :]
        rows.append([math.nan if v is None else v for v in lp])
    return rows


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
        "quantized": _quantized(cfg, base.root),
    }


def _quantized(cfg: ProjectConfig, engine_root: str | None) -> bool:
    """`canary.quantized`, else whether the checkpoint the STAGING engine serves declares a quantization.

    The engine's own root (`/v1/models`, a local directory on a staging host) decides; the fleet
    profile's `served.path` only when the root cannot be read here. (Reading `served.path` first
    called a bf16 staging engine quantized whenever the fleet serves NVFP4, and widened its tolerance.)
    """
    if cfg.canary.quantized is not None:
        return cfg.canary.quantized
    root = Path(engine_root) if engine_root and Path(engine_root).is_dir() else None
    for d in (root,) if root else (cfg.served.path,):
        if d is None or not Path(d).is_dir():
            continue
        if (Path(d) / "hf_quant_config.json").exists():
            return True
        try:
            return "quantization_config" in load_json_file(Path(d) / "config.json", 64 * MIB)
        except (OSError, ValueError):  # unreadable, not JSON, over the bounds
            continue
    return False


# -- the canary -----------------------------------------------------------------------------------------------------
def staging_instance(canary: CanarySection, url: str | None, option: str = "--staging") -> Instance:
    """The staging instance: `url`, else `canary.staging_url`. Raises UsageError (none, or not a URL) naming
    `option`, the command's own option for it (`merge-parity`: `--hot`)."""
    url = url or canary.staging_url
    if not url:
        raise UsageError(f"no staging instance: pass {option} URL or set canary.staging_url in pipeline.yaml")
    try:
        url = http_base_url(url)
    except ValueError as e:
        raise UsageError(f"{option}: {e}") from None
    return Instance(name="staging", url=url, api_key_env=canary.staging_api_key_env)


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

    t0 = time.time()
    adapter_dir = Path(adapter_dir).resolve()
    c = cfg.canary
    inst = staging_instance(cfg.canary, staging_url)
    files = validation_files if validation_files is not None else validation_files_from_manifest(adapter_dir)
    tok = load_tokenizer(adapter_dir, base_dir)
    prompts, notes = canary_set(tok, files, c.prompts)
    name = f"canary-{uuid.uuid4().hex[:12]}"
    unloaded = True
    with (
        tempfile.TemporaryDirectory(prefix="canary-ref-") as work,
        InstanceClient(inst, c.timeout_s) as client,
    ):
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
        # the reference first: an unloadable one fails the canary before the staging engine is touched,
        # and its own greedy continuations are what the effect measure scores on the engine
        ref_dir, rank_notes = trained_rank_copy(adapter_dir, Path(work))
        try:
            ref = Reference(base_dir, ref_dir, c.reference_dtype)
        except Exception as e:  # noqa: BLE001 - any load failure of transformers/peft
            raise CanaryError(
                f"cannot load the PEFT reference (base {base_dir}, adapter {adapter_dir}): "
                f"{type(e).__name__}: {e}; pass --base with a transformers-loadable checkpoint"
            ) from e
        ref_greedy = [ref.greedy(p.ids, c.max_tokens) for p in prompts]
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
            # after both speed passes: the reference adapter's own continuation scored by the engine
            # with and without the adapter (canary.effect)
            try:
                eng_scores = (
                    _teacher_forced(client, name, prompts, ref_greedy),
                    _teacher_forced(client, served["engine_model"], prompts, ref_greedy),
                )
            except InstanceError as e:
                eng_scores = None
                notes.append(
                    f"teacher-forced scoring (prompt_logprobs) failed on staging: {e}; effect not measured"
                )
        finally:
            if not unloaded:
                try:
                    client.unload(name)
                    unloaded = True
                except InstanceError as e:
                    notes.append(f"could not unload the temporary adapter {name!r}: {e}")

        scores = {}
        for key, outs, with_adapter in (("base", base_out, False), ("adapter", ad_out, True)):
            scores[key] = [
                ref.score(p.ids, o.tokens, [list(t) for t in o.top], with_adapter) if o.tokens else []
                for p, o in zip(prompts, outs, strict=True)
            ]
        effect = None
        if eng_scores is not None:
            effect = measure(
                *eng_scores,
                [ref.token_logprobs(p.ids, y, True) for p, y in zip(prompts, ref_greedy, strict=True)],
                [ref.token_logprobs(p.ids, y, False) for p, y in zip(prompts, ref_greedy, strict=True)],
            )
            if effect is None:
                notes.append(
                    "teacher-forced scoring gave no position with finite log-probabilities: effect not measured"
                )
            elif effect.engine_unusable:
                notes.append(
                    f"the engine gave no finite log-probability at {effect.engine_unusable} teacher-forced "
                    f"position(s) where the reference did: effect measured without them"
                )
        del ref
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

    modules = {k.module.rsplit(".", 1)[-1] for t in adapter_tensors(adapter_dir) if (k := parse_key(t))}
    rng = find_range(cfg.fleet.vllm_version)  # None: an unknown version is refused by validate and publish
    outside = sorted(
        m for m in modules if rng is not None and not fleet_applies(m, cfg.fleet.lora_target_modules, rng)
    )
    res = CanaryResult(
        adapter=str(adapter_dir),
        staging=inst.url,
        engine_name=name,
        served=served,
        prompts=[p.label for p in prompts],
        max_tokens=c.max_tokens,
        parity=parity,
        speed={"base": base_speed, "adapter": ad_speed},
        speed_ratio=ratio(base_speed.tpot_s, ad_speed.tpot_s),
        acceptance_ratio=ratio(ad_speed.mean_acceptance_length, base_speed.mean_acceptance_length),
        tolerance={},
        engine_adapter_equals_base=all(a.tokens == b.tokens for a, b in zip(ad_out, base_out, strict=True)),
        findings=[],
        notes=notes,
        weights_sha256=_weights_sha256(adapter_dir),
        time=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        seconds=0.0,
        unloaded=unloaded,
        effect=effect,
    )
    judge(cfg.canary, res, rank_notes, outside)
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

    if version is None and alias is None:
        alias = registry.ALIAS_CANDIDATE
    mv = registry.resolve_version(cfg, name, version, alias)
    root = cfg.canary.staging_dir or (cfg.state_dir / "canary")
    make_dir(root)  # 0755 whatever the umask
    work = Path(tempfile.mkdtemp(prefix=f"{name}-v{mv.version}.", dir=root))
    try:
        src = registry.download_version(cfg, mv, work / "adapter")
        share_tree(work)  # mkdtemp's 0700 and the umask's modes: the staging instance may run as another user
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


def canary_plan(
    cfg: ProjectConfig,
    adapter: str,
    version: int | None = None,
    alias: str | None = None,
    staging_url: str | None = None,
    base_dir: Path | None = None,
    save: bool = True,
) -> dict:
    """What `pipeline canary` would run and record, after its checks, loading nothing on the staging instance
    and recording nothing (`--dry-run`): {"adapter", "version" (None: a directory), "staging", "base",
    "prompts", "max_tokens", "record"}. A registered version's artifact is read into a temporary directory
    (its manifest names the base) and removed. Raises UsageError as canary_version and run_canary do before
    they load anything: no staging URL, unknown model/version/alias, no base."""
    inst = staging_instance(cfg.canary, staging_url)
    if Path(adapter).is_dir():
        v, label, base = None, adapter, base_dir or default_base(cfg, Path(adapter))
        save = False  # a directory adapter has no model version to record on
    else:
        mv = registry.resolve_version(
            cfg, adapter, version, alias or (None if version else registry.ALIAS_CANDIDATE)
        )
        v, label = int(mv.version), f"{adapter} v{mv.version}"
        with tempfile.TemporaryDirectory(prefix="pipeline-canary-plan.") as td:
            base = base_dir or default_base(cfg, registry.download_version(cfg, mv, Path(td) / "adapter"))
    if base is None:
        raise UsageError("no base checkpoint for the PEFT reference: pass --base DIR or set base.path")
    if not Path(base).is_dir():
        raise UsageError(f"--base {base}: not a directory (the bf16 base checkpoint for the PEFT reference)")
    return {"adapter": label, "version": v, "staging": inst.url, "base": str(base), "prompts": cfg.canary.prompts,
            "max_tokens": cfg.canary.max_tokens, "record": save}  # fmt: skip
