"""Test helpers: build adapters and configs from the tiny base (no binary fixtures committed)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
]

_BASES: dict[str, Path] = {}


def tiny_base_dir(factory, layout: str = "text") -> Path:
    """The session's tiny Qwen3.5 base of `layout` ("text" or "vl"), built once under `factory` (pytest's
    TempPathFactory): the `tiny_base`/`tiny_vl_base` fixtures and the early-started instances share it."""
    from pipeline.dev.tinybase import build_tiny_base

    if layout not in _BASES:
        name = "tiny-base" if layout == "text" else "tiny-base-vl"
        _BASES[layout] = build_tiny_base(factory.mktemp(name) / name, layout=layout)
    return _BASES[layout]


def peft_adapter(
    base_dir: Path,
    out: Path,
    r: int = 8,
    alpha: int = 16,
    targets=None,
    seed: int = 0,
    zero_b: bool = False,
    b_std: float = 0.02,
    **lora_kwargs,
) -> Path:
    """Save a PEFT LoRA for the tiny text base with random (non-zero) lora_B, like a trained one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets or DEFAULT_TARGETS, task_type="CAUSAL_LM", **lora_kwargs
    )
    pm = get_peft_model(model, cfg)
    if not zero_b:
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, b_std)
    pm.save_pretrained(str(out))
    return Path(out)


_EMPTY_STORE: list[Path] = []  # one migrated, empty MLflow sqlite store per test process


def seed_store(state_dir: Path) -> Path:
    """Put an empty MLflow sqlite store at `state_dir/mlflow.db`: a copy of one MLflow created once
    in this process. A fresh store costs MLflow's ~50 schema migrations, 3-6 s on 2 cores, paid by
    every test with its own project; the copy is the same file those migrations leave (plus
    MLflow's `Default` experiment). The project has not initialised it (no marker): its first
    command creates the project's experiment as on a new store (`pipeline.registry.store`).
    """
    import shutil
    import tempfile

    if not _EMPTY_STORE:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        d = Path(tempfile.mkdtemp(prefix="empty-mlflow-store-"))
        store = SqlAlchemyStore(f"sqlite:///{d / 'mlflow.db'}", str(d / "artifacts"))
        store.engine.dispose()
        _EMPTY_STORE.append(d / "mlflow.db")
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(_EMPTY_STORE[0], Path(state_dir) / "mlflow.db"))


def write_project_config(root: Path, **sections) -> Path:
    """A pipeline.yaml under `root` with state, volume and runs inside it; returns its path."""
    data = {
        "state_dir": str(root / "state"),
        "volume": {"path": str(root / "volume")},
        "train": {"runs_dir": str(root / "runs")},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    p = root / "pipeline.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def log_messages(logger: str = "pipeline"):
    """The messages logged under `logger` inside the block (a list, filled as they come).

    Its own handler: the CLI's logger `pipeline` does not propagate to the root (pytest's caplog).
    """
    h = _Messages()
    lg = logging.getLogger(logger)
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        yield h.messages
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
