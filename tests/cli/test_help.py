"""Issue 41.8: `--help` for people: examples on every command (kubectl's and gh's habit), paragraphs that
read whole at 80 columns, and shell completion documented."""

from __future__ import annotations

import shlex

import click
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from pipeline.cli import COMMANDS, app, load_command
from pipeline.cli.examples import EXAMPLES
from tests.support.helpers import REPO


def _paths() -> list[str]:
    out = []
    for name, (_, is_group, _) in COMMANDS.items():
        cmd = load_command(name)
        out += [f"{name} {sub}" for sub in cmd.commands] if is_group else [name]
    return out


def _parse(argv: list[str]) -> click.Command:
    """The command `argv` (after `pipeline`) names, its options and arguments parsed as the CLI would."""
    root = get_command(app)
    ctx = root.make_context("pipeline", list(argv), resilient_parsing=False)
    cmd, rest = root, [*ctx._protected_args, *ctx.args]
    while isinstance(cmd, click.Group) and rest:
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args] if isinstance(cmd, click.Group) else []
    return cmd


def test_every_command_has_examples_and_they_parse():
    """The failing input: `pipeline publish --help` showed no example. Each example is a command line
    the CLI accepts (options and arguments as they are spelt today), so the help cannot rot."""
    paths = _paths()
    missing = [p for p in paths if not EXAMPLES.get(p)]
    assert missing == []
    for path, examples in EXAMPLES.items():
        if path != "pipeline" and path not in paths:
            continue  # a command of another branch (merged later): shown nowhere until it exists
        for _, line in examples:
            argv = shlex.split(line.split(" | ")[0])
            assert argv[0] == "pipeline", line
            if path == "pipeline":
                continue  # the main help's own: --help, --install-completion
            cmd = _parse(argv[1:])
            assert cmd.name == path.split()[-1], (line, cmd.name)


@pytest.mark.parametrize("path", ["promote", "publish", "status", "fleet prune", "register"])
def test_help_paragraphs_read_whole_at_80_columns(path):
    """`promote --help` broke "... A" / "version `pipeline run` gated ..." at 80 columns: typer's rich help
    kept the docstring's own line breaks, then wrapped each source line again. A paragraph's lines are
    now full but its last, and the examples follow at the end."""
    r = CliRunner().invoke(app, [*path.split(), "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    text = r.stdout.split("╭")[0]  # the description, before the option boxes
    paragraphs, current = [], []
    for ln in text.splitlines() + [""]:
        if ln.strip():
            current.append(ln)
        elif current:
            paragraphs, current = [*paragraphs, current], []
    for lines in paragraphs:
        for ln in lines[:-1]:
            assert len(ln.rstrip()) >= 55, (path, ln, lines)
    tail = r.stdout.split("╯")[-1]
    assert "Examples:" in tail and f"$ pipeline {path}" in tail


def test_shell_completion_is_documented():
    """Typer's --install-completion / --show-completion were never mentioned in the README."""
    readme = (REPO / "README.md").read_text()
    assert "pipeline --install-completion" in readme and "--show-completion" in readme
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "100"})
    assert "--install-completion" in r.stdout and "Examples:" in r.stdout
