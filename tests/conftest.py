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


def pytest_collection_finish(session):
    """Start the vLLM instances of the selected modules now, so that they boot while earlier tests run
    (tests/support/prestart.py)."""
    from tests.support import prestart

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
