"""Two nodes through axolotl's torchrun launcher, on CPU: two `pipeline train` processes on 127.0.0.1.

The point of the test is the real launch (so it trains, twice, ~2 minutes on 2 cores): torchrun's
static rendezvous passed after `--` (docs/training.md, 'Several GPUs and nodes'), gloo between the
ranks, node 0 writing the adapter with the strategy in its manifest, node 1 exiting 0 as a worker.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.support.helpers import REPO, write_project_config

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_one_adapter(tmp_path, tiny_base):
    port = _free_port()
    procs = {}
    for node in (1, 0):  # the worker first: it waits at the rendezvous
        root = tmp_path / f"node{node}"
        root.mkdir()
        env = dict(os.environ, PIPELINE_CONFIG=str(write_project_config(root)), PYTHONPATH=str(REPO))
        cmd = [
            sys.executable, "-m", "pipeline", "train", str(REPO / "axolotl_configs/tiny-cpu.yml"),
            "--launcher", "torchrun", "--json", "--no-progress",
            "--set", f"base_model={tiny_base}", "--set", f"dataset_prepared_path={root / 'prepared'}",
            "--set", "max_steps=2", "--set", "eval_strategy='no'", "--set", "save_strategy='no'",
            "--set", "test_datasets=null", "--set", "eval_steps=null", "--set", "save_steps=null",
            "--", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
        ]  # fmt: skip
        procs[node] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {n: p.communicate(timeout=900) for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"node {n}: {out[n][1][-3000:]}"
    primary = json.loads(out[0][0])  # --json: the one document on stdout
    worker = json.loads(out[1][0])
    assert worker["adapter"] is None
    manifest = json.loads(open(os.path.join(primary["adapter"], "manifest.json")).read())
    assert manifest["gpus"] == 2 and manifest["strategy"]["strategy"] == "ddp"
    assert "no GPU detected" in manifest["strategy"]["reason"]
    begin = next(
        json.loads(x) for x in open(os.path.join(primary["run_dir"], "metrics.jsonl")) if '"begin"' in x
    )
    assert begin["world_size"] == 2
