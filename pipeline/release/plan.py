"""What publish, promote and rollback would do (`--dry-run`): the same checks and choices, read only.

A plan takes no lock, writes no record and contacts no instance: it resolves the version, runs the
checks that need no writing (the name, the validation verdict, the gate, the canary, the version
directory on the volume against its manifest), and says what would move: the volume directory,
the desired state, the aliases, the instances to switch. Another command may change things
between the plan and the real command; the real one decides again under its lock.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import registry
from pipeline.artifacts.names import check_name
from pipeline.artifacts.volume import verify_version_dir, version_dir
from pipeline.canary import gate as canary_gate
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, UsageError
from pipeline.fleet.state import load_state
from pipeline.release.publish import PublishError, _replaces, gate_override
from pipeline.release.rollback import check_rollback_dir, rollback_target
from pipeline.release.transaction import load_intent


def _pending(cfg: ProjectConfig, name: str) -> str | None:
    intent = load_intent(Path(cfg.volume.path), name)
    return f"an unfinished {intent.describe()} is completed or undone first" if intent else None


def _instances(cfg: ProjectConfig) -> list[str]:
    return [i.name for i in cfg.fleet.instances]


def publish_plan(
    cfg: ProjectConfig,
    name: str,
    version: int | None = None,
    alias: str | None = None,
    *,
    force: bool = False,
    action: str = "publish",
) -> dict:
    """What `publish(cfg, name, version, alias, force=force)` would do, as a JSON-ready dict.

    Raises what `publish` raises before it writes: UsageError (name, version, alias), CheckFailed
    (validation verdict, gate without `force`, canary), PublishError (the version directory on the
    volume differs from its manifest).
    """
    check_name(name, served=cfg.served_base_names)  # the grammar and the base's served names, as publish
    mv = registry.resolve_version(cfg, name, version, alias)
    target = int(mv.version)
    tags = mv.tags or {}
    warnings = canary_gate(cfg, mv)
    override = gate_override(mv, force, False)
    if override:
        warnings.append(override)
    if tags.get("validation.verdict") != "pass":
        raise CheckFailed(
            f"{name} v{target}: validation verdict is {tags.get('validation.verdict')!r}; only a passing "
            "version is published (see `pipeline validate` and the version's validation.report tag)"
        )
    volume = Path(cfg.volume.path)
    d = version_dir(volume, name, target)
    if d.exists() and (problems := verify_version_dir(d, cache=False)):
        raise PublishError(f"{d} differs from its manifest (volume tampered?):\n  " + "\n  ".join(problems))
    aliases = registry.aliases(cfg, name)
    prod = aliases.get(registry.ALIAS_PRODUCTION)
    state = load_state(volume)
    previous = _replaces(cfg, name, target, prod, state.version(name))
    return {
        "dry_run": True,
        "action": action,
        "name": name,
        "version": target,
        "path": str(d),
        "write": not d.exists(),  # False: already on the volume, verified, not rewritten
        "production": {"from": prod, "to": target},
        "previous": {"from": aliases.get(registry.ALIAS_PREVIOUS), "to": previous},
        "desired": {"from": state.version(name), "to": target},
        "instances": _instances(cfg),
        "pending": _pending(cfg, name),
        "warnings": warnings,
    }


def rollback_plan(cfg: ProjectConfig, name: str, to: int | None = None) -> dict:
    """What `rollback(cfg, name, to)` would do, as a JSON-ready dict.

    Raises what `rollback` raises before it changes anything: UsageError (unknown model or version,
    nothing in production, no earlier version, the directory pruned), PublishError (tampered directory,
    another origin).
    """
    check_name(name)
    registry.versions(cfg, name)  # UsageError naming the registered models if `name` is unknown
    state = load_state(Path(cfg.volume.path))
    aliases = registry.aliases(cfg, name)
    prod, prev = aliases.get(registry.ALIAS_PRODUCTION), aliases.get(registry.ALIAS_PREVIOUS)
    cur = prod if prod is not None else state.version(name)
    if cur is None:
        raise UsageError(f"{name}: nothing is in production (no `production` alias, no desired state)")
    target = rollback_target(state, name, to, cur, prev)
    mv = registry.resolve_version(cfg, name, version=target)
    noop = prod == target and state.version(name) == target
    if not noop:
        check_rollback_dir(cfg, mv)
    return {
        "dry_run": True,
        "action": "rollback",
        "name": name,
        "from_version": cur,
        "to_version": target,
        "path": str(version_dir(Path(cfg.volume.path), name, target)),
        "production": {"from": prod, "to": target},
        "previous": {"from": prev, "to": cur if not noop else prev},
        "desired": {"from": state.version(name), "to": target},
        "instances": _instances(cfg),
        "pending": _pending(cfg, name),
        "changes": not noop,
    }
