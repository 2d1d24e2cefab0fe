"""CLI behaviour: fast help (no heavy imports), usage errors exit 2."""

import subprocess
import sys

from tests.support.helpers import REPO

HEAVY = (
    "torch",
    "transformers",
    "mlflow",
    "axolotl",
    "peft",
    "pydantic",
    "pydantic_settings",
    "httpx",
    "numpy",
)


def test_help_does_not_import_heavy_libraries():
    """`pipeline --help` lists commands without importing any command module or heavy library."""
    code = (
        "import sys\nfrom pipeline.cli import app\n"
        "try:\n    app(['--help'], prog_name='pipeline')\nexcept SystemExit:\n    pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
        "print(sorted(m for m in sys.modules if m.startswith('pipeline.') and not m.startswith('pipeline.cli')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    heavy, own = r.stdout.strip().splitlines()[-2:]
    assert heavy == "[]"
    # standard library only, all three
    assert own == "['pipeline.errors', 'pipeline.interrupt', 'pipeline.redact']"


def test_command_summaries_match_their_docstrings():
    """The lazy listing's one-line summaries must say what each command's own help says."""
    from pipeline.cli import COMMANDS, load_command

    for name, (_, is_group, summary) in COMMANDS.items():
        cmd = load_command(name)
        full = " ".join((cmd.help or "").split())
        first = summary.rstrip(".")
        assert full.startswith(first) or first in full, f"{name}: {summary!r} vs {full[:120]!r}"
        assert hasattr(cmd, "commands") == is_group, name


def test_validate_usage_errors(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "validate", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "no base checkpoint" in r.stderr


def test_config_show(tmp_path):
    (tmp_path / "pipeline.yaml").write_text("fleet: {max_lora_rank: 64}\n")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "config", "show", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and '"max_lora_rank": 64' in r.stdout
