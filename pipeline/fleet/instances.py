"""Running one operation on every fleet instance at once, and the per-instance report it leaves.

A report holds `pipeline.findings.Finding`s (`where` = the instance) and the actions taken. The finding ids
of fleet operations, their severity and meaning are declared in `pipeline/validate/catalogue.py` (the one
catalogue of finding ids; docs/validation.md "Findings of other commands" is generated from it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline.artifacts.volume import version_name
from pipeline.config import FleetSection, Instance
from pipeline.errors import FleetError, UsageError
from pipeline.findings import Finding
from pipeline.fleet.client import Hung, InstanceClient, InstanceError, Timeouts, Unreachable

NO_ANSWER = ("fleet.unreachable", "fleet.hung")


def instance_path(fleet: FleetSection, name: str, version: int) -> str:
    """Where instances see `<volume>/<NAME>-v<N>` (`fleet.volume_mount` + the directory name)."""
    return f"{fleet.volume_mount.rstrip('/')}/{version_name(name, version)}"


@dataclass
class InstanceReport:
    """What happened on one instance; `ok` is False when it did not reach the target."""

    instance: str
    url: str
    ok: bool = False
    actions: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    restored: bool = False  # a failed rollout put this instance back as it was
    unknown: bool = False  # a change was sent without an answer: what it serves is unknown
    vllm_version: str | None = None  # as `GET /version` reported it
    # rollout bookkeeping for the undo: adapters as they were, names this rollout changed
    before: dict[str, str | None] = field(default_factory=dict, repr=False)
    touched: list[str] = field(default_factory=list, repr=False)

    def add(self, id: str, severity: str, message: str) -> Finding:
        f = Finding(id, severity, message, self.instance)
        self.findings.append(f)
        return f

    def error(self, id: str, message: str) -> Finding:
        return self.add(id, "error", message)

    def warn(self, id: str, message: str) -> Finding:
        return self.add(id, "warning", message)

    def fail(self, e: InstanceError | FleetError) -> None:
        """Record an exception that ended this instance's part of the operation."""
        if isinstance(e, InstanceError):
            self.unknown = self.unknown or e.outcome_unknown
            check = getattr(e, "check", None) or (
                "fleet.hung"
                if isinstance(e, Hung)
                else ("fleet.unreachable" if isinstance(e, Unreachable) else "fleet.request_failed")
            )
        else:
            check = "fleet.refused"
        self.error(check, str(e))

    @property
    def errors(self) -> list[str]:
        return [f.message for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[str]:
        return [f.message for f in self.findings if f.severity == "warning"]

    @property
    def hung(self) -> bool:
        return any(f.id == "fleet.hung" for f in self.findings)

    @property
    def answered(self) -> bool:
        """False when the instance's only errors are that it did not answer (down or hung)."""
        errs = [f for f in self.findings if f.severity == "error"]
        return not errs or any(f.id not in NO_ANSWER for f in errs)

    @property
    def outcome(self) -> str:
        if self.restored:
            return "switched, then restored"
        if self.ok:
            return "ok"
        if self.hung:
            return "HUNG (serving unknown)" if self.unknown else "HUNG"
        if not self.answered:
            return "UNREACHABLE (serving unknown)" if self.unknown else "UNREACHABLE"
        return "FAILED (serving unknown)" if self.unknown else "FAILED"

    def line(self) -> str:
        head = f"{self.instance} ({self.url}): {self.outcome}"
        if self.vllm_version:
            head += f" [vLLM {self.vllm_version}]"
        parts = [head] + [f"    {a}" for a in self.actions]
        parts += [f"    {f.severity}: {f.message} [{f.id}]" for f in self.findings if f.severity != "info"]
        return "\n".join(parts)

    def to_dict(self) -> dict:
        return {
            "instance": self.instance,
            "url": self.url,
            "ok": self.ok,
            "outcome": self.outcome,
            "actions": self.actions,
            "errors": self.errors,
            "warnings": self.warnings,
            "findings": [f.to_dict() for f in self.findings],
            "restored": self.restored,
            "unknown": self.unknown,
            "vllm_version": self.vllm_version,
        }


def client_for(fleet: FleetSection, inst: Instance) -> InstanceClient:
    return InstanceClient(inst, Timeouts.of(fleet))


def each_instance(fleet: FleetSection, fn, only: list[str] | None = None) -> list[InstanceReport]:
    """Run `fn(client, report)` on every instance (or those named in `only`) concurrently.

    Exceptions (`InstanceError`, `FleetError`) land in the report as findings; `ok` is set when
    `fn` returned with no error finding.
    """

    def one(inst: Instance) -> InstanceReport:
        rep = InstanceReport(inst.name, inst.url)
        try:
            with client_for(fleet, inst) as client:
                fn(client, rep)
        except (InstanceError, FleetError) as e:
            rep.fail(e)
        rep.ok = not rep.errors
        return rep

    insts = [i for i in fleet.instances if only is None or i.name in only]
    if not fleet.instances:
        raise UsageError("no fleet instances configured (fleet.instances in pipeline.yaml)")
    # Missing API keys are usage errors for the whole command: check before touching anything.
    for inst in insts:
        client_for(fleet, inst).close()
    if not insts:
        return []
    with ThreadPoolExecutor(max_workers=len(insts)) as pool:
        return list(pool.map(one, insts))


def operator_hint(reports: list[InstanceReport]) -> str:
    """What to run next for instances that did not answer or whose serving is unknown ('' if none)."""
    lagging = [r.instance for r in reports if r.unknown or not r.answered]
    if not lagging:
        return ""
    return (
        f"\nnext: `pipeline fleet status` shows {', '.join(lagging)} as hung/unreachable/unknown; once it "
        f"answers again (or after a restart) run `pipeline fleet sync`: it loads the desired versions, "
        f"verifies them and clears the mark"
    )


def failure(title: str, reports: list[InstanceReport]) -> FleetError:
    bad = sum(not r.ok for r in reports)
    return FleetError(
        f"{title}: failed on {bad} of {len(reports)} instance(s)\n"
        + "\n".join(r.line() for r in reports)
        + operator_hint(reports)
    )
