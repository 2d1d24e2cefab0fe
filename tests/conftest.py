"""Shared fixtures: tiny bases, a project config in a temp dir, and one real axolotl training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.helpers import REPO, tiny_base_dir, write_project_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PIPELINE_CONFIG", None)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one compute thread per process (torch's and its children's, axolotl's
    # trainings included). With torch's default of a thread per core, the workers' OpenMP threads spun
    # against each other: the suite's CPU time went from ~1,360 s on one worker to ~2,260 s on two.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


# The suite runs on two pytest-xdist workers (`pytest -n 2 --dist loadfile --no-loadscope-reorder`, the
# README's test command): a file's tests stay together on one worker (its module fixtures are built once), and
# the files are handed out in the order below, the longest first, then in collection order, so that neither
# worker is left with a long file at the end. (`--dist loadgroup` would let files share a worker, but with
# pytest 9.2 xdist 3.8's `@group` suffix no longer reaches the nodeid: every test became its own unit and
# test_fleet_vllm.py's module instances started on both workers.) Seconds: a full run on the 2-core machine.
LONGEST_FIRST = (
    "tests/fleet/test_fleet_vllm.py",  # ~175 s: two vLLM CPU instances, then more
    "tests/benchmarks/test_smoke.py",  # ~130 s: the benchmarks' smokes, two processes at a time
    "tests/jobs/test_run.py",  # ~105 s
    "tests/canary/test_canary.py",  # ~95 s: a vLLM CPU staging instance
    "tests/jobs/test_demo_then_run.py",
    "tests/release/test_transaction.py",
    "tests/release/test_modes.py",
    "tests/artifacts/test_peft_model.py",
    "tests/train/test_multinode.py",
    "tests/jobs/test_schedule_runs.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """The files in `LONGEST_FIRST` order, then in collection order; within a file, its own order."""
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(Path(item.path).resolve().relative_to(REPO).as_posix(), len(order))

    def key(item):
        f = Path(item.path).resolve().relative_to(REPO).as_posix()
        return (rank.get(f, len(rank)), order[f])

    items.sort(key=key)  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    """Start the vLLM instances of the selected modules now, so that they boot while earlier tests run
    (tests/support/prestart.py). Not on an xdist worker: every worker collects every file, and which files
    it will run is known only as they are handed out; there the modules start theirs when they need them,
    and the other worker keeps the second core busy meanwhile."""
    from tests.support import prestart

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files = list(dict.fromkeys(str(Path(item.path).resolve()) for item in session.items))  # in run order
    prestart.start_planned(files, session.config._tmp_path_factory)


def pytest_sessionfinish(session):
    from tests.support import prestart

    prestart.stop_untaken()


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return tiny_base_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_vl_base(tmp_path_factory) -> Path:
    return tiny_base_dir(tmp_path_factory, layout="vl")


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """A fresh project: pipeline.yaml + sqlite MLflow + volume under tmp_path; returns the config."""
    from pipeline.config import load_config

    path = write_project_config(tmp_path)
    monkeypatch.setenv("PIPELINE_CONFIG", str(path))
    return load_config(path)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_base):
    """One real axolotl training run of axolotl_configs/tiny-cpu.yml (a few steps) on the tiny base.

    Returns (ProjectConfig, TrainResult). Session-scoped: ~60-100 s on 2 cores.
    """
    from pipeline.config import load_config
    from pipeline.train.launch import train

    root = tmp_path_factory.mktemp("trained")
    cfg = load_config(write_project_config(root))
    cwd = os.getcwd()
    os.chdir(REPO)  # the config's dataset paths are relative to the repo root
    try:
        res = train(
            cfg,
            REPO / "axolotl_configs" / "tiny-cpu.yml",
            overrides=[
                f"base_model={tiny_base}",
                f"dataset_prepared_path={root / 'prepared'}",
                "max_steps=6",
                "eval_steps=6",
                "save_steps=6",
            ],
            name="agent-tools",
            show_progress=False,
        )
    finally:
        os.chdir(cwd)
    return cfg, res
