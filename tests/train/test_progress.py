"""Progress without a TTY (issue 17 item 7): lines with step/total, loss, tokens/s and ETA from metrics.jsonl."""

import logging
import subprocess
import sys

import pytest

from pipeline.train.progress import (
    PROGRESS_INTERVAL_ENV,
    follow_progress,
    progress_interval,
    progress_mode,
    progress_of,
)


def _records():
    return [
        {"event": "begin", "max_steps": 12, "time": 100.0},
        {"event": "log", "step": 1, "max_steps": 12, "loss": 3.0, "tokens/total": 1000, "time": 110.0},
        {"event": "log", "step": 6, "max_steps": 12, "loss": 2.5, "tokens/total": 6000, "time": 120.0},
        {"event": "log", "step": 6, "max_steps": 12, "eval_loss": 2.6, "time": 121.0},
    ]


def test_progress_line_has_step_total_loss_throughput_eta():
    p = progress_of(_records(), started=100.0, now=125.0)
    assert (p.step, p.total, p.loss, p.eval_loss) == (6, 12, 2.5, 2.6)
    assert p.tokens_per_s == 500.0 and p.eta_s == 12.0  # 2 s/step x 6 steps left
    assert (
        p.line()
        == "train: step 6/12 (50%)  loss 2.5000  eval 2.6000  500 tokens/s  elapsed 0:00:25  ETA 0:00:12"
    )
    assert (
        progress_of([], started=100.0, now=130.0).line() == "train: loading model and data  elapsed 0:00:30"
    )


def test_a_resumed_session_counts_from_its_own_begin():
    recs = _records() + [
        {"event": "begin", "max_steps": 12, "time": 200.0},
        {"event": "log", "step": 7, "max_steps": 12, "loss": 2.4, "tokens/total": 7000, "time": 210.0},
    ]
    p = progress_of(recs, started=200.0, now=211.0)
    assert p.step == 7 and p.tokens_per_s is None and p.eta_s is None


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_lines_mode_logs_at_an_interval(tmp_path):
    """A child that runs ~1.5 s gives periodic lines and a final one, through logging (so -q hides them)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(__import__("json").dumps(r) for r in _records()) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    logger = logging.getLogger("pipeline.train")  # the CLI's handler sits on `pipeline`, not on root
    h, level = _Collect(), logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        follow_progress(proc, metrics, "lines", interval_s=0.4)
    finally:
        logger.removeHandler(h)
        logger.setLevel(level)
    lines = h.lines
    assert len(lines) >= 3 and all(ln.startswith("train: step 6/12") for ln in lines)
    assert lines[-1].endswith("(trainer exited 0)")


def test_mode_follows_the_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_mode(True) == "lines" and progress_mode(False) == "off"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress_mode(True) == "bar"


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_a_bad_progress_interval_is_refused_before_training(value, monkeypatch, tmp_path):
    """Sibling of issue 30 kind 3 (a setting from the environment): `PIPELINE_PROGRESS_INTERVAL=abc` was
    read only once the trainer ran (ValueError: a traceback, and the training killed); -1 and 0 failed
    in time.sleep or printed without pause. Now `train` refuses it first, naming the variable."""
    from pipeline.config import load_config
    from pipeline.errors import UsageError
    from pipeline.train.launch import train
    from tests.support.helpers import REPO, write_project_config

    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, value)
    with pytest.raises(UsageError, match=rf"\$PIPELINE_PROGRESS_INTERVAL='{value}': seconds between"):
        progress_interval()
    cfg = load_config(write_project_config(tmp_path))
    with pytest.raises(UsageError, match=r"\$PIPELINE_PROGRESS_INTERVAL"):  # before datasets, base, store
        train(cfg, REPO / "axolotl_configs" / "tiny-cpu.yml", overrides=[f"base_model={tmp_path}/none"])
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv(PROGRESS_INTERVAL_ENV, " 2.5 ")
    assert progress_interval() == 2.5
