"""`pipeline demo` / `make demo`: the main job end to end on the embedded default.

tiny base -> dataset check + axolotl training -> validate -> register (sqlite MLflow)
-> publish to the volume, then a summary table and how to open the MLflow UI.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline import registry
from pipeline.config import ProjectConfig
from pipeline.dev.tinybase import build_tiny_base
from pipeline.release.publish import publish
from pipeline.train.launch import train
from pipeline.validate import validate_with_config


def run_demo(cfg: ProjectConfig, name: str, axolotl_config: Path, echo=print, table: bool = True) -> dict:
    """Run every stage; returns the summary dict (printed as a table unless `table` is False).

    Raises the stage's error on failure."""
    from rich.console import Console
    from rich.table import Table

    times: dict[str, float] = {}
    base_dir = cfg.state_dir / "tiny-base"
    t = time.time()
    if not (base_dir / "config.json").exists():
        echo(f"building tiny base in {base_dir}")
        build_tiny_base(base_dir)
    times["tiny base"] = time.time() - t

    t = time.time()
    res = train(
        cfg,
        axolotl_config,
        overrides=[f"base_model={base_dir}", f"dataset_prepared_path={cfg.state_dir / 'prepared'}"],
        name=name,
        echo=echo,
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
        "eval loss": res.manifest["metrics"].get("eval_loss"),
        "published path": str(pub.path),
        "tracking uri": cfg.tracking_uri,
    }
    if table:
        t = Table(title="lora-pipeline demo")
        t.add_column("field")
        t.add_column("value", overflow="fold")
        for k, v in rows.items():
            t.add_row(k, str(v))
        for k, v in times.items():
            t.add_row(f"seconds: {k}", f"{v:.1f}")
        Console(stderr=False).print(t)
    echo(
        f"MLflow UI: `.venv/bin/pipeline ui --name {name}` (serves this store on 127.0.0.1 and prints the "
        f"model page URL); `.venv/bin/pipeline status {name}` for the same facts in the terminal"
    )
    return {**rows, "seconds": times, "version": reg.version}
