"""What the MLflow UI shows an operator: the first line of each description, and the model's summary tags.

MLflow's UI (3.17) shows a version's description at the top of the version page, a registered
model's description at the top of its page, and a model's tags as a column of the model list. Its
aliases column shows the alias of the highest version only and hides the rest behind "+N"
(`ModelsTableAliasedVersionsCell`: aliases sorted by version, newest first), so `production` hides
behind any newer candidate, and no client setting changes that; its green tick on a version means
"registration READY", not "passed". So the answers an operator looks for are put where the UI shows
them first, rewritten from the registry's own state after every change (register, gate, publish,
promote, rollback):

- version description, first line (`headline`): `PUBLISHED to <path> at <time>`, `GATED, stays
  candidate: <reason>`, `NOT SHIPPABLE: validation fail ...`, or `candidate: ...not published`;
  the facts paragraph written at registration follows after a blank line;
- registered model tags: `production` (`v3`), `production.path` (its directory on the volume),
  `candidate` (`v4`, `v4 gated`); the model description says the same in words and that
  MLflow's "Promote model" button is not `pipeline promote`;
- the training run's description (`mlflow.note.content`, the run page's "Description"), first line:
  the version's headline (`agent v2: GATED, stays candidate: ...`), and tag `gate.verdict`; the
  training's facts follow (`runs.start_training_run`);
- the experiment's type (`mlflow.experimentKind` = `custom_model_development`): without it MLflow
  3 infers a GenAI experiment and files the training runs under "Evaluation runs".

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
NOTE_TAG = "mlflow.note.content"  # a run's description in the UI
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # MLflow 3: genai_development | custom_model_development
EXPERIMENT_KIND = "custom_model_development"
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
    """Rewrite version `version`'s headline from its tags (nothing when it is already current), and
    its training run's (`refresh_run`)."""
    client = client or mlflow_for(cfg).MlflowClient()
    mv = client.get_model_version(name, str(version))
    text = describe(mv.tags or {}, mv.description)
    if text != (mv.description or ""):
        client.update_model_version(name, str(version), description=text)
    if mv.run_id:
        refresh_run(client, mv.run_id, f"{name} v{version}: {headline(mv.tags or {})}", mv.tags or {})


def with_headline(note: str | None, line: str, prefixes: tuple[str, ...]) -> str:
    """`note` with its first line replaced by `line` when that line starts with one of `prefixes`
    (a headline written before), else with `line` put first; a blank line after it (no I/O)."""
    lines = (note or "").splitlines()
    if lines and lines[0].startswith(prefixes):
        lines = lines[1:]
    rest = "\n".join(lines).strip()
    return (line + ("\n\n" + rest if rest else ""))[:4990]


def refresh_run(client, run_id: str, line: str, version_tags: dict[str, str]) -> None:
    """Put a version's headline first in its training run's description, and its gate verdict on the run.

    A run trained in another store (a version registered from elsewhere) is left alone."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return
    have = run.data.tags
    prefix = line.split(": ", 1)[0] + ": "  # "agent v2: ", this version's own headline
    note = with_headline(have.get(NOTE_TAG), line, (prefix,))  # the training's own line stays below it
    if note != have.get(NOTE_TAG):
        client.set_tag(run_id, NOTE_TAG, note)
    verdict = version_tags.get(GATE_VERDICT_TAG)
    if verdict and have.get(GATE_VERDICT_TAG) != verdict:
        client.set_tag(run_id, GATE_VERDICT_TAG, verdict)


# The first line a training run's description starts with while it trains and when it ends (runs.py).
RUN_HEADLINES = ("TRAINING", "TRAINED", "FAILED", "KILLED")


def file_experiment(client, experiment_id: str) -> None:
    """Mark the experiment a model-development one (`EXPERIMENT_KIND_TAG`), once."""
    exp = client.get_experiment(experiment_id)
    if (exp.tags or {}).get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


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
