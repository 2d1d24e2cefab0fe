"""Child processes that die with `pipeline`, however it ends (SIGTERM, SIGHUP, SIGKILL, an exception).

`PR_SET_PDEATHSIG` (Linux prctl) makes the kernel signal a child when its parent dies, but only
the direct child: the flag is cleared on fork, so a server that runs its workers as children
(`mlflow server` starts uvicorn) leaves them behind. `guarded(cmd)` therefore runs `cmd` under a
small guard process (`python -m pipeline.children`): the guard gets SIGTERM when `pipeline` dies
(PR_SET_PDEATHSIG), and on SIGTERM/SIGHUP/SIGINT, or when its parent is already gone, it ends
`cmd`'s whole process group (SIGTERM, then SIGKILL after a grace period). The guard is started in
its own session (`start_new_session=True`), so the group is exactly the guard and what `cmd` started.

Standard library only: imported by the CLI and run as a module in a fresh interpreter (~50 ms).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (as `preexec_fn`): receive `sig` when the parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def guarded(cmd: list[str], grace_s: float = GRACE_S) -> list[str]:
    """`cmd` wrapped in the guard: start it with `start_new_session=True` so the group is its own.

    `grace_s`: seconds between SIGTERM and SIGKILL of the group (0: SIGKILL at once, e.g. a
    trainer that must not write into its run directory once `pipeline` is gone).
    """
    return [sys.executable, "-m", "pipeline.children", str(os.getpid()), str(grace_s), "--", *cmd]


def _end_group(grace_s: float) -> None:
    """SIGTERM the guard's process group (except the guard), then SIGKILL what is left after `grace_s`."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(pgid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:  # reap our child; others in the group are reparented and reaped by init
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)  # the guard too: nothing of the group survives
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """`python -m pipeline.children PARENT_PID GRACE_S -- CMD...`: run CMD until it exits or PARENT_PID dies."""
    parent, grace_s = int(argv[0]), float(argv[1])
    cmd = argv[argv.index("--") + 1 :]
    stop = {"asked": False}

    def on_signal(signum, _frame):
        stop["asked"] = True

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, on_signal)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        return 1
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        if stop["asked"] or os.getppid() != parent:
            _end_group(grace_s)
            return 1
        time.sleep(0.2)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
