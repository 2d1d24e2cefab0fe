"""What each adapter should serve: the `production` alias, its copy in `fleet-state.json`, and where they differ.

The MLflow alias `production` is the source of truth (it is what people move, in the CLI or the
MLflow UI). `<volume>/fleet-state.json` is derived from it in the same transaction
(`pipeline.release.transaction`) by every command that moves it: `publish`, `promote`,
`rollback`, `run`, `demo` and the follower (`follow-alias`, `fleet sync --follow-alias`). It
exists so that `fleet sync` converges instances without reaching the registry. `drift` reports
where the two disagree, plus transactions a killed command left unfinished, and the integrity of
each desired version directory; `pipeline fleet status` and `pipeline status` print them loudly.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from pipeline.artifacts.volume import TXN, incomplete, real_dir, verify_version, version_dir, version_dirs
from pipeline.config import ProjectConfig
from pipeline.errors import PipelineError
from pipeline.fleet.reconcile import StatusRow
from pipeline.fleet.state import Drift, drift, load_state
from pipeline.registry.read import read_models
from pipeline.registry.versions import ALIAS_PRODUCTION
from pipeline.release.transaction import load_intent


def desired_drift(
    cfg: ProjectConfig, names: list[str] | None = None, production: dict[str, int | None] | None = None
) -> list[Drift]:
    """Every disagreement between `production` and `fleet-state.json`, and unfinished transactions.

    `names`: adapters to check (default: every registered model and every adapter in the state
    file). `production`: {adapter: version} when the caller has read the aliases already
    (`pipeline status`); else one registry read (`pipeline.registry.read`). Changes nothing.
    """
    vol = Path(cfg.volume.path)
    state = load_state(vol)
    if production is None:  # one read of every model's aliases, without importing mlflow
        known = {m.name: m.aliases.get(ALIAS_PRODUCTION) for m in read_models(cfg)}
        todo = sorted(set(names) if names else set(known) | set(state.adapters))
        production = {n: known.get(n) for n in todo}
    else:
        todo = sorted(set(names) if names else set(production) | set(state.adapters))
        production = {n: production.get(n) for n in todo}
    # only the adapters asked about: `status b` must not report that `a` has no `production`
    rows = [d for d in drift(state, production) if d.adapter in todo]
    pending = {p.stem for p in (vol / TXN).glob("*.json")} if real_dir(vol / TXN, vol) else set()
    for n in sorted(pending & set(todo) if names else pending):
        intent = load_intent(vol, n)
        if intent is None:
            continue
        rows.append(
            Drift(
                n,
                state.version(n),
                production.get(n),
                f"{n}: an interrupted {intent.describe()} stopped at phase {intent.phase!r}: the next "
                f"`pipeline publish`, `promote`, `rollback` of {n}, `follow-alias` or `fleet sync` completes "
                "or undoes it",
            )
        )
    return rows


def integrity(cfg: ProjectConfig, name: str, version: int) -> list[str]:
    """Problems of `<volume>/<NAME>-v<N>` against its manifest (empty: intact). See `verify_version`."""
    return verify_version(cfg.volume.path, name, version)


def desired_integrity(cfg: ProjectConfig) -> dict[str, list[str]]:
    """{adapter: problems} for every desired version whose directory is missing or fails its manifest."""
    state = load_state(cfg.volume.path)
    out = {}
    for name in sorted(state.adapters):
        v = state.version(name)
        problems = integrity(cfg, name, v)
        if problems:
            out[name] = problems
    return out


def drift_dicts(rows: list[Drift]) -> list[dict]:
    return [asdict(r) for r in rows]


def volume_rows(
    cfg: ProjectConfig, names: list[str] | None = None, production: dict[str, int | None] | None = None
) -> list[StatusRow]:
    """`fleet status` rows (instance `-`) for what is wrong on the volume and in the registry.

    state `drift`: `production` and `fleet-state.json` disagree, or a transaction is unfinished;
    state `corrupt`: a desired version directory fails its manifest (a byte flipped, a file
    replaced): an instance that (re)loads it would serve other weights; `absent`: it is not on
    the volume. A registry that
    cannot be read gives one `error` row (the instance rows still stand). `names`, `production`:
    as `desired_drift`.
    """
    rows: list[StatusRow] = []
    try:
        for d in desired_drift(cfg, names, production):
            serving = f"production=v{d.production}" if d.production is not None else "production=-"
            rows.append(StatusRow("-", d.adapter, d.desired, serving, "drift", d.message))
    except PipelineError as e:
        rows.append(StatusRow("-", None, None, None, "error", f"drift not checked: {e}"))
    state = load_state(cfg.volume.path)
    for name, versions in version_dirs(cfg.volume.path).items():  # the others: whole, at least
        for v in versions:
            why = (
                None
                if v == state.version(name) or (names and name not in names)
                else incomplete(version_dir(cfg.volume.path, name, v))
            )
            if why:
                rows.append(
                    StatusRow(
                        "-",
                        name,
                        state.version(name),
                        f"v{v}",
                        "corrupt",
                        f"{why}: v{v} is not desired, but a rollback to it would fail; "
                        f"move it away and publish v{v} again, or prune it (`pipeline fleet prune {name}`)",
                    )
                )
    for name, problems in desired_integrity(cfg).items():
        if names and name not in names:
            continue
        absent = problems[0].endswith(": missing") and len(problems) == 1
        rows.append(
            StatusRow(
                "-",
                name,
                state.version(name),
                None,
                "absent" if absent else "corrupt",
                (
                    f"{problems[0]} (pruned?): publish it again or roll back"
                    if absent
                    else f"{len(problems)} problem(s), first: {problems[0]}; no instance is told to load it "
                    f"(`fleet sync` skips it): move the directory away and publish the version again, or roll back"
                ),
            )
        )
    return rows
