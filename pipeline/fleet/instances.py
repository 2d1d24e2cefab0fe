"""Running one operation on every fleet instance at once, and the per-instance report it leaves."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pipeline.artifacts.volume import version_name
from pipeline.config import Instance, ProjectConfig
from pipeline.errors import FleetError, UsageError
from pipeline.fleet.client import InstanceClient, InstanceError


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


def each_instance(cfg: ProjectConfig, fn) -> list[InstanceReport]:
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


# -- rollout (publish) ---------------------------------------------------------------------------
def failure(title: str, reports: list[InstanceReport]) -> FleetError:
    bad = sum(not r.ok for r in reports)
    return FleetError(
        f"{title}: failed on {bad} of {len(reports)} instance(s)\n" + "\n".join(r.line() for r in reports)
    )
