"""Validation checks as data: each check is a named rule (id, severity, area, doc line, one function).

A check function takes the facts it reads (its signature names the protocol: `Facts`, `AdapterFacts` or
`TrainFacts`, `pipeline.validate.facts`) and yields `Issue`s; the orchestrator (`run`)
turns them into findings with the check's id and severity, so every finding of a run comes from one
registered rule. A check that needs a fact the context could not establish (no base, unreadable
weights...) raises `Unavailable` through the context and is skipped: the missing fact is reported
once, by its own check. Like vLLM's `PEFTHelper._validate_features` every problem is collected and
reported together; like axolotl's `utils/schemas/` there is one named validator per rule.

`docs/validation.md`'s check table is generated from `RULES` (`python -m pipeline.validate.docs`);
tests fail when the two differ or when a registered id has no failing fixture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline.findings import SEVERITIES, Report
from pipeline.serving.versions import RANGES
from pipeline.validate.facts import Unavailable

__all__ = [
    "RULES",
    "CheckSpec",
    "Issue",
    "Unavailable",
    "check",
    "grouped",
    "rules_version",
    "run",
    "specs",
]

SCOPES = ("adapter", "train")
# Areas in the order their checks run (a later area may rely on facts an earlier one established).
AREAS = (
    "adapter",
    "base",
    "config",
    "fleet",
    "serving",
    "weights",
    "keys",
    "values",
    "served",
    "tokenizer",
    "template",
    "behaviour",
    "train",
)


@dataclass(frozen=True)
class Issue:
    """What a check yields: message (what is wrong and how to fix it), where, optional severity override."""

    message: str
    where: str = ""
    severity: str | None = None


def grouped(issues, what: str = "tensors"):
    """One Issue per distinct message: a finding repeated for many tensors or modules (one root cause:
    a wrong `r`, a re-save in the wrong dtype) is said once, with the count and three of the places;
    `where` is the first place."""
    by: dict[str, list[Issue]] = {}
    for i in issues:
        by.setdefault(i.message, []).append(i)
    for msg, items in by.items():
        if len(items) == 1:
            yield items[0]
            continue
        names = [i.where.rsplit(":", 1)[-1] for i in items]
        yield Issue(
            f"{msg} [{len(items)} {what}, e.g. {', '.join(names[:3])}]", items[0].where, items[0].severity
        )


@dataclass(frozen=True)
class CheckSpec:
    id: str  # stable, `area.what`
    severity: str  # default severity
    area: str
    doc: str  # one line: when it fires (the docs table)
    fn: Callable
    scopes: tuple[str, ...] = ("adapter",)  # "adapter": validate; "train": `pipeline train` config checks
    option: str | None = None  # run only when this option is on (e.g. "behaviour")
    severity_doc: str | None = None  # when the severity varies, how (docs table)


RULES: dict[str, CheckSpec] = {}


def check(
    id: str,
    severity: str,
    doc: str,
    *,
    scopes: tuple[str, ...] = ("adapter",),
    option: str | None = None,
    severity_doc: str | None = None,
):
    """Register the decorated function as check `id` (area = the id's first part)."""
    area = id.split(".")[0]
    assert severity in SEVERITIES and area in AREAS and set(scopes) <= set(SCOPES), id

    def deco(fn):
        assert id not in RULES, f"check {id} registered twice"
        RULES[id] = CheckSpec(id, severity, area, doc, fn, tuple(scopes), option, severity_doc)
        return fn

    return deco


def specs(scope: str = "adapter", options: Iterable[str] = ()) -> list[CheckSpec]:
    """The checks of `scope` in run order: by area, then registration order."""
    opts = set(options)
    order = {a: i for i, a in enumerate(AREAS)}
    chosen = [s for s in RULES.values() if scope in s.scopes and (s.option is None or s.option in opts)]
    return sorted(chosen, key=lambda s: order[s.area])  # stable: registration order within an area


def run(ctx, report: Report, scope: str = "adapter", options: Iterable[str] = ()) -> Report:
    """Run every check of `scope` on `ctx`, adding one finding per yielded Issue to `report`."""
    for spec in specs(scope, options):
        try:
            for issue in spec.fn(ctx) or ():
                report.add(spec.id, issue.severity or spec.severity, issue.message, issue.where)
        except Unavailable:
            continue
        except Exception as e:  # noqa: BLE001 - a bug in one rule must not hide the others or print a traceback
            report.add(
                spec.id,
                "error",
                f"this check could not run ({type(e).__name__}: {e}); the input may be malformed in a way the "
                "pipeline does not name yet: please report it with the adapter's adapter_config.json and header",
                getattr(ctx, "where_config", ""),
            )
    return report


def rules_version() -> str:
    """A digest of the rule set (ids, severities, docs, scopes): verdicts record it, publish compares it."""
    h = hashlib.sha256()
    for s in sorted(RULES.values(), key=lambda s: s.id):
        h.update(f"{s.id}|{s.severity}|{s.doc}|{s.scopes}|{s.option}\n".encode())
    h.update(repr(RANGES).encode())
    return h.hexdigest()[:16]
