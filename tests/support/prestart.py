"""vLLM instances started as soon as the suite is collected, so that their boot overlaps the tests before them.

A CPU vLLM instance takes ~35 s to answer /health, nearly all of it Python imports in three processes
(API server, engine core, worker), while the suite around it uses about one of the two cores (issue 26
item 6: 823 CPU-s in 872 s of wall time). A module that starts instances in a module fixture registers
a *plan* at import (`plan(key, __file__, build)`: `build(root, factory)` makes the model and returns
the `VllmServer`s, not started). When collection ends, conftest calls `start_planned`: the plans whose
file holds a selected test are built there,
and the first in run order is started (its processes boot on their own); each later plan is started when the one
before it is taken, so it boots while the previous module's tests run. One plan at a time: four
instances booting at once beside the CPU-bound benchmark smokes slowed those by more than they saved.
The module's fixture calls `take(key, factory)` and gets the same servers, started earlier, or
starts them itself if nothing has; waiting for readiness and stopping stay the fixture's job.
`stop_untaken` stops what no fixture took.

Nothing is faked or shared: each module gets the instances it asked for, with its own flags, only sooner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support.fleet_server import VllmServer, fleet_env_available

Build = Callable[[Path, object], list[VllmServer]]  # (root, pytest's TempPathFactory) -> servers

_plans: dict[str, tuple[str, Build]] = {}
_built: dict[str, tuple[Path, list[VllmServer]]] = {}  # built by start_planned, not taken yet
_running: set[str] = set()  # keys whose servers were started
_queue: list[str] = []  # planned keys in run order


def plan(key: str, test_file: str, build: Build) -> None:
    """Register `build` under `key` for the tests in `test_file` (call at module import)."""
    _plans[key] = (str(Path(test_file).resolve()), build)


def _start(key: str | None) -> None:
    """Start plan `key`'s servers once (a process each: this returns at once, they boot on their own)."""
    if key is not None and key not in _running and key in _built:
        _running.add(key)
        for s in _built[key][1]:
            s.start()


def start_planned(selected_files: list[str], factory) -> list[str]:
    """Build the plans whose test file is in `selected_files` (resolved paths, in run order) and start
    the first; returns their keys in run order.

    `factory`: pytest's TempPathFactory (each plan gets `factory.mktemp(key)` as its root)."""
    if not fleet_env_available():
        return []
    order = {f: i for i, f in enumerate(selected_files)}
    keys = sorted(
        (k for k, (f, _) in _plans.items() if f in order and k not in _built),
        key=lambda k: order[_plans[k][0]],
    )
    for key in keys:
        root = factory.mktemp(key)
        _built[key] = (root, _plans[key][1](root, factory))
    _queue[:] = keys
    _start(keys[0] if keys else None)
    return keys


def take(key: str, factory) -> tuple[Path, list[VllmServer]]:
    """The root and the started servers of plan `key` (built and started now when no plan was built);
    starts the next planned one. Raises KeyError for a key no module registered."""
    if key not in _built:
        root = factory.mktemp(key)
        _built[key] = (root, _plans[key][1](root, factory))
    _start(key)
    root, servers = _built.pop(key)
    if key in _queue:
        later = _queue[_queue.index(key) + 1 :]
        _start(later[0] if later else None)
    return root, servers


def stop_untaken() -> None:
    """Stop the servers of plans no fixture took."""
    for key, (_, servers) in list(_built.items()):
        if key in _running:
            for s in servers:
                s.stop()
    _built.clear()
