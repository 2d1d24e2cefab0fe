"""Desired fleet state: which version each adapter name should serve (`<volume>/fleet-state.json`).

The file lives on the adapter volume beside the version directories, so every pipeline host
(publish, `fleet sync` sidecar, CronJob) sees the same truth. It is written atomically
(`write_json_atomic`: temp file + fsync + rename) and only while holding `fleet_lock`, which
also serialises whole fleet operations: a `fleet sync --watch` must never revert an instance
in the middle of a publish that has switched it but not yet recorded the new version.

Format (schema 1):
    {"schema": 1, "adapters": {"NAME": {"version": 2, "updated": "<UTC ISO time>", "history": [1, 2]}},
     "instances": {"vllm-1": {"state": "unknown", "since": "<UTC ISO time>", "reason": "..."}}}
`history` lists versions in the order they became desired (rollback's default target is the
entry before the last). `instances` (optional) marks instances whose serving is unknown: a
change was sent and no answer came (a hung instance may still apply it when it resumes);
`fleet sync` clears a mark once the instance answers and serves the desired state.

Errors: `UsageError` for a file that is not valid JSON or not this schema (names the file);
`LockedError` (exit 3) when another fleet operation holds the lock past the timeout.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.errors import LockedError, UsageError

STATE_FILE = "fleet-state.json"
LOCK_FILE = ".fleet-state.lock"
SCHEMA = 1
HISTORY_MAX = 50


@dataclass
class FleetState:
    adapters: dict[str, dict] = field(default_factory=dict)
    instances: dict[str, dict] = field(default_factory=dict)  # instance name -> mark (see module doc)

    def mark_unknown(self, instance: str, reason: str) -> None:
        """Record that what `instance` serves is unknown (kept until `fleet sync` verifies it)."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.instances[instance] = {"state": "unknown", "since": now, "reason": reason}

    def clear_mark(self, instance: str) -> bool:
        """Drop `instance`'s mark; True when there was one."""
        return self.instances.pop(instance, None) is not None

    def version(self, name: str) -> int | None:
        entry = self.adapters.get(name)
        return int(entry["version"]) if entry else None

    def set(self, name: str, version: int) -> None:
        entry = self.adapters.setdefault(name, {"history": []})
        entry["version"] = int(version)
        entry["updated"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        hist = [v for v in entry.get("history", []) if v != int(version)] + [int(version)]
        entry["history"] = hist[-HISTORY_MAX:]

    def previous(self, name: str) -> int | None:
        """The version desired before the current one, or None."""
        entry = self.adapters.get(name) or {}
        hist = entry.get("history", [])
        return int(hist[-2]) if len(hist) >= 2 else None

    def to_dict(self) -> dict:
        d = {"schema": SCHEMA, "adapters": self.adapters}
        if self.instances:
            d["instances"] = self.instances
        return d


def state_path(volume: Path) -> Path:
    return Path(volume) / STATE_FILE


def load_state(volume: Path) -> FleetState:
    """Read the desired state; an absent file is an empty state."""
    p = state_path(volume)
    if not p.exists():
        return FleetState()
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{p}: not valid JSON ({e.msg} at line {e.lineno}); restore it or delete it and publish again"
        ) from e
    if (
        not isinstance(data, dict)
        or data.get("schema") != SCHEMA
        or not isinstance(data.get("adapters"), dict)
    ):
        raise UsageError(
            f"{p}: not a schema-{SCHEMA} fleet state file (expected keys 'schema' and 'adapters')"
        )
    for name, entry in data["adapters"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("version"), int):
            raise UsageError(f"{p}: adapters.{name}: needs an integer 'version'")
    marks = data.get("instances", {})
    if not isinstance(marks, dict) or not all(isinstance(m, dict) for m in marks.values()):
        raise UsageError(f"{p}: 'instances' must map instance names to objects")
    return FleetState(data["adapters"], marks)


def save_state(volume: Path, state: FleetState) -> None:
    """Write atomically; call only while holding `fleet_lock(volume)`."""
    Path(volume).mkdir(parents=True, exist_ok=True)
    write_json_atomic(state_path(volume), state.to_dict())


@contextlib.contextmanager
def fleet_lock(volume: Path, timeout_s: float):
    """Hold the volume's fleet lock (a `filelock` file lock) for a whole fleet operation.

    Raises LockedError after `timeout_s` seconds of waiting.
    """
    from filelock import FileLock, Timeout

    Path(volume).mkdir(parents=True, exist_ok=True)
    path = Path(volume) / LOCK_FILE
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=timeout_s)
    except Timeout as e:
        raise LockedError(
            f"{path}: another fleet operation (publish, sync or rollback) holds the lock; waited {timeout_s:.0f} s"
        ) from e
    try:
        yield
    finally:
        lock.release()
