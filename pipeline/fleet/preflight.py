"""Know what each instance really runs before anything changes: its vLLM version and its served model.

Every instance is asked `GET /version` and `GET /v1/models` (the base card: `id` = the served model
name, `root` = the model string given to `vllm serve`). An instance that runs another vLLM than
`fleet.vllm_version`, or serves another model than `served`, stops a publish before it writes
anything (exit 4), naming the instance: the pipeline's vLLM rules and swap strategy are chosen
for the configured version (`pipeline.serving.swap`, docs/vllm.md), so they would be wrong there.

Version strings: a release (`0.19.1`), a release candidate (`0.19.2rc1`) or a nightly
(`0.19.2rc1.dev123+gabcdef0`). They compare as PEP 440 versions; a configured version without a
local part (`+g...`, `+cpu`) matches any local part of the same version, one with a local part
matches only exactly. `0.19.2` does not match `0.19.2rc1.dev123+g...` (a nightly before 0.19.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from pipeline.config import FleetSection, ServedSection
from pipeline.fleet.client import InstanceClient
from pipeline.fleet.instances import InstanceReport, each_instance, failure


def same_version(configured: str, reported: str | None) -> bool:
    """Whether an instance reporting `reported` runs the configured vLLM version (see module doc)."""
    if reported is None:
        return False
    try:
        want, got = Version(configured.strip()), Version(reported.strip())
    except InvalidVersion:
        return configured.strip() == reported.strip()
    if want.local is not None:
        return want == got
    return Version(want.public) == Version(got.public)


@dataclass
class Served:
    """What one instance reports: vLLM version and base model cards (`id`, `root`)."""

    version: str | None
    models: list[tuple[str, str | None]]


def inspect(client: InstanceClient) -> Served:
    """Read `/version` and the base cards of `/v1/models`. Raises Unreachable / Hung."""
    return Served(client.version(), [(c.id, c.root) for c in client.base_cards()])


def check_served(
    fleet: FleetSection, served: ServedSection, client: InstanceClient, rep: InstanceReport
) -> bool:
    """Inspect the instance, record version and mismatches in `rep`; True when it runs `fleet.vllm_version`
    and serves the `served` model."""
    seen = inspect(client)
    rep.vllm_version = seen.version
    ok = True
    want = fleet.vllm_version
    if not same_version(want, seen.version):
        ok = False
        got = seen.version or "no version (GET /version failed)"
        rep.error(
            "fleet.version_mismatch",
            f"runs vLLM {got}, but fleet.vllm_version is {want}: the pipeline's vLLM rules and swap "
            f"strategy are chosen for {want}. Set fleet.vllm_version to what the instances run, or "
            f"upgrade/downgrade this instance",
        )
    names = {cid for cid, _ in seen.models}
    roots = {root for _, root in seen.models}
    if served.base_name not in names or (roots - {None} and served.model not in roots):
        ok = False
        got = ", ".join(f"{cid} (root {root})" for cid, root in seen.models) or "no base model"
        rep.error(
            "fleet.model_mismatch",
            f"serves {got}, but the project expects {served.base_name!r} (served.served_model_name, "
            f"else served.model) from {served.model!r} (served.model): adapters validated for the "
            f"configured checkpoint would run on another one",
        )
    return ok


def needed(fleet: FleetSection) -> int:
    """Instances that must confirm a publish: `fleet.min_healthy`, default (None) every instance."""
    n = len(fleet.instances)
    return n if fleet.min_healthy is None else min(fleet.min_healthy, n)


def preflight(
    fleet: FleetSection, served: ServedSection, title: str = "publish refused"
) -> list[InstanceReport]:
    """Check every instance before a publish changes anything; returns one report per instance.

    Raises:
        FleetError (exit 4): an answering instance runs another vLLM version or serves another
            model, or fewer instances answer than must confirm (`fleet.min_healthy`, default all).
            The message names each instance and says nothing was changed.
        UsageError: no instances configured, an API key variable unset.
    """

    def one(client: InstanceClient, rep: InstanceReport) -> None:
        check_served(fleet, served, client, rep)

    reports = each_instance(fleet, one)
    mismatched = [r for r in reports if r.answered and not r.ok]
    answering = [r for r in reports if r.ok]
    if mismatched or len(answering) < needed(fleet):
        why = (
            "instance(s) differ from the configured fleet"
            if mismatched
            else f"{len(answering)} of {len(reports)} instance(s) answer, {needed(fleet)} must "
            f"(fleet.min_healthy: {fleet.min_healthy or 'all'})"
        )
        raise failure(f"{title} before any change ({why}; nothing was changed)", reports)
    return reports
