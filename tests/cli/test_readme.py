"""README.md as a new user reads it (issue 27 items 6 and 11): the CLI is found, and every command it
shows exists with the options it shows."""

from __future__ import annotations

import re
import shlex

import click

from pipeline.cli import COMMANDS, load_command
from tests.support.helpers import REPO

README = (REPO / "README.md").read_text()
GLOBAL = {"-v", "--verbose", "-q", "--quiet", "--config", "-c", "--version", "-h", "--help"}


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def pipeline_lines(text: str) -> list[str]:
    """Command lines that run `pipeline` (shell prompts, `X=$(...)`, pipes and comments stripped)."""
    out = []
    for block in code_blocks(text):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            m = re.search(r"(?:^|\$\(|&& |\| )(?:\.venv/bin/)?pipeline (.*)", line)
            if m:
                cmd = re.split(r"\s+#\s|\)\s*\|| \| | && ", m.group(1))[0].rstrip(")")
                out.append(cmd)
    return out


def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", []), *getattr(p, "secondary_opts", []))}


def test_the_quick_start_says_where_the_cli_is_before_using_it():
    """Item 6: `pipeline: command not found` right after `make demo`; the README never said it is
    `.venv/bin/pipeline` or how to put it on PATH."""
    quick = README.split("## Quick start", 1)[1]
    first_bare = min(
        i for i, block in enumerate(code_blocks(quick)) if re.search(r"^\s*pipeline ", block, flags=re.M)
    )
    before = "".join(code_blocks(quick)[: first_bare + 1]) + quick.split("```")[0]
    assert "source .venv/bin/activate" in before and ".venv/bin/pipeline" in quick.split("## The CLI")[0]


def test_every_command_the_readme_shows_exists_with_its_options():
    lines = pipeline_lines(README)
    assert len(lines) > 25, lines  # the synopsis, the first day, the examples
    bad = []
    for line in lines:
        tokens = [t.strip("[]") for t in shlex.split(line.replace("[", " [").replace("]", "] "))]
        i = 0
        while i < len(tokens) and tokens[i].startswith("-"):  # global options and their values
            i += 2 if tokens[i] in ("--config", "-c") else 1
        if i == len(tokens) or tokens[i] not in COMMANDS and tokens[i].split("|")[0] not in COMMANDS:
            if tokens[i : i + 1] != ["COMMAND"]:
                bad.append(f"{line}: no command {tokens[i : i + 1]}")
            continue
        cmds = [load_command(tokens[i])]
        if isinstance(cmds[0], click.Group):
            subs = tokens[i + 1].split("|")
            missing = [s for s in subs if s not in cmds[0].commands]
            if missing:
                bad.append(f"{line}: no subcommand {missing}")
                continue
            cmds = [cmds[0].commands[s] for s in subs]
        for cmd in cmds:
            known = _options(cmd) | GLOBAL
            for t in tokens[i + 1 :]:
                opt = t.split("=", 1)[0].split("|")[0]
                if opt.startswith("-") and opt != "--" and opt not in known:
                    bad.append(f"{line}: {cmd.name} has no option {opt}")
    assert bad == []


def test_the_latency_table_is_the_measured_one():
    """Item 11: docs/registry.md said register takes 43 s and promote 15-17 s, long after they did not:
    its CLI latency table must be benchmarks/results/cli_latency.json, row for row."""
    import json

    data = json.loads((REPO / "benchmarks" / "results" / "cli_latency.json").read_text())
    doc = (REPO / "docs" / "registry.md").read_text().split("### CLI latency", 1)[1]
    table = [ln for ln in doc.split("\n\n", 3)[2].splitlines() if ln.startswith("| ")][1:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table if not ln.startswith("|---")]
    assert [r[0] for r in rows] == [r["command"] for r in data["rows"]]
    for cells, r in zip(rows, data["rows"], strict=True):
        assert cells[1:4] == [f"{r['median_s']:.2f}", f"{r['max_s']:.2f}", f"{r['cpu_median_s']:.2f}"], cells
    assert "43 s wall" not in (REPO / "docs" / "registry.md").read_text()  # the stale register figure
