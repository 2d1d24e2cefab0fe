"""SIGTERM, SIGINT and SIGHUP end a command cleanly instead of killing it where it stands.

systemd (`TimeoutStartSec`, `systemctl stop`) and Kubernetes (`activeDeadlineSeconds`, eviction,
node drain) stop a job with SIGTERM, then SIGKILL after a grace period (systemd
`TimeoutStopSec`, 90 s by default; Kubernetes `terminationGracePeriodSeconds`, 30 s by default).
Python's default for SIGTERM is to die at once: no `finally`, children left running, the MLflow
run left `RUNNING`. While a command runs (`handling()`, entered by the CLI's main group), these
signals raise `Interrupted` in the main thread instead, so the usual clean-up runs: the trainer's
process group is stopped, the MLflow run is marked `KILLED`, `pipeline run` prints its final JSON
line with `status: killed`.

`shielded()` marks a state change that must be completed rather than cut (a publish transaction,
a registration): a signal that arrives inside it is held until the block ends, then raised.
A second signal inside it is raised at once (an operator who insists); the transaction's intent
record then lets the next command complete or undo it, as after SIGKILL.

`Interrupted` derives from BaseException, like KeyboardInterrupt, so `except Exception` retry
loops do not swallow it. Exit code 128 + signal number (143 for SIGTERM, 130 for SIGINT), the
shell's convention. Standard library only (imported by the lowest layers).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
log = logging.getLogger("pipeline.interrupt")


class Interrupted(BaseException):
    """The command was stopped by `signum`; `exit_code` is 128 + signum. `outcome`: set by `pipeline run`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.outcome = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"stopped by {self.signal_name}"


_state = {"shield": 0, "pending": None, "active": False}


def _handler(signum, _frame) -> None:
    if _state["shield"] and _state["pending"] is None:
        _state["pending"] = signum
        log.warning(
            "%s received: finishing the step in progress first (a second signal stops at once)",
            signal.Signals(signum).name,
        )
        return
    _state["pending"] = None
    raise Interrupted(signum)


@contextlib.contextmanager
def handling():
    """Within the block, SIGTERM/SIGINT/SIGHUP raise `Interrupted` (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _state["active"]:
        yield
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    _state.update(active=True, pending=None)
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        _state.update(active=False, pending=None, shield=0)


@contextlib.contextmanager
def shielded():
    """Hold SIGTERM/SIGINT/SIGHUP until the block ends, then raise `Interrupted` (if the block succeeded)."""
    _state["shield"] += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _state["shield"] -= 1
        pending = _state["pending"]
        if ok and pending is not None and not _state["shield"]:
            _state["pending"] = None
            raise Interrupted(pending)


def stop_requested() -> bool:
    """A signal arrived inside a shielded block and waits to be raised."""
    return _state["pending"] is not None
