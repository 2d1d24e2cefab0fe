"""One shape for "a list of problems": a `Finding` (id, severity, message, where) and a `Report`.

Dataset checks, training-config checks, adapter validation, canary and fleet reports all speak
in findings: a stable check id (`area.what`, documented in docs/validation.md), a severity, a
message that says what is wrong and how to fix it, and where (file:line, tensor, instance).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")


@dataclass
class Finding:
    id: str  # stable check id, e.g. "keys.shape"
    severity: str  # one of SEVERITIES
    message: str  # what is wrong and how to fix it
    where: str = ""  # file:line, file:tensor, instance...

    def __str__(self) -> str:
        loc = f"{self.where}: " if self.where else ""
        return f"{loc}{self.severity}: {self.message} [{self.id}]"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    """Findings in the order they were found; `ok` when none is an error."""

    findings: list[Finding] = field(default_factory=list)

    def add(self, id: str, severity: str, message: str, where: str = "") -> Finding:
        f = Finding(id, severity, message, where)
        self.findings.append(f)
        return f

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors
