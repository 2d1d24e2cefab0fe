"""The CLI's one rendering module: rows of data as a table, a wide table, JSON, TSV or names.

Every read command prints its results through `print_rows` (library code returns data and
never prints). The formats follow kubectl's `-o` and gh's piped output:

- `table` (default): plain columns, one line per row, two spaces apart, never wrapped or
  truncated, so `grep`, `awk '{print $2}'` and `wc -l` work on it; an empty cell is `-`, a list
  is joined by `,`; cells hold no blanks, except free text (a reason, a detail), which
  stands in the last column; colour only when stdout is a terminal (click
  strips it otherwise, and `NO_COLOR` turns it off);
- `wide`: `table` plus the columns marked `wide` (reasons, hashes, run ids);
- `json`: the command's whole JSON document (what `--json` prints);
- `tsv`: every column (as `wide`), tab-separated, `\\t`, `\\n` and `\\\\` escaped as in
  PostgreSQL's text format, empty cells empty;
- `name`: one identifier per row (e.g. `models:/agent-tools/2`, MLflow's model URI).

`--no-headers` drops the header line of `table`, `wide` and `tsv`. Messages about the data
(drift, an unreadable fleet) are not rows: commands log them (stderr), so a pipe sees rows only.
Every cell goes through `pipeline.redact.redact` (the one redaction; the CLI's streams apply it too).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import click
import typer

from pipeline.cli._common import emit_json
from pipeline.errors import UsageError
from pipeline.redact import redact


class Output(StrEnum):
    """The `-o/--output` formats (kubectl's names)."""

    table = "table"
    wide = "wide"
    json = "json"
    tsv = "tsv"
    name = "name"


OutputOption = Annotated[
    Output | None,
    typer.Option(
        "--output",
        "-o",
        case_sensitive=False,
        help="table (plain columns, never wrapped), wide (more columns), json, tsv, name",
    ),
]
NoHeadersOption = Annotated[bool, typer.Option("--no-headers", help="no header line (table, wide, tsv)")]


def output_format(output: Output | None, as_json: bool = False) -> Output:
    """The format asked for: `--json` is `-o json`; both with different formats is a usage error."""
    if as_json and output not in (None, Output.json):
        raise UsageError(f"--json and -o {output.value} ask for two formats: give one")
    return Output.json if as_json else (output or Output.table)


@dataclass(frozen=True)
class Column:
    """One column: its header, how to read its value from a row, whether only `wide`/`tsv` show it.

    `color`: the cell's colour from its text (e.g. `pass` green), or None; terminals only.
    """

    header: str
    value: Callable[[dict], object]
    wide: bool = False
    color: Callable[[str], str | None] | None = None


def text(v: object) -> str:
    """A cell's text: None -> "", a list -> items joined by ",", a float with 6 significant digits."""
    if v is None:
        return ""
    if isinstance(v, list | tuple):
        return ",".join(text(x) for x in v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return redact(str(v))


def _tsv(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _plain(s: str) -> str:
    """One line (white space collapsed); `-` when empty, so every row has as many fields as the header."""
    return " ".join(s.split()) or "-"


def _color_on() -> bool:
    return "NO_COLOR" not in os.environ


def print_rows(
    rows: list[dict],
    columns: Iterable[Column],
    fmt: Output,
    *,
    no_headers: bool = False,
    name: Callable[[dict], str] | None = None,
    document: object = None,
) -> None:
    """Print `rows` on stdout in `fmt`.

    `document`: what `json` prints (default: the rows); `name`: a row's identifier for `name`
    (default: the first column).
    """
    cols = list(columns)
    if fmt is Output.json:
        emit_json(rows if document is None else document)
        return
    if fmt is Output.name:
        ident = name or (lambda r: text(cols[0].value(r)))
        for r in rows:
            click.echo(redact(ident(r)))
        return
    if not rows:  # kubectl and gh print nothing (the command says why on stderr)
        return
    shown = [c for c in cols if fmt is not Output.table or not c.wide]
    cells = [[text(c.value(r)) for c in shown] for r in rows]
    if fmt is Output.tsv:
        if not no_headers:
            click.echo("\t".join(c.header for c in shown))
        for row in cells:
            click.echo("\t".join(_tsv(v) for v in row))
        return
    cells = [[_plain(v) for v in row] for row in cells]
    header = [c.header for c in shown]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(header)]
    lines = [] if no_headers else [[(h, None) for h in header]]
    for row in cells:
        lines.append(
            [(v, c.color(v) if c.color and _color_on() else None) for v, c in zip(row, shown, strict=True)]
        )
    for line in lines:
        out = []
        for i, (v, color) in enumerate(line):
            pad = "" if i == len(line) - 1 else " " * (widths[i] - len(v) + 2)
            out.append((click.style(v, fg=color) if color else v) + pad)
        click.echo("".join(out).rstrip())


def verdict_color(v: str) -> str | None:
    """`pass`/`ok` green, `fail`/`gated`/`error` red, other non-empty states yellow."""
    if v in ("pass", "ok", "published", "skipped"):
        return "green"
    if v in ("fail", "gated", "error", "corrupt", "drift", "failed") or v.startswith("gated"):
        return "red"
    return None if v in ("", "-") else "yellow"


# -- `pipeline status`: a row per model version ----------------------------------------------------
def _canary_cell(c: dict | None) -> str:
    return (c or {}).get("verdict") or ""


def _canary_detail(c: dict | None) -> str:
    """`agree=1.0,AL=2.1/3.21,speed=0.49`: token agreement, acceptance length adapter/base, speed ratio."""
    if not c:
        return ""

    def g(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    parts = [f"agree={g(c.get('token_agreement'))}"]
    if c.get("acceptance_length"):
        parts.append(f"AL={g(c['acceptance_length'])}/{g(c.get('base_acceptance_length'))}")
    if c.get("speed_ratio"):
        parts.append(f"speed={g(c['speed_ratio'])}")
    return ",".join(parts)


def _merged_detail(m: dict | None) -> str:
    """`pass:hot=90/2.1,merged=150/3.4`: merged-vs-hot-loaded parity verdict, decode tok/s / MTP acceptance length."""
    if not m:
        return ""

    def side(k):
        return f"{m.get(k + '_tok_s')}/{m.get(k + '_acceptance_length')}"

    return f"{m.get('verdict')}:hot={side('hot')},merged={side('merged')}"


def _speed_detail(s: dict | None) -> str:
    """`AL=1.4/2.1,x0.62,drafter=2.05`: predicted MTP acceptance length adapter/base, decode-speed ratio, drafter's."""
    if not s:
        return ""
    out = []
    if s.get("acceptance.length_base") is not None:
        out.append(f"AL={s.get('acceptance.length_adapter')}/{s.get('acceptance.length_base')}")
        out.append(f"x{s.get('acceptance.speed_ratio')}")
    if s.get("drafter.length_after") is not None:
        out.append(f"drafter={s['drafter.length_after']}")
    return ",".join(out)


def _serving(r: dict) -> list[str]:
    return [
        s["instance"] + ("" if s.get("state") in (None, "ok") else f"({s['state']})") for s in r["serving"]
    ]


STATUS_COLUMNS = (
    Column("MODEL", lambda r: r["model"]),
    Column("VERSION", lambda r: r["version"]),
    Column("ALIASES", lambda r: r["aliases"]),
    Column("VALIDATION", lambda r: r["verdict"] or "unknown", color=verdict_color),
    Column("GATE", lambda r: (r.get("gate") or {}).get("verdict"), color=verdict_color),
    Column("EVAL_LOSS", lambda r: r["eval_loss"]),
    Column("CANARY", lambda r: _canary_cell(r.get("canary")), color=verdict_color),
    Column("SERVING", _serving),
    Column("PUBLISHED", lambda r: short_path(r["published_path"], r.get("volume_path"))),
    Column("CREATED", lambda r: r["created"]),
    Column("PUBLISHED_PATH", lambda r: r["published_path"], wide=True),
    Column("TRAIN_LOSS", lambda r: r["train_loss"], wide=True),
    Column("TOKENS_PER_S", lambda r: r["tokens_per_s"], wide=True),
    Column("WEIGHTS_SHA256", lambda r: (r["weights_sha256"] or "")[:12], wide=True),
    Column("RUN_ID", lambda r: r["run_id"], wide=True),
    Column("CANARY_DETAIL", lambda r: _canary_detail(r.get("canary")), wide=True),
    Column("MERGED", lambda r: _merged_detail(r.get("merged")), wide=True),
    Column("MTP_SPEED", lambda r: _speed_detail(r.get("speed")), wide=True),
    # free text last, so the columns before it split on blanks (README "Output for people and for automation")
    Column("GATE_REASON", lambda r: (r.get("gate") or {}).get("reason"), wide=True),
)


def short_path(path: str | None, volume: str | None = None) -> str | None:
    """A path for a table cell (kubectl/gh keep absolute paths out of narrow columns): relative to the
    working directory when it is below it (`adapters/volume/agent-tools-v1`), else relative to `volume`
    (`agent-tools-v1`, a directory of `volume.path`), else as given. `-o wide` shows the absolute one."""
    if not path:
        return path
    p = Path(path)
    for root in (Path.cwd(), Path(volume) if volume else None):
        if (
            root is not None
            and root != Path(root.anchor)
            and p.is_absolute()
            and p.is_relative_to(root)
            and p != root
        ):
            return str(p.relative_to(root))
    return path


def status_rows(data: dict) -> list[dict]:
    """`pipeline.release.status.collect`'s document as one row per version, newest first per model."""
    vol = data.get("volume_path")
    return [{"model": m["name"], "volume_path": vol, **v} for m in data["models"] for v in m["versions"]]


def print_status(data: dict, fmt: Output, no_headers: bool = False) -> None:
    """`pipeline status` in `fmt`; what is wrong around the rows (drift, fleet) is logged on stderr."""
    import logging

    log = logging.getLogger("pipeline.cli")
    rows = status_rows(data)
    print_rows(
        rows,
        STATUS_COLUMNS,
        fmt,
        no_headers=no_headers,
        name=lambda r: f"models:/{r['model']}/{r['version']}",
        document=data,
    )
    if fmt is Output.json:
        return
    if not rows:
        what = "" if data.get("store_exists", True) else " (no store yet: nothing was registered)"
        log.info("no registered models in %s%s", data["tracking_uri"], what)
    for r in data.get("fleet") or []:
        if r.get("state") not in ("ok", None) and not r.get("serving"):
            what = " ".join(str(x) for x in (r.get("adapter"), r["state"], r.get("detail")) if x)
            log.warning("fleet: %s: %s", r["instance"], redact(what))
    if data.get("fleet_error"):
        log.warning("fleet not read: %s", redact(data["fleet_error"]))
    for r in data.get("volume") or []:
        log.warning("%s: %s", r["state"], redact(r["detail"]))


# -- `pipeline fleet status`: a row per instance x adapter (instance `-`: the volume and registry) ----
FLEET_COLUMNS = (
    Column("INSTANCE", lambda r: r["instance"]),
    Column("VLLM", lambda r: r.get("vllm")),
    Column("ADAPTER", lambda r: r.get("adapter")),
    Column("DESIRED", lambda r: f"v{r['desired']}" if r.get("desired") else None),
    Column("SERVING", lambda r: r.get("serving")),
    Column("STATE", lambda r: r["state"], color=verdict_color),
    Column("DETAIL", lambda r: r.get("detail")),
)


def print_fleet(rows: list[dict], fmt: Output, no_headers: bool = False) -> None:
    """`pipeline fleet status` rows (`StatusRow` as dicts) in `fmt`."""
    print_rows(
        rows,
        FLEET_COLUMNS,
        fmt,
        no_headers=no_headers,
        name=lambda r: r["instance"] + (f"/{r['adapter']}" if r.get("adapter") else ""),
    )


# -- findings (`validate`, `dataset check`) and stats ----------------------------------------------
def severity_color(v: str) -> str | None:
    return {"error": "red", "warning": "yellow", "info": "cyan"}.get(v)


FINDING_COLUMNS = (
    Column("CHECK", lambda r: r["id"]),
    Column("SEVERITY", lambda r: r["severity"], color=severity_color),
    Column("N", lambda r: r.get("count", 1)),
    Column("WHERE", lambda r: r.get("where")),
    Column("MESSAGE", lambda r: r["message"]),
)
STAT_COLUMNS = (Column("STAT", lambda r: r["stat"]), Column("VALUE", lambda r: r["value"]))
