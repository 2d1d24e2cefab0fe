"""Make every fleet instance serve the desired adapter versions: rollout, sync, status, rollback, prune.

Protocol per instance in `api` loading mode (vLLM facts in docs/vllm.md):
1. load the version name `<NAME>-v<N>` from `<volume_mount>/<NAME>-v<N>` (absolute, instance-side);
2. point the stable name `<NAME>` at that path with `load_inplace` (plain load the first time).
   The path is new, and vLLM keys prefix-cache blocks on (lora name, lora path), so no KV
   computed with the old weights is reused; in-flight requests keep running;
3. verify: `/v1/models` lists `<NAME>` with `root` = the new path;
4. canary: a greedy completion through `<NAME>` differs from the base's.
All instances run concurrently (one thread each). A rollout that fails anywhere restores the
stable name (and unloads the new version name) on every instance it touched, then raises
`FleetError`; the desired state (`pipeline.fleet.state`) changes only after every instance
confirmed. Version names beyond `fleet.keep_versions` are then unloaded (directories stay on
the volume for rollback until `pipeline fleet prune`).

In `resolver` mode (vLLM's lora_filesystem_resolver over the volume) nothing is loaded through
the API: clients request `<NAME>-v<N>`; the rollout checks the resolver's layout rules and that
each instance answers for the version name with output differing from the base.

Whole operations hold the volume's fleet lock so that a `fleet sync --watch` sidecar never
reverts an instance mid-publish.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.artifacts.volume import VERSION_RE, version_name
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError
from pipeline.fleet.client import InstanceClient, InstanceError
from pipeline.fleet.instances import InstanceReport, each_instance, failure, instance_path
from pipeline.fleet.state import fleet_lock, load_state, save_state


def _canary(client: InstanceClient, cfg: ProjectConfig, model: str) -> None:
    """Raise InstanceError unless `model`'s greedy output differs from the base's."""
    prompt, n = cfg.fleet.canary_prompt, cfg.fleet.canary_max_tokens
    base = client.complete(cfg.served_base_name, prompt, n)
    out = client.complete(model, prompt, n)
    if out == base:
        raise InstanceError(
            f"{client.name}: canary: greedy output of {model!r} equals the base's ({out!r}) for "
            f"fleet.canary_prompt: the adapter has no effect there (all-zero lora_B? modules outside "
            f"--lora-target-modules?)"
        )


def point(
    client: InstanceClient,
    cfg: ProjectConfig,
    rep: InstanceReport,
    name: str,
    version: int,
    current: dict[str, str | None],
) -> bool:
    """Make the version name and then the stable name serve `version`; returns True if anything changed."""
    target = instance_path(cfg, name, version)
    changed = False
    for n in (version_name(name, version), name):
        if current.get(n) == target:
            continue
        inplace = n in current
        rep.touched.append(n)
        client.load(n, target, inplace=inplace)
        rep.actions.append(f"{'re-pointed' if inplace else 'loaded'} {n} -> {target}")
        changed = True
    served = client.adapters().get(name)
    if served != target:
        raise InstanceError(
            f"{client.name}: /v1/models lists {name} with root {served!r}, expected {target!r}"
        )
    if changed:
        _canary(client, cfg, name)
        rep.actions.append(f"verified {name} (root {target}, canary differs from base)")
    return changed


def unload_old(
    client: InstanceClient, cfg: ProjectConfig, rep: InstanceReport, name: str, current: int
) -> None:
    """Unload version names of `name` beyond `fleet.keep_versions`, never the one being served."""
    loaded = client.adapters()
    versions = {}
    for n in loaded:
        m = VERSION_RE.match(n)
        if m and m["name"] == name:
            versions[int(m["version"])] = n
    others = sorted((v for v in versions if v != current), reverse=True)
    for v in others[cfg.fleet.keep_versions - 1 :]:
        try:
            client.unload(versions[v])
            rep.actions.append(f"unloaded {versions[v]} (beyond keep_versions={cfg.fleet.keep_versions})")
        except InstanceError as e:
            rep.warnings.append(str(e))


def _undo(client: InstanceClient, rep: InstanceReport) -> None:
    """Put the names this rollout changed back as they were (stable name first)."""
    for n in reversed(rep.touched):
        try:
            if rep.before.get(n):
                client.load(n, rep.before[n], inplace=True)
                rep.actions.append(f"restored {n} -> {rep.before[n]}")
            else:
                client.unload(n)
                rep.actions.append(f"unloaded {n}")
        except InstanceError as e:
            rep.errors.append(f"restore of {n} failed: {e}")


# -- resolver mode -----------------------------------------------------------------------------
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
        acfg = json.loads((path / "adapter_config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
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


def probe_resolver(client: InstanceClient, cfg: ProjectConfig, rep: InstanceReport, name: str, version: int):
    _canary(client, cfg, version_name(name, version))
    rep.actions.append(f"resolved {version_name(name, version)} (canary differs from base)")


def rollout(cfg: ProjectConfig, name: str, version: int, path: Path) -> list[InstanceReport]:
    """Make every instance serve `<volume>/<NAME>-v<N>` (`path`) as `name`, then record it as desired.

    Returns one report per instance. Raises:
        FleetError (exit 4): an instance failed (unreachable, load refused, wrong root, canary equal
            to base); every instance is restored to what it served before, and the desired state
            is unchanged. The message holds the per-instance report.
        LockedError (exit 3): another fleet operation holds the lock past `fleet.lock_timeout_s`.
        UsageError: no instances configured, an API key variable unset.
    """
    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        if cfg.fleet.loading_mode == "resolver":
            problems = resolver_layout_problems(cfg, name, version, path)
            if problems:
                raise FleetError(
                    f"{path}: not servable by vLLM's filesystem resolver:\n  " + "\n  ".join(problems)
                )
            reports = each_instance(cfg, lambda c, r: probe_resolver(c, cfg, r, name, version))
            if not all(r.ok for r in reports):
                raise failure(
                    f"rollout of {name} v{version} (resolver mode; desired state unchanged)", reports
                )
        else:

            def switch(client: InstanceClient, rep: InstanceReport) -> None:
                rep.before = client.adapters()
                point(client, cfg, rep, name, version, dict(rep.before))

            reports = each_instance(cfg, switch)
            if not all(r.ok for r in reports):
                restore = [r for r in reports if r.touched]
                by_name = {i.name: i for i in cfg.fleet.instances}

                def undo(rep: InstanceReport) -> None:
                    try:
                        with InstanceClient(by_name[rep.instance], cfg.fleet.timeout_s) as client:
                            n_errors = len(rep.errors)
                            _undo(client, rep)
                            rep.restored = len(rep.errors) == n_errors
                    except InstanceError as e:
                        rep.errors.append(f"restore failed: {e}")

                with ThreadPoolExecutor(max_workers=max(1, len(restore))) as pool:
                    list(pool.map(undo, restore))
                raise failure(
                    f"rollout of {name} v{version} undone (stable name restored, desired state and aliases unchanged)",
                    reports,
                )
        state = load_state(cfg.volume.path)
        state.set(name, version)
        save_state(cfg.volume.path, state)
        if cfg.fleet.loading_mode == "api":
            cleanup = each_instance(cfg, lambda c, r: unload_old(c, cfg, r, name, version))
            for rep, extra in zip(reports, cleanup, strict=True):  # best effort: warnings, not failures
                rep.actions += extra.actions
                rep.warnings += extra.warnings + extra.errors
    return reports
