"""`pipeline demo` / `make demo`: the main job end to end on the embedded default.

tiny base -> dataset check + axolotl training -> validate -> register (sqlite MLflow)
-> publish to the volume, then a summary table and how to open the MLflow UI.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline import registry
from pipeline.config import ProjectConfig
from pipeline.dev.tinybase import build_tiny_base
from pipeline.release.publish import publish
from pipeline.train.launch import train
from pipeline.validate import validate_with_config

log = logging.getLogger(__name__)


def run_demo(cfg: ProjectConfig, name: str, axolotl_config: Path) -> dict:
    """Run every stage; returns the summary (`pipeline demo` prints it). Progress is logged.

    Raises the stage's error on failure."""
    times: dict[str, float] = {}
    base_dir = cfg.state_dir / "tiny-base"
    t = time.time()
    if not (base_dir / "config.json").exists():
        log.info("building tiny base in %s", base_dir)
        build_tiny_base(base_dir)
    times["tiny base"] = time.time() - t

    t = time.time()
    res = train(
        cfg,
        axolotl_config,
        overrides=[f"base_model={base_dir}", f"dataset_prepared_path={cfg.state_dir / 'prepared'}"],
        name=name,
        show_progress=True,  # a bar on a terminal, log lines otherwise
    )
    times["train"] = time.time() - t

    t = time.time()
    report = validate_with_config(cfg, res.adapter_dir, base_dir)
    times["validate"] = time.time() - t

    t = time.time()
    reg = registry.register_adapter(cfg, res.adapter_dir, name, report.to_dict())
    times["register"] = time.time() - t

    t = time.time()
    pub = publish(cfg, name, version=reg.version)
    times["publish"] = time.time() - t

    rows = {
        "mlflow run": res.run_id,
        "model version": f"{name} v{reg.version}",
        "aliases": "candidate, production",
        "validation": report.verdict,
        "eval loss": res.manifest.metrics.eval_loss,
        "published path": str(pub.path),
        "tracking uri": cfg.tracking_uri,
    }
    log.info(
        "MLflow UI: `.venv/bin/pipeline ui --name %s` (serves this store on 127.0.0.1 and prints the "
        "model page URL); `.venv/bin/pipeline status %s` for the same facts in the terminal",
        name,
        name,
    )
    return {**rows, "seconds": times, "version": reg.version}
