"""The issue 17 walk-through as a new user runs it, in a fresh project directory (slow: real axolotl).

`pipeline demo` (what `make demo` runs) -> `pipeline run axolotl_configs/tiny-cpu.yml --name
agent-tools` reports `skipped` (item 2: every registration records the same input fingerprint);
without a TTY, training prints progress lines (item 7); `--json` prints one JSON document on
stdout (item 8). A gated run's verdict and reason in `status` (item 4) are checked where a run is
gated anyway (tests/jobs/test_run.py: the resumed candidate), not with a third training here.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.helpers import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("newuser")
    shutil.copytree(REPO / "datasets", root / "datasets")
    shutil.copytree(REPO / "axolotl_configs", root / "axolotl_configs")
    return root


def pipeline(root, *args, timeout=1200):
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_CONFIG", "MLFLOW_TRACKING_URI")}
    env["PIPELINE_PROGRESS_INTERVAL"] = "2"
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_then_run_skips(project):
    r = pipeline(project, "demo", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    demo = json.loads(r.stdout)  # stdout holds exactly one JSON document
    assert demo["version"] == 1 and demo["validation"] == "pass"
    # no TTY: progress lines with step/total, loss, tokens/s and ETA on stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("train: step")]
    assert lines, r.stderr[-3000:]
    assert any("/12 (" in ln and "loss " in ln and "tokens/s" in ln and "ETA " in ln for ln in lines), lines

    r = pipeline(project, "run", "axolotl_configs/tiny-cpu.yml", "--name", "agent-tools")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == "skipped" and out["version"] == 1, out

    r = pipeline(project, "status", "agent-tools", "--json")
    assert r.returncode == 0, r.stderr
    (v1,) = json.loads(r.stdout)["models"][0]["versions"]
    assert v1["version"] == 1 and v1["gate"] is None and isinstance(v1["eval_loss"], float)
