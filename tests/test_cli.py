"""CLI behaviour: fast help (no heavy imports), usage errors exit 2."""

import subprocess
import sys

from tests.support.helpers import REPO


def test_help_does_not_import_heavy_libraries():
    code = (
        "import sys; from pipeline.cli import app; "
        "heavy = [m for m in ('torch', 'transformers', 'mlflow', 'axolotl', 'peft') if m in sys.modules]; "
        "print(heavy)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


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
