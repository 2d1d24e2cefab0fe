"""How instances get an adapter version: the `api` and `resolver` loading modes behind one interface.

A `LoadingMode` answers, per instance and adapter version:
- `served_name(name, version)`: the model id clients send for the current version;
- `prepare(name, version, path)`: checks on the volume directory before any instance is touched;
- `switch(client, rep, name, version)`: make the instance serve it, verify, canary; records in
  `rep.before` / `rep.touched` what it changed so that `undo` can put it back (idempotent: no
  request that changes anything when the instance already serves it);
- `undo(client, rep)`: put back what `switch` changed;
- `cleanup(client, rep, name, keep)`: unload version names of `name` not in `keep`.

`ApiMode` loads through `POST /v1/load_lora_adapter` with the swap strategy of the fleet's vLLM
version (`pipeline.serving.swap`): `versioned` serves `<NAME>-v<N>` only and never re-points a
name; `repoint` also re-points the stable name `<NAME>` at the new (immutable) path in place.
`ResolverMode` relies on vLLM's lora_filesystem_resolver: clients request `<NAME>-v<N>`, the
instance loads `<volume_mount>/<NAME>-v<N>` on first use; the pipeline only checks the resolver's
layout rules and probes the version name. Pick one with `loading_mode(cfg)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from pipeline.artifacts.bounded import MIB, load_json_file
from pipeline.artifacts.volume import VERSION_RE, version_name
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError, UsageError
from pipeline.fleet.client import InstanceClient, InstanceError, Unreachable
from pipeline.fleet.instances import InstanceReport, instance_path
from pipeline.fleet.state import load_state
from pipeline.serving.swap import SwapPlan, swap_plan
from pipeline.serving.vllm import usable_logprob


class LoadingMode(Protocol):
    name: str
    warnings: list[str]  # what the operator should know about this mode on this fleet

    def served_name(self, name: str, version: int) -> str: ...

    def prepare(self, name: str, version: int, path: Path) -> None: ...

    def switch(self, client: InstanceClient, rep: InstanceReport, name: str, version: int) -> bool: ...

    def undo(self, client: InstanceClient, rep: InstanceReport) -> None: ...

    def cleanup(self, client: InstanceClient, rep: InstanceReport, name: str, keep: set[int]) -> None: ...


# An adapter "has an effect" on the canary prompt when a greedy token or a token's log-probability
# differs from the base's by more than this (nats): far above the run-to-run noise of one engine
# (identical requests: 0), far below what a trained adapter moves (tenths to whole nats).
NO_EFFECT_NATS = 0.05


def _greedy(client: InstanceClient, model: str, prompt: str, n: int) -> tuple[list[str], list[float]]:
    """(token ids as vLLM names them, their log-probabilities) of `n` greedy tokens, the end of sequence
    ignored so that exactly `n` come back (vLLM's `ignore_eos` and `return_tokens_as_token_ids`)."""
    reply = client.completion(model, prompt, n, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    lp = reply["choices"][0].get("logprobs") or {}
    tokens, values = list(lp.get("tokens") or []), list(lp.get("token_logprobs") or [])
    # No evidence is no effect: a reply without log-probabilities, or with NaN / inf / -9999 (vLLM's -inf)
    # ones, cannot show the adapter moved anything (a NaN compared as 'moved': a NaN-emitting engine passed).
    bad = [x for x in values if not usable_logprob(None if x is None else float(x))]
    if not tokens or len(values) != len(tokens) or bad:
        raise InstanceError(
            f"{client.name}: canary: {model!r} answered {len(tokens)} token(s) with {len(values)} log-probabilities"
            f"{f', {len(bad)} of them missing or not finite' if bad else ''} for fleet.canary_prompt: the "
            f"adapter's effect cannot be judged; check the instance (--max-logprobs >= 1, a base whose "
            f"logits are finite)",
            check="fleet.canary_no_effect",
        )
    return tokens, [float(x) for x in values]


def canary(client: InstanceClient, cfg: ProjectConfig, model: str) -> None:
    """Raise InstanceError (`fleet.canary_no_effect`) unless `model`'s greedy tokens or their
    log-probabilities differ from the base's on `fleet.canary_prompt` (by more than NO_EFFECT_NATS).

    Tokens, not text: on the H200 (random 8-layer base, vLLM 0.25.1) base and adapter both stopped at
    once and their texts were '' alike, so a good adapter was refused as having no effect; a reply
    that stops, or whose tokens are special and decode to nothing, says nothing about the adapter."""
    prompt, n = cfg.fleet.canary_prompt, cfg.fleet.canary_max_tokens
    base_tokens, base_lp = _greedy(client, cfg.served_base_name, prompt, n)
    tokens, lp = _greedy(client, model, prompt, n)
    moved = max((abs(a - b) for a, b in zip(lp, base_lp, strict=False)), default=0.0)
    if tokens == base_tokens and moved <= NO_EFFECT_NATS:
        raise InstanceError(
            f"{client.name}: canary: {model!r} gives the base's greedy tokens {tokens} for fleet.canary_prompt, "
            f"their log-probabilities within {moved:.3g} nats: the adapter has no effect there (all-zero "
            f"lora_B? modules outside --lora-target-modules?)",
            check="fleet.canary_no_effect",
        )


def loaded_versions(loaded: dict[str, str | None], name: str) -> dict[int, str]:
    """{version: version name} of `name`'s version names among the loaded adapters."""
    out = {}
    for n in loaded:
        m = VERSION_RE.match(n)
        if m and m["name"] == name:
            out[int(m["version"])] = n
    return out


class ApiMode:
    """Runtime loading through the load/unload endpoints, with the version's swap strategy."""

    name = "api"

    def __init__(self, cfg: ProjectConfig, plan: SwapPlan):
        self.cfg = cfg
        self.plan = plan
        self.warnings = list(plan.warnings)

    def served_name(self, name: str, version: int) -> str:
        return name if self.plan.strategy == "repoint" else version_name(name, version)

    def prepare(self, name: str, version: int, path: Path) -> None:
        return None

    def switch(self, client: InstanceClient, rep: InstanceReport, name: str, version: int) -> bool:
        """Load the version name (and, with `repoint`, re-point the stable name); verify; canary."""
        target = instance_path(self.cfg.fleet, name, version)
        rep.before = current = client.adapters()
        names = [version_name(name, version)] + ([name] if self.plan.strategy == "repoint" else [])
        changed = False
        for n in names:
            if current.get(n) == target:
                continue
            inplace = n in current
            if inplace and self.plan.strategy != "repoint":
                raise InstanceError(
                    f"{client.name}: {n} is loaded from {current[n]!r}, expected {target!r}; the versioned swap "
                    f"never re-points a name: unload it (POST /v1/unload_lora_adapter) and run `pipeline fleet sync`",
                    check="fleet.root_mismatch",
                )
            rep.touched.append(n)
            client.load(n, target, inplace=inplace)
            rep.actions.append(f"{'re-pointed' if inplace else 'loaded'} {n} -> {target}")
            changed = True
        served = self.served_name(name, version)
        root = client.adapters().get(served)
        if root != target:
            raise InstanceError(
                f"{client.name}: /v1/models lists {served} with root {root!r}, expected {target!r}",
                check="fleet.root_mismatch",
            )
        if changed:
            canary(client, self.cfg, served)
            rep.actions.append(f"verified {served} (root {target}, canary differs from base)")
        return changed

    def undo(self, client: InstanceClient, rep: InstanceReport) -> None:
        for n in reversed(rep.touched):
            try:
                if rep.before.get(n):
                    client.load(n, rep.before[n], inplace=True)
                    rep.actions.append(f"restored {n} -> {rep.before[n]}")
                else:
                    client.unload(n)
                    rep.actions.append(f"unloaded {n}")
            except InstanceError as e:
                rep.unknown = rep.unknown or e.outcome_unknown
                rep.error("fleet.restore_failed", f"restore of {n} failed: {e}")
                if isinstance(e, Unreachable):
                    return  # no answer: further requests would only wait out their timeouts

    def cleanup(self, client: InstanceClient, rep: InstanceReport, name: str, keep: set[int]) -> None:
        """Unload version names of `name` not in `keep` (best effort: warnings, never failures)."""
        for v, n in sorted(loaded_versions(client.adapters(), name).items()):
            if v in keep:
                continue
            try:
                client.unload(n)
                rep.actions.append(f"unloaded {n} (not among the kept versions {sorted(keep)})")
            except InstanceError as e:
                rep.warn("fleet.cleanup_failed", str(e))


class ResolverMode:
    """vLLM's lora_filesystem_resolver over the volume: clients request `<NAME>-v<N>`, loaded lazily."""

    name = "resolver"

    def __init__(self, cfg: ProjectConfig):
        self.cfg = cfg
        self.warnings: list[str] = []

    def served_name(self, name: str, version: int) -> str:
        return version_name(name, version)

    def prepare(self, name: str, version: int, path: Path) -> None:
        problems = resolver_layout_problems(self.cfg, name, version, path)
        if problems:
            raise FleetError(
                f"{path}: not servable by vLLM's filesystem resolver:\n  " + "\n  ".join(problems)
            )

    def switch(self, client: InstanceClient, rep: InstanceReport, name: str, version: int) -> bool:
        n = version_name(name, version)
        if n in client.adapters():
            return False
        canary(client, self.cfg, n)  # the first request makes the resolver load it
        rep.actions.append(f"resolved {n} (canary differs from base)")
        return True

    def undo(self, client: InstanceClient, rep: InstanceReport) -> None:
        return None  # nothing was re-pointed: a resolved version name that no client asks for is harmless

    def cleanup(self, client: InstanceClient, rep: InstanceReport, name: str, keep: set[int]) -> None:
        return None


def resolver_layout_problems(cfg: ProjectConfig, name: str, version: int, path: Path) -> list[str]:
    """The lora_filesystem_resolver's rules for `<volume>/<NAME>-v<N>` (vllm/plugins/lora_resolvers).

    Directory name = requested model id; `adapter_config.json` has `peft_type: LORA` and
    `base_model_name_or_path` exactly the `vllm serve` model string; nothing leaves the root.
    """
    problems = []
    path = Path(path)
    root = os.path.realpath(cfg.volume.path)
    if path.name != version_name(name, version):
        problems.append(f"{path}: directory name must be the model id {version_name(name, version)!r}")
    for p in [path, *path.rglob("*")]:
        real = os.path.realpath(p)
        if os.path.commonpath([root, real]) != root:
            problems.append(f"{p}: real path {real} leaves the volume root {root} (the resolver refuses it)")
    try:
        acfg = load_json_file(path / "adapter_config.json", MIB)
    except (OSError, ValueError) as e:  # missing, not JSON, over the bounds
        return problems + [f"{path}/adapter_config.json: unreadable ({e})"]
    if acfg.get("peft_type") != "LORA":
        problems.append(
            f"{path}/adapter_config.json: peft_type is {acfg.get('peft_type')!r}, the resolver needs 'LORA'"
        )
    if acfg.get("base_model_name_or_path") != cfg.served.model:
        problems.append(
            f"{path}/adapter_config.json: base_model_name_or_path is {acfg.get('base_model_name_or_path')!r}, "
            f"the resolver needs the exact `vllm serve` model string served.model={cfg.served.model!r}"
        )
    return problems


def loading_mode(cfg: ProjectConfig) -> LoadingMode:
    """The fleet's loading mode (`fleet.loading_mode`); api mode with the swap plan of `fleet.vllm_version`.

    Raises UsageError: `fleet.swap_strategy: repoint` where it is unsafe (`pipeline.serving.swap`).
    """
    if cfg.fleet.loading_mode == "resolver":
        return ResolverMode(cfg)
    return ApiMode(cfg, swap_plan(cfg.fleet.vllm_version, cfg.fleet.swap_strategy))


def resolve_served_name(cfg: ProjectConfig, name: str) -> str:
    """The model id clients send for adapter `name` now: `<NAME>-v<N>` of the desired version, or
    `<NAME>` under the `repoint` strategy. Raises UsageError when `name` has no desired version."""
    version = load_state(cfg.volume.path).version(name)
    if version is None:
        raise UsageError(
            f"{name}: no desired version in {cfg.volume.path}/fleet-state.json (publish it first: "
            f"pipeline publish {name} --version N)"
        )
    return loading_mode(cfg).served_name(name, version)
