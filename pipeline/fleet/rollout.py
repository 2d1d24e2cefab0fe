"""Make every fleet instance serve the desired adapter versions: rollout, sync, status, rollback, prune.

Protocol per instance in `api` loading mode (vLLM facts in ../shared/design/vllm-lora.md):
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.volume import VERSION_RE, version_dir, version_name
from pipeline.config import Instance, ProjectConfig
from pipeline.errors import FleetError, UsageError
from pipeline.fleet.client import InstanceClient, InstanceError, Unreachable
from pipeline.fleet.state import FleetState, fleet_lock, load_state, save_state


def instance_path(cfg: ProjectConfig, name: str, version: int) -> str:
    """Where instances see `<volume>/<NAME>-v<N>` (`fleet.volume_mount` + the directory name)."""
    return f"{cfg.fleet.volume_mount.rstrip('/')}/{version_name(name, version)}"


@dataclass
class InstanceReport:
    """What happened on one instance; `ok` is False when it did not reach the target."""

    instance: str
    url: str
    ok: bool = False
    actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    restored: bool = False  # a failed rollout put this instance back as it was
    # rollout bookkeeping for the undo: adapters as they were, names this rollout changed
    before: dict[str, str | None] = field(default_factory=dict, repr=False)
    touched: list[str] = field(default_factory=list, repr=False)

    def line(self) -> str:
        what = "FAILED" if not self.ok else ("switched, then restored" if self.restored else "ok")
        head = f"{self.instance} ({self.url}): {what}"
        parts = [head] + [f"    {a}" for a in self.actions]
        parts += [f"    error: {e}" for e in self.errors] + [f"    warning: {w}" for w in self.warnings]
        return "\n".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("before")
        d.pop("touched")
        return d


def _each_instance(cfg: ProjectConfig, fn) -> list[InstanceReport]:
    """Run `fn(client, report)` on every instance concurrently; exceptions land in the report."""

    def one(inst: Instance) -> InstanceReport:
        rep = InstanceReport(inst.name, inst.url)
        try:
            with InstanceClient(inst, cfg.fleet.timeout_s) as client:
                fn(client, rep)
                rep.ok = not rep.errors
        except (InstanceError, FleetError) as e:
            rep.errors.append(str(e))
        return rep

    insts = cfg.fleet.instances
    if not insts:
        raise UsageError("no fleet instances configured (fleet.instances in pipeline.yaml)")
    # Missing API keys are usage errors for the whole command: check before touching anything.
    for inst in insts:
        InstanceClient(inst, cfg.fleet.timeout_s).close()
    with ThreadPoolExecutor(max_workers=len(insts)) as pool:
        return list(pool.map(one, insts))


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


def _point(
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


def _unload_old(
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


def _probe_resolver(client: InstanceClient, cfg: ProjectConfig, rep: InstanceReport, name: str, version: int):
    _canary(client, cfg, version_name(name, version))
    rep.actions.append(f"resolved {version_name(name, version)} (canary differs from base)")


# -- rollout (publish) ---------------------------------------------------------------------------
def _failure(title: str, reports: list[InstanceReport]) -> FleetError:
    bad = sum(not r.ok for r in reports)
    return FleetError(
        f"{title}: failed on {bad} of {len(reports)} instance(s)\n" + "\n".join(r.line() for r in reports)
    )


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
            reports = _each_instance(cfg, lambda c, r: _probe_resolver(c, cfg, r, name, version))
            if not all(r.ok for r in reports):
                raise _failure(
                    f"rollout of {name} v{version} (resolver mode; desired state unchanged)", reports
                )
        else:

            def switch(client: InstanceClient, rep: InstanceReport) -> None:
                rep.before = client.adapters()
                _point(client, cfg, rep, name, version, dict(rep.before))

            reports = _each_instance(cfg, switch)
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
                raise _failure(
                    f"rollout of {name} v{version} undone (stable name restored, desired state and aliases unchanged)",
                    reports,
                )
        state = load_state(cfg.volume.path)
        state.set(name, version)
        save_state(cfg.volume.path, state)
        if cfg.fleet.loading_mode == "api":
            cleanup = _each_instance(cfg, lambda c, r: _unload_old(c, cfg, r, name, version))
            for rep, extra in zip(reports, cleanup, strict=True):  # best effort: warnings, not failures
                rep.actions += extra.actions
                rep.warnings += extra.warnings + extra.errors
    return reports


# -- sync ----------------------------------------------------------------------------------------
def _reconcile(client: InstanceClient, cfg: ProjectConfig, state: FleetState, rep: InstanceReport) -> None:
    client.adapters()  # Unreachable first: that is the instance's state, whatever the volume holds
    for name, entry in sorted(state.adapters.items()):
        version = int(entry["version"])
        if not (Path(cfg.volume.path) / version_name(name, version)).is_dir():
            rep.errors.append(
                f"{name} v{version}: {cfg.volume.path}/{version_name(name, version)} is missing "
                f"(pruned?): publish it again or roll back"
            )
            continue
        try:
            if cfg.fleet.loading_mode == "resolver":
                _probe_resolver(client, cfg, rep, name, version)
                continue
            _point(client, cfg, rep, name, version, client.adapters())
            _unload_old(client, cfg, rep, name, version)
        except Unreachable:
            raise
        except InstanceError as e:
            rep.errors.append(f"{name} v{version}: {e}")


def sync_locked(cfg: ProjectConfig) -> list[InstanceReport]:
    """`sync` for a caller already holding the fleet lock."""
    state = load_state(cfg.volume.path)
    return _each_instance(cfg, lambda c, r: _reconcile(c, cfg, state, r))


def sync(cfg: ProjectConfig) -> list[InstanceReport]:
    """Bring every reachable instance to the desired state; idempotent (no request when in sync).

    Returns one report per instance (`ok` False: unreachable or an adapter failed to load or
    verify). Raises LockedError when another fleet operation holds the lock.
    """
    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        return sync_locked(cfg)


# -- status --------------------------------------------------------------------------------------
@dataclass
class StatusRow:
    """One instance x adapter: state is ok | missing | stale | unknown | unreachable | error."""

    instance: str
    adapter: str | None
    desired: int | None
    serving: str | None  # the version (as "vN") or the raw root path the instance serves
    state: str
    detail: str = ""


def _served_version(root: str | None) -> str | None:
    if root is None:
        return None
    m = VERSION_RE.match(os.path.basename(root.rstrip("/")))
    return f"v{m['version']}" if m else root


def status(cfg: ProjectConfig) -> list[StatusRow]:
    """What each instance serves against the desired state (read-only, no lock)."""
    state = load_state(cfg.volume.path)
    rows: list[StatusRow] = []

    def one(client: InstanceClient, rep: InstanceReport) -> None:
        try:
            loaded = client.adapters()
        except Unreachable as e:
            rows.append(StatusRow(client.name, None, None, None, "unreachable", str(e)))
            return
        known = set()
        for name, entry in sorted(state.adapters.items()):
            v = int(entry["version"])
            target = instance_path(cfg, name, v)
            served_name = version_name(name, v) if cfg.fleet.loading_mode == "resolver" else name
            known |= {name} | {n for n in loaded if (m := VERSION_RE.match(n)) and m["name"] == name}
            root = loaded.get(served_name)
            st = "missing" if root is None else ("ok" if root == target else "stale")
            detail = (
                "resolver loads it on first request (fleet sync warms it)"
                if (st == "missing" and cfg.fleet.loading_mode == "resolver")
                else ""
            )
            rows.append(StatusRow(client.name, name, v, _served_version(root), st, detail))
        for n in sorted(set(loaded) - known):
            rows.append(
                StatusRow(client.name, n, None, _served_version(loaded[n]), "unknown", "not in desired state")
            )

    reports = _each_instance(cfg, one)
    for r in reports:
        if r.errors:
            rows.append(StatusRow(r.instance, None, None, None, "error", "; ".join(r.errors)))
    order = {i.name: k for k, i in enumerate(cfg.fleet.instances)}
    return sorted(rows, key=lambda r: (order.get(r.instance, 0), r.adapter or ""))


# -- rollback and prune -----------------------------------------------------------------------------
def rollback(cfg: ProjectConfig, name: str, to: int | None = None) -> tuple[int, int, list[InstanceReport]]:
    """Make `to` (default: the previously desired version) the desired version of `name` and sync.

    Moves MLflow alias `production` to it (`previous` to the version it replaces).
    Returns (from_version, to_version, reports). Raises UsageError: no desired state for `name`,
    no previous version, or the version directory was pruned (publish it again instead).
    """
    from pipeline import registry
    from pipeline.artifacts.manifest import read_manifest, verify_files

    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        state = load_state(cfg.volume.path)
        # Without a fleet (or before its first rollout) the registry's aliases are the record.
        if state.version(name) is None:
            registry.versions(cfg, name)  # UsageError naming the registered models if `name` is unknown
        cur = state.version(name) or registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
        if cur is None:
            raise UsageError(f"{name}: nothing is in production (no desired state, no `production` alias)")
        target = to if to is not None else (state.previous(name) if state.version(name) is not None else None)
        target = target or registry.alias_version(cfg, name, registry.ALIAS_PREVIOUS)
        if target is None:
            raise UsageError(f"{name}: no earlier version to roll back to; pass --to N")
        registry.resolve_version(cfg, name, version=target)  # UsageError listing the versions that exist
        d = version_dir(cfg.volume.path, name, target)
        if not d.is_dir():
            raise UsageError(
                f"{d}: not on the volume (pruned?); publish it: pipeline publish {name} --version {target}"
            )
        problems = verify_files(d, read_manifest(d)["files"])
        if problems:
            raise UsageError(f"{d} differs from its manifest:\n  " + "\n  ".join(problems))
        state.set(name, target)
        save_state(cfg.volume.path, state)
        reports = sync_locked(cfg) if cfg.fleet.instances else []
        # The alias follows the desired state even if an instance is down (sync converges it later);
        # the rollback event records which instances confirmed.
        confirmed = [r.instance for r in reports if r.ok]
        if registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION) not in (None, target):
            registry.rollback_aliases(cfg, name, target, instances=confirmed)
        else:
            registry.set_alias(cfg, name, registry.ALIAS_PRODUCTION, target)
        return cur, target, reports


def prune(cfg: ProjectConfig, name: str, keep: int, force: bool = False) -> list[Path]:
    """Delete `<volume>/<NAME>-v<K>` directories beyond the newest `keep`, never the desired version.

    Unloads the pruned version names from the instances first. Refuses (FleetError) when an
    instance still serves a version to prune or is unreachable (unless `force`).
    Returns the deleted directories.
    """
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    vol = Path(cfg.volume.path)
    with fleet_lock(vol, cfg.fleet.lock_timeout_s):
        desired = load_state(vol).version(name)
        versions = sorted(
            (
                int(m["version"])
                for p in vol.iterdir()
                if p.is_dir() and (m := VERSION_RE.match(p.name)) and m["name"] == name
            ),
            reverse=True,
        )
        doomed = [v for v in versions[keep:] if v != desired]
        if not doomed:
            return []
        doomed_paths = {instance_path(cfg, name, v) for v in doomed}

        serving: list[str] = []

        def unload(client: InstanceClient, rep: InstanceReport) -> None:
            loaded = client.adapters()
            if loaded.get(name) in doomed_paths:
                serving.append(client.name)
                raise FleetError(
                    f"{client.name}: still serves {name} from {loaded[name]}: run `pipeline fleet sync` first"
                )
            for v in doomed:
                if version_name(name, v) in loaded:
                    client.unload(version_name(name, v))
                    rep.actions.append(f"unloaded {version_name(name, v)}")

        reports = _each_instance(cfg, unload) if cfg.fleet.instances else []
        if serving or (not force and not all(r.ok for r in reports)):
            raise _failure(
                f"prune of {name} refused (nothing deleted; --force skips unreachable instances)", reports
            )
        removed = []
        for v in doomed:
            d = vol / version_name(name, v)
            rmtree(d)
            removed.append(d)
        return removed
