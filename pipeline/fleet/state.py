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

The file is derived from the MLflow `production` alias (the source of truth, docs/fleet.md
"What each adapter should serve"): every command that moves the alias writes both in one
transaction under this lock, and `drift` lists where they differ (`pipeline fleet status`).

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
from pipeline.artifacts.bounded import MIB, BoundsError, load_json_file
from pipeline.artifacts.locks import file_lock
from pipeline.artifacts.modes import make_dir
from pipeline.artifacts.volume import os_failure, real_file
from pipeline.errors import UsageError

STATE_FILE = "fleet-state.json"
LOCK_FILE = ".fleet-state.lock"
SCHEMA = 1
HISTORY_MAX = 50
MAX_STATE_BYTES = 16 * MIB  # ~100,000 adapters


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

    def restore(self, name: str, entry: dict | None) -> None:
        """Put `name`'s entry back exactly as it was (None: no entry), e.g. when a transaction is undone."""
        if entry is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = dict(entry)

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
    if not real_file(p, volume):  # absent; a link or a second name of another file: VolumeError
        return FleetState()
    try:
        data = load_json_file(p, MAX_STATE_BYTES)
    except BoundsError as e:
        raise UsageError(f"{e}; restore it or delete it and publish again") from e
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{p}: not a text file (byte {e.start} is not UTF-8); restore it or delete it and publish again"
        ) from e
    except OSError as e:
        raise UsageError(f"{p}: cannot read the desired state: {e.strerror or e}") from e
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
    try:
        make_dir(volume)  # 0755 whatever the umask: the fleet reads the volume
        write_json_atomic(state_path(volume), state.to_dict())
    except OSError as e:
        raise os_failure(e, "cannot write the desired state", state_path(volume)) from e


@contextlib.contextmanager
def fleet_lock(volume: Path, timeout_s: float):
    """Hold the volume's fleet lock (a `filelock` file lock) for a whole fleet operation.

    Re-entrant within a thread (`pipeline.artifacts.locks.file_lock`): a publish transaction
    holds it around the rollout, the desired-state write and the alias moves, and the rollout
    may take it again. Raises LockedError after `timeout_s` seconds of waiting, VolumeError when
    the lock file cannot be created.
    """
    if Path(volume).is_dir():
        real_file(Path(volume) / LOCK_FILE, volume)  # the lock is the volume's own file, not a link
    with file_lock(
        Path(volume) / LOCK_FILE, timeout_s, "another fleet operation (publish, sync, rollback or prune)"
    ):
        yield


# -- drift: the desired state against the `production` alias it is derived from ------------------
@dataclass
class Drift:
    """An adapter whose desired state (this file) and `production` alias disagree."""

    adapter: str
    desired: int | None  # fleet-state.json
    production: int | None  # the MLflow alias
    message: str


def drift(state: FleetState, production: dict[str, int | None]) -> list[Drift]:
    """Adapters where `state` and the `production` alias ({adapter: version or None}) differ.

    The `production` alias is the source of truth for what an adapter should serve; this file is
    its copy on the volume, written in the same transaction (`pipeline.release.transaction`), so
    the two differ only when something moved one without the other: the alias moved in the MLflow
    UI with no follower running, a transaction interrupted (completed by the next command on that
    adapter), or a volume written by an older pipeline. Adapters absent from both are not listed.
    """
    out = []
    for name in sorted(set(state.adapters) | {n for n, v in production.items() if v is not None}):
        want, have = production.get(name), state.version(name)
        if want == have:
            continue
        if want is None:
            msg = (
                f"{name}: fleet-state.json desires v{have} but no version has the `production` alias: "
                f"publish or roll back {name} to set both"
            )
        elif have is None:
            msg = (
                f"{name}: `production` is v{want} but fleet-state.json has no entry: ship it with "
                f"`pipeline publish {name} --version {want}` (or `pipeline fleet sync --follow-alias production`)"
            )
        else:
            msg = (
                f"{name}: `production` is v{want} but fleet-state.json desires v{have}: the fleet converges "
                f"on v{have}; ship v{want} with `pipeline publish {name} --version {want}` (or "
                f"`pipeline fleet sync --follow-alias production`), or move the alias back with "
                f"`pipeline rollback {name} --to {have}`"
            )
        out.append(Drift(name, have, want, msg))
    return out
