"""Training progress while axolotl runs: a rich bar on a terminal, log lines otherwise (cron, CI, `> log`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UsageError
from pipeline.train.metrics import read_metrics

log = logging.getLogger("pipeline.train")


@dataclass
class Progress:
    """Training progress read from metrics.jsonl: step/total, losses, tokens/s, elapsed and ETA (seconds)."""

    step: int = 0
    total: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None

    def line(self) -> str:
        """`train: step 6/12 (50%)  loss 2.3456  eval 2.4012  1234 tokens/s  elapsed 0:01:02  ETA 0:01:02`."""
        if self.step == 0:
            return f"train: loading model and data  elapsed {_hms(self.elapsed_s)}"
        total = f"/{self.total} ({100 * self.step / self.total:.0f}%)" if self.total else ""
        parts = [f"train: step {self.step}{total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.0f} tokens/s")
        parts.append(f"elapsed {_hms(self.elapsed_s)}")
        if self.eta_s is not None:
            parts.append(f"ETA {_hms(self.eta_s)}")
        return "  ".join(parts)


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_of(records: list[dict], started: float, now: float | None = None) -> Progress:
    """Progress from metrics.jsonl records of the latest session (`begin`); `started`: wall time (s) it began.

    tokens/s: axolotl's cumulative `tokens/total` over wall time between the session's first and
    last training log; ETA: time per step so far in this session x steps left.
    """
    now = time.time() if now is None else now
    begins = [i for i, r in enumerate(records) if r.get("event") == "begin"]
    recs = records[begins[-1] :] if begins else records
    logs = [r for r in recs if r.get("event") == "log"]
    p = Progress(elapsed_s=now - started)
    begin = recs[0] if begins else {}
    p.total = begin.get("max_steps") or next(
        (r.get("max_steps") for r in reversed(logs) if r.get("max_steps")), None
    )
    if not logs:
        return p
    last = logs[-1]
    p.step = int(last.get("step") or 0)
    p.total = last.get("max_steps") or p.total
    p.loss = next((r["loss"] for r in reversed(logs) if "loss" in r), None)
    p.eval_loss = next((r["eval_loss"] for r in reversed(logs) if "eval_loss" in r), None)
    tok = [r for r in logs if "tokens/total" in r and "time" in r]
    if len(tok) >= 2 and tok[-1]["time"] > tok[0]["time"]:
        p.tokens_per_s = (tok[-1]["tokens/total"] - tok[0]["tokens/total"]) / (
            tok[-1]["time"] - tok[0]["time"]
        )
    train = [r for r in logs if "loss" in r and "time" in r and r.get("step")]  # evaluations take extra time
    if len(train) >= 2 and p.total and int(train[-1]["step"]) > int(train[0]["step"]):
        per_step = (train[-1]["time"] - train[0]["time"]) / (int(train[-1]["step"]) - int(train[0]["step"]))
        p.eta_s = per_step * max(p.total - p.step, 0)
    return p


# Seconds between progress lines when stderr is not a terminal (`pipeline train > log 2>&1`, cron, CI).
PROGRESS_INTERVAL_ENV = "PIPELINE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


def progress_interval() -> float:
    """$PIPELINE_PROGRESS_INTERVAL in seconds (default 30). Read before the trainer starts (`train`):
    a value that is no positive number raised ValueError once training ran, which killed it.

    Raises UsageError naming the variable."""
    raw = os.environ.get(PROGRESS_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise UsageError(
            f"${PROGRESS_INTERVAL_ENV}={raw[:40]!r}: seconds between progress lines, a positive number "
            f"(e.g. 30); fix or unset it"
        )
    return value


def follow_progress(
    proc: subprocess.Popen, metrics: Path, mode: str, interval_s: float | None = None
) -> None:
    """Wait for the trainer, showing progress: `bar` (rich, a terminal), `lines` (a log line every
    `interval_s` seconds, default `progress_interval()`, plus one per evaluation and
    at the end), or `off`."""
    started = time.time()
    if mode == "lines":
        interval_s = interval_s or progress_interval()
        last_line = 0.0
        last_eval = None
        while proc.poll() is None:
            p = progress_of(read_metrics(metrics), started)
            now = time.time()
            if now - last_line >= interval_s or (p.eval_loss is not None and p.eval_loss != last_eval):
                log.info(p.line())
                last_line, last_eval = now, p.eval_loss
            time.sleep(min(0.5, interval_s))
        log.info(progress_of(read_metrics(metrics), started).line() + f"  (trainer exited {proc.returncode})")
        return
    if mode != "bar":
        proc.wait()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar

    with Bar(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as prog:
        task = prog.add_task("train", total=None, info="loading model and data")
        while proc.poll() is None:
            p = progress_of(read_metrics(metrics), started)
            if p.step:
                info = f"loss {p.loss:.4f}" if p.loss is not None else ""
                info += f"  eval {p.eval_loss:.4f}" if p.eval_loss is not None else ""
                info += f"  {p.tokens_per_s:.0f} tok/s" if p.tokens_per_s is not None else ""
                prog.update(task, total=p.total, completed=p.step, info=info)
            time.sleep(0.5)


def progress_mode(show_progress: bool | str) -> str:
    """`bar` on a terminal, `lines` otherwise; `off` when disabled. Accepts a mode string as is."""
    if isinstance(show_progress, str):
        return show_progress
    if not show_progress:
        return "off"
    return "bar" if sys.stderr.isatty() else "lines"
