"""What the MLflow UI shows an operator: the first line of each description, and the model's summary tags.

MLflow's UI (3.17) shows a version's description at the top of the version page, a registered
model's description at the top of its page, and a model's tags as a column of the model list. Its
aliases column shows one alias and hides the rest behind "+N", so the version in `production` can
hide behind a gated candidate; its green tick on a version means "registration READY", not
"passed". So the answers an operator looks for are put where the UI shows them first, rewritten
from the registry's own state after every change (register, gate, publish, promote, rollback):

- version description, first line (`headline`): `PUBLISHED to <path> at <time>`, `GATED, stays
  candidate: <reason>`, `NOT SHIPPABLE: validation fail ...`, or `candidate: ...not published`;
  the facts paragraph written at registration follows after a blank line;
- registered model tags: `production` (`v3`), `production.path` (its directory on the volume),
  `candidate` (`v4`, `v4 gated`); the model description says the same in words and that
  MLflow's "Promote model" button is not `pipeline promote`.

Everything here is derived and idempotent: running it twice writes nothing new, and a crash
between two writes is repaired by the next change. docs/registry.md, "`pipeline ui`".
"""

from __future__ import annotations

from pipeline.config import ProjectConfig
from pipeline.registry.store import mlflow_for
from pipeline.registry.tags import (
    ALIAS_CANDIDATE,
    ALIAS_PREVIOUS,
    ALIAS_PRODUCTION,
    GATE_REASON_TAG,
    GATE_VERDICT_TAG,
)

HEADLINES = (
    "PUBLISHED to ",
    "PRUNED from the volume",
    "GATED, stays candidate",
    "NOT SHIPPABLE",
    "candidate: ",
)
MODEL_TAGS = ("production", "production.path", "candidate")
PROMOTE_NOTE = (
    "Ship a version with `pipeline promote {name} VERSION` (volume, fleet, aliases in one transaction), "
    "or move the `production` alias while `pipeline follow-alias` runs. MLflow's own 'Promote model' "
    "button copies a version into another registered model and ships nothing."
)


def published_path(tags: dict[str, str]) -> str | None:
    """Where the version is on the volume now: `published.path`, unless `fleet prune` deleted it since
    (its `pruned` event is newer than the last publish). Ordered by record_event's `stamp` (UTC to the
    microsecond); `time` (to the second) only for versions recorded before stamps were kept: a publish
    in the same second as a prune was reported as pruned."""
    path = tags.get("published.path")
    if not path:
        return None
    if tags.get("pruned.stamp") and tags.get("published.stamp"):
        return None if tags["pruned.stamp"] >= tags["published.stamp"] else path
    pruned = tags.get("pruned.time")
    if pruned and pruned >= (tags.get("published.time") or ""):
        return None
    return path


def headline(tags: dict[str, str]) -> str:
    """The first line of a version's description, from its tags (no I/O)."""
    verdict = tags.get("validation.verdict") or "unknown"
    if verdict != "pass":
        return f"NOT SHIPPABLE: validation {verdict}; `pipeline publish` refuses it (`pipeline validate` says why)"
    if tags.get("published.path") and not published_path(tags):
        return (
            f"PRUNED from the volume at {tags.get('pruned.time')} (was published to {tags['published.path']}); "
            "`pipeline publish` or `rollback --to` copies it back"
        )
    if tags.get("published.path"):  # shipped: also a gated version someone shipped with --force
        forced = " (past the gate: shipped with --force)" if tags.get(GATE_VERDICT_TAG) == "gated" else ""
        return f"PUBLISHED to {tags['published.path']} at {tags.get('published.time') or '?'}{forced}"
    if tags.get(GATE_VERDICT_TAG) == "gated":
        return f"GATED, stays candidate: {tags.get(GATE_REASON_TAG) or 'no reason recorded'}"
    return "candidate: validation pass, not published yet"


def body(description: str | None) -> str:
    """The description without its headline (and without the `Gate:` lines older versions appended)."""
    lines = (description or "").splitlines()
    if lines and lines[0].startswith(HEADLINES):
        lines = lines[1:]
    return "\n".join(ln for ln in lines if not ln.startswith("Gate: ")).strip()


def describe(tags: dict[str, str], description: str | None) -> str:
    """The whole description: headline, blank line, the facts paragraph (MLflow keeps 5,000 characters)."""
    rest = body(description)
    return (headline(tags) + ("\n\n" + rest if rest else ""))[:4990]


def refresh_version(cfg: ProjectConfig, name: str, version: int, client=None) -> None:
    """Rewrite version `version`'s headline from its tags (nothing when it is already current)."""
    client = client or mlflow_for(cfg).MlflowClient()
    mv = client.get_model_version(name, str(version))
    text = describe(mv.tags or {}, mv.description)
    if text != (mv.description or ""):
        client.update_model_version(name, str(version), description=text)


def model_summary(name: str, aliases: dict[str, int], tags_of: dict[int, dict[str, str]]) -> tuple[dict, str]:
    """(model tags, model description) from the aliases and the aliased versions' tags (no I/O)."""
    prod, cand, prev = (aliases.get(a) for a in (ALIAS_PRODUCTION, ALIAS_CANDIDATE, ALIAS_PREVIOUS))
    tags: dict[str, str] = {}
    lines = []
    if prod is not None:
        path = published_path(tags_of.get(prod, {})) or ""
        tags["production"] = f"v{prod}"
        if path:
            tags["production.path"] = path
        lines.append(f"production: v{prod}" + (f", published to {path}" if path else ", not on the volume"))
    else:
        lines.append("production: none (nothing shipped yet)")
    if cand is not None and cand != prod:
        gated = tags_of.get(cand, {}).get(GATE_VERDICT_TAG) == "gated" and not tags_of.get(cand, {}).get(
            "published.path"
        )
        tags["candidate"] = f"v{cand}" + (" gated" if gated else "")
        why = tags_of.get(cand, {}).get(GATE_REASON_TAG)
        lines.append(f"candidate: v{cand}" + (f", gated: {why}" if gated else ", not published"))
    if prev is not None:
        lines.append(f"previous: v{prev} (`pipeline rollback {name}` returns to it)")
    return tags, "\n".join([*lines, "", PROMOTE_NOTE.format(name=name)])[:4990]


def refresh_model(cfg: ProjectConfig, name: str, client=None) -> None:
    """Rewrite the registered model's summary tags and description from its aliases (only what changed)."""
    client = client or mlflow_for(cfg).MlflowClient()
    rm = client.get_registered_model(name)
    aliases = {a: int(v) for a, v in (rm.aliases or {}).items()}
    tags_of = {v: client.get_model_version(name, str(v)).tags or {} for v in set(aliases.values())}
    tags, text = model_summary(name, aliases, tags_of)
    have = rm.tags or {}
    for k in MODEL_TAGS:
        if k in tags and have.get(k) != tags[k]:
            client.set_registered_model_tag(name, k, tags[k])
        elif k not in tags and k in have:
            client.delete_registered_model_tag(name, k)
    if (rm.description or "") != text:
        client.update_registered_model(name, description=text)


def refresh(cfg: ProjectConfig, name: str, versions: list[int | None] = ()) -> None:
    """After a change to `name`: the headlines of `versions` and the model's summary."""
    client = mlflow_for(cfg).MlflowClient()
    for v in dict.fromkeys(v for v in versions if v is not None):
        refresh_version(cfg, name, v, client)
    refresh_model(cfg, name, client)
