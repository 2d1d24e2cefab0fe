"""`pipeline validate`: an adapter against the base, the served checkpoint and the fleet."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, emit_json, exit_as, project_config
from pipeline.cli.render import (
    FINDING_COLUMNS,
    STAT_COLUMNS,
    NoHeadersOption,
    Output,
    OutputOption,
    output_format,
    print_rows,
)
from pipeline.errors import CheckFailed, UsageError
from pipeline.validate import default_base, validate_with_config
from pipeline.validate.catalogue import catalogue

app = typer.Typer()


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
_LORA_PARTS = {"lora_A", "lora_B", "weight", "lora_embedding_A", "lora_embedding_B", "bias"}


@dataclass
class Group:
    """Identical findings (same id, severity and message once module and layer are normalised)."""

    id: str
    severity: str
    message: str
    wheres: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.wheres)

    def where(self, limit: int = 6) -> str:
        """One cell: the place, or `N places: modules a, b (+k more); layers 0-3` for a group."""
        if self.count == 1:
            return self.wheres[0]
        files = sorted({w.split(":", 1)[0] for w in self.wheres if ":" in w})
        paths = [w.split(":", 1)[1] if ":" in w else w for w in self.wheres]
        modules = list(dict.fromkeys(_module(p) for p in paths if p))
        layers = sorted({int(m[1]) for p in paths if (m := _LAYER.search(p))})
        parts = [f"{self.count} places" + (f" in {', '.join(files)}" if files else "")]
        if modules:
            shown = ", ".join(modules[:limit]) + (
                f" (+{len(modules) - limit} more)" if len(modules) > limit else ""
            )
            parts.append(f"modules {shown}")
        if layers:
            parts.append(f"layers {_ranges(layers)}")
        return "; ".join(parts)


def _module(path: str) -> str:
    """`...layers.3.self_attn.q_proj.lora_A.weight` -> `self_attn.q_proj`."""
    comps = [c for c in path.split(".") if c not in _LORA_PARTS]
    if m := _LAYER.search(path):
        tail = path[m.end() :].split(".")
        comps = [c for c in tail if c not in _LORA_PARTS] or comps
    return ".".join(comps[-2:]) if len(comps) > 1 else (comps[0] if comps else path)


def _ranges(nums: list[int]) -> str:
    """[0, 1, 2, 5] -> `0-2, 5`."""
    out, start, prev = [], nums[0], nums[0]
    for n in nums[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


def group_findings(findings) -> list[Group]:
    """Findings grouped by (id, severity, message with its own place and layer numbers normalised), in first-seen order."""
    groups: dict[tuple[str, str, str], Group] = {}
    for f in findings:
        msg = f.message.replace(f.where, "{where}") if f.where else f.message
        key = (f.id, f.severity, _INDEX.sub("N", msg))
        g = groups.setdefault(key, Group(f.id, f.severity, f.message))
        g.wheres.append(f.where)
    return list(groups.values())


def flatten_stats(stats: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested stats as (dotted key, value text) rows; long lists shortened."""
    rows: list[tuple[str, str]] = []
    for k, v in stats.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            rows += flatten_stats(v, key + ".")
        elif isinstance(v, float):
            rows.append((key, f"{v:.6g}"))
        elif isinstance(v, (list, tuple)) and len(v) > 8:
            rows.append((key, f"{', '.join(map(str, v[:8]))} ... ({len(v)} items)"))
        elif isinstance(v, (list, tuple)):
            rows.append((key, ", ".join(map(str, v))))
        else:
            rows.append((key, str(v)))
    return rows


def render_report(rep, fmt: Output = Output.table, no_headers: bool = False) -> None:
    """The findings, identical ones grouped (count and places), one line each; then, for people
    (`table`, `wide`), the stats and the verdict line. `tsv`/`name` print the finding rows only."""
    if fmt is Output.json:
        return emit_json(rep.to_dict())
    groups = [
        {"id": g.id, "severity": g.severity, "count": g.count, "where": g.where(), "message": g.message}
        for g in group_findings(rep.checks)
    ]
    print_rows(groups, FINDING_COLUMNS, fmt, no_headers=no_headers, name=lambda r: r["id"])
    if fmt in (Output.tsv, Output.name):
        return
    stats = flatten_stats(rep.stats or {})
    if stats:
        typer.echo("")
        print_rows([{"stat": k, "value": v} for k, v in stats], STAT_COLUMNS, fmt, no_headers=no_headers)
    n_err = sum(g["count"] for g in groups if g["severity"] == "error")
    n_warn = sum(g["count"] for g in groups if g["severity"] == "warning")
    typer.echo(
        f"verdict: {typer.style(rep.verdict, fg='green' if rep.passed else 'red', bold=True)}  "
        f"({n_err} error(s), {n_warn} warning(s) in {len(groups)} distinct finding(s))"
    )


@app.command()
def validate(
    adapter: Annotated[Path, typer.Argument(help="adapter directory")],
    base: Annotated[
        Path | None, typer.Option(help="bf16 base checkpoint dir (headers only are read)")
    ] = None,
    served: Annotated[
        Path | None, typer.Option(help="served checkpoint dir, e.g. NVFP4 (default: served.path)")
    ] = None,
    training_config: Annotated[
        Path | None, typer.Option(help="resolved axolotl config of the run (default: from manifest.json)")
    ] = None,
    behaviour: Annotated[
        bool,
        typer.Option(
            "--behaviour",
            help="also compare eval loss and canary outputs (loads the model: CPU for tiny models)",
        ),
    ] = False,
    fold_rslora: Annotated[
        bool,
        typer.Option(
            "--fold-rslora",
            help="rewrite an rsLoRA adapter's lora_alpha to the "
            "plain-LoRA equivalent (in place, parity-checked) before validating",
        ),
    ] = False,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow",
            help="finding id whose refusal to override (reported as info, recorded in the verdict), e.g. "
            "serving.version_unknown",
        ),
    ] = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    no_headers: NoHeadersOption = False,
):
    """Check an adapter against the base, the served checkpoint and the fleet. Exit 0 pass, 1 fail, 2 usage.

    One line per distinct finding (`-o table|wide|json|tsv|name`, `--no-headers`)."""
    fmt = output_format(output, as_json)
    cfg = project_config()
    if not adapter.is_dir():
        raise UsageError(f"{adapter}: adapter directory not found")
    if base is not None and not base.is_dir():
        raise UsageError(f"{base}: base checkpoint directory not found")
    if served is not None and not served.is_dir():  # an explicit option, as --base (served.path: a finding)
        raise UsageError(f"{served}: served checkpoint directory not found")
    unknown = sorted(set(allow or ()) - set(catalogue()))
    if unknown:
        raise UsageError(f"--allow {unknown}: unknown finding id (every id is in docs/validation.md)")
    if (base or default_base(cfg, adapter)) is None:
        raise UsageError("no base checkpoint: pass --base DIR or set base.path in pipeline.yaml")
    rep = validate_with_config(
        cfg,
        adapter,
        base,
        served_dir=served,
        training_config=training_config,
        behaviour=behaviour,
        fold_rslora=fold_rslora,
        allow=set(allow or ()),
    )
    render_report(rep, fmt, no_headers)
    exit_as(CheckFailed, not rep.passed)
