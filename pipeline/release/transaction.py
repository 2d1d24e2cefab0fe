"""Publish, promote and rollback as one transaction per adapter: all of it happens, or none of it stays.

A transaction on adapter NAME moves, in this order: the version directory on the volume, the
fleet (every instance switched and verified), the desired state (`fleet-state.json`), the MLflow
aliases `production` and `previous`, and the events on the versions. These live in three
systems (a filesystem, N vLLM servers, MLflow) that share no transaction, so the pipeline keeps
its own:

1. **One lock per adapter** (`<volume>/.locks/<NAME>.lock`) held from the first read of the
   aliases to the last event: two publishes, a publish and a rollback, or two rollbacks of the
   same adapter never interleave. The fleet lock (`<volume>/.fleet-state.lock`) is held from the
   rollout to the last alias write, so a `fleet sync` never sees instances, desired state and
   aliases disagree half-way. Order: adapter lock, then fleet lock (never the reverse).
2. **An intent record** (`<volume>/.txn/<NAME>.json`) written before anything changes: the
   operation, the target version, and everything needed to finish or undo it (the aliases and
   desired-state entry as they were, the version it replaces). Its `phase` says how far it got:
   `prepared` (nothing changed yet), `volume` (the version directory is complete), `fleet`
   (every instance confirmed). Removed when the transaction is complete.
3. **Recovery first**: every transaction on NAME starts, under the lock, by finishing the
   record an earlier, killed one left. `publish`/`promote`/`run` complete it (the rollout is
   re-run and is idempotent; the aliases are set from the record, not re-read, so a crash between
   the `production` and `previous` writes is repaired); `rollback` undoes a publish the registry
   does not show yet (the operator is retreating) and completes one it does. A completion whose
   rollout fails is undone instead: desired-state entry restored, `fleet sync` puts the instances
   back, aliases never moved. A record that cannot be completed or undone is left in place and
   reported.

Every step after the record is idempotent, so a crash at any point (tested by killing the
process at each `checkpoint`, tests/release/test_transaction.py) leaves a state the next command
completes or undoes. `checkpoint(point)` is where tests inject the crash: it does nothing unless
`PIPELINE_TEST_KILL_AT=<point>` is set (then the process kills itself with SIGKILL, as a node
failure would) or a test installed a hook.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.bounded import MIB, load_json_file
from pipeline.artifacts.locks import file_lock
from pipeline.artifacts.names import check_name
from pipeline.artifacts.volume import (
    LOCKS,
    TXN,
    adapter_lock_path,
    os_failure,
    real_dir,
    real_file,
    remove_version,
    verify_version,
    version_dir,
)
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError, PipelineError, UsageError
from pipeline.fleet.instances import InstanceReport
from pipeline.fleet.reconcile import sync_locked
from pipeline.fleet.rollout import rollout
from pipeline.fleet.state import fleet_lock, load_state, save_state
from pipeline.interrupt import shielded
from pipeline.registry.store import as_store_error

KILL_ENV = "PIPELINE_TEST_KILL_AT"
KILL_SIGNAL_ENV = "PIPELINE_TEST_KILL_SIGNAL"
SCHEMA = 1
OPS = ("publish", "rollback", "prune")
PHASES = ("prepared", "volume", "fleet")
MAX_INTENT_BYTES = 1 * MIB

# Called with the checkpoint name at every checkpoint (`observe`): tests raise or block, benchmarks time.
hook: Callable[[str], None] | None = None


@contextlib.contextmanager
def observe(fn: Callable[[str], None]):
    """Call `fn(point)` at every `checkpoint` this process reaches while the block runs.

    Where a test injects a crash or pauses a thread (tests/support/release_support.py) and a
    benchmark times the phases of a publish (`after-volume`: registry and volume done, the fleet
    step begins; `after-fleet`: every instance confirmed; benchmarks/publish_latency.py).
    """
    global hook
    before, hook = hook, fn
    try:
        yield
    finally:
        hook = before


def checkpoint(point: str) -> None:
    """A named point of a transaction where a test can inject a crash (see the module doc).

    `PIPELINE_TEST_KILL_SIGNAL` (e.g. `SIGTERM`) sends that signal instead of SIGKILL: what a
    scheduler's timeout sends."""
    if os.environ.get(KILL_ENV) == point:
        os.kill(os.getpid(), getattr(signal, os.environ.get(KILL_SIGNAL_ENV, "SIGKILL")))
    if hook is not None:
        hook(point)


# -- the intent record ---------------------------------------------------------------------------
@dataclass
class Intent:
    """What a transaction on one adapter is doing; everything needed to finish or undo it."""

    op: str  # publish | rollback | prune
    name: str
    version: int  # the version it makes production (prune: the desired one, kept)
    from_version: int | None  # the version it replaces (becomes `previous`)
    production_before: int | None
    previous_before: int | None
    state_before: dict | None  # fleet-state.json's entry for the adapter, verbatim
    source: str  # the model version's artifact URI (which registry and version it is)
    follow: bool = False  # publish by a follower: leave `production` where someone moved it meanwhile
    phase: str = "prepared"
    created: bool = False  # publish: the version directory was written by this transaction
    instances: list[str] = field(default_factory=list)  # instances that confirmed
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    doomed: list[int] = field(default_factory=list)  # prune: the versions it deletes

    def describe(self) -> str:
        what = f"v{', v'.join(map(str, self.doomed))}" if self.op == "prune" else f"v{self.version}"
        return f"{self.op} of {self.name} {what} (started {self.started} by pid {self.pid} on {self.host})"


def intent_path(volume: Path, name: str) -> Path:
    """`<volume>/.txn/<NAME>.json`."""
    return Path(volume) / TXN / f"{name}.json"


def load_intent(volume: Path, name: str) -> Intent | None:
    """The record an unfinished transaction on `name` left, or None. UsageError if it is unreadable."""
    p = intent_path(volume, name)
    if not real_dir(Path(volume) / TXN, volume) or not real_file(p, volume):
        return None
    try:
        data = load_json_file(p, MAX_INTENT_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # BoundsError, JSONDecodeError, UnicodeDecodeError
        raise UsageError(
            f"{p}: unreadable record of an interrupted transaction ({e}); compare `pipeline status {name}` "
            f"with `pipeline fleet status`, then delete the file"
        ) from e
    try:
        if data.pop("schema", SCHEMA) != SCHEMA or data.get("op") not in OPS:
            raise TypeError("unknown schema or operation")
        intent = Intent(**data)
    except TypeError as e:
        raise UsageError(f"{p}: not a transaction record this pipeline writes ({e}); delete it") from e
    if intent.phase not in PHASES:
        raise UsageError(f"{p}: unknown phase {intent.phase!r}; delete it")
    return intent


def save_intent(volume: Path, intent: Intent) -> None:
    """Write the record atomically (it either describes the transaction or is absent)."""
    p = intent_path(volume, intent.name)
    real_dir(p.parent, volume, create=True)
    try:
        write_json_atomic(p, {"schema": SCHEMA, **asdict(intent)})
    except OSError as e:
        raise os_failure(e, "cannot write the transaction record", p) from e


def clear_intent(volume: Path, name: str) -> None:
    try:
        intent_path(volume, name).unlink(missing_ok=True)
    except OSError as e:
        raise os_failure(e, "cannot remove the transaction record", intent_path(volume, name)) from e


def advance(cfg: ProjectConfig, intent: Intent, phase: str) -> None:
    intent.phase = phase
    save_intent(cfg.volume.path, intent)


# -- the steps after the fleet: desired state, aliases, events ----------------------------------------
def _set_alias(cfg: ProjectConfig, name: str, alias: str, version: int | None) -> None:
    if version is None:
        if registry.alias_version(cfg, name, alias) is not None:
            registry.client(cfg).delete_registered_model_alias(name, alias)
    else:
        registry.set_alias(cfg, name, alias, version)


def commit(cfg: ProjectConfig, intent: Intent) -> list[str]:
    """Desired state, aliases, events of `intent` (each step idempotent), then remove the record.

    Call holding the adapter and fleet locks, after the fleet part (phase `fleet`, or no fleet).
    Returns notes for the user (e.g. the alias was moved by someone else meanwhile).
    """
    notes: list[str] = []
    name, v = intent.name, intent.version
    state = load_state(cfg.volume.path)
    if state.version(name) != v:
        state.set(name, v)
        save_state(cfg.volume.path, state)
    checkpoint("after-state")
    client = registry.client(cfg)
    prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION) if intent.follow else None
    if intent.follow and prod not in (intent.production_before, v):
        notes.append(
            f"`production` of {name} was moved to v{prod} while v{v} was being published: left there "
            f"(the follower ships v{prod} next)"
        )
    else:  # setting an alias to where it points is a no-op: no read first
        client.set_registered_model_alias(name, registry.ALIAS_PRODUCTION, str(v))
    checkpoint("between-aliases")
    if intent.from_version not in (None, v):
        client.set_registered_model_alias(name, registry.ALIAS_PREVIOUS, str(intent.from_version))
    checkpoint("after-aliases")
    if intent.op == "publish":
        registry.record_event(
            cfg,
            name,
            v,
            {
                "type": "publish",
                "path": str(version_dir(cfg.volume.path, name, v)),
                "created": intent.created,
                "from_version": intent.from_version,
                "instances": intent.instances,
            },
            txn=intent.id,
        )
    else:
        registry.record_event(
            cfg,
            name,
            v,
            {"type": "rollback", "from_version": intent.from_version, "instances": intent.instances},
            txn=intent.id,
        )
        if intent.from_version not in (None, v):
            registry.record_event(
                cfg, name, intent.from_version, {"type": "rolled_back", "to_version": v}, txn=intent.id
            )
    checkpoint("after-events")
    # what the MLflow UI shows first: the headlines of both versions, the model's summary tags
    registry.refresh_ui(cfg, name, [v, intent.from_version])
    clear_intent(cfg.volume.path, name)
    return notes


def undo(cfg: ProjectConfig, intent: Intent) -> list[InstanceReport]:
    """Put desired state, fleet and aliases back as they were before `intent`; remove the record.

    Call holding the adapter and fleet locks. The version directory stays (immutable, harmless).
    Returns the reports of the `fleet sync` that puts the instances back (empty without a fleet).
    """
    name = intent.name
    state = load_state(cfg.volume.path)
    if state.adapters.get(name) != intent.state_before:
        state.restore(name, intent.state_before)
        save_state(cfg.volume.path, state)
    reports = sync_locked(cfg) if cfg.fleet.instances else []
    if registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION) != intent.production_before:
        _set_alias(cfg, name, registry.ALIAS_PRODUCTION, intent.production_before)
    if registry.alias_version(cfg, name, registry.ALIAS_PREVIOUS) != intent.previous_before:
        _set_alias(cfg, name, registry.ALIAS_PREVIOUS, intent.previous_before)
    registry.refresh_ui(cfg, name)
    clear_intent(cfg.volume.path, name)
    return reports


# -- recovery ----------------------------------------------------------------------------------------
def fleet_step(cfg: ProjectConfig, intent: Intent) -> list[InstanceReport]:
    """The fleet part of `intent` (holding the fleet lock); records phase `fleet` when it stands.

    publish: `rollout` (all instances or FleetError, every instance put back); rollback: the
    desired state first, then `fleet sync` (the rollback stands even with an instance down:
    `sync` converges it later).
    """
    reports: list[InstanceReport] = []
    if intent.op == "publish":
        if cfg.fleet.instances:
            reports = rollout(
                cfg, intent.name, intent.version, version_dir(cfg.volume.path, intent.name, intent.version)
            )
    else:
        state = load_state(cfg.volume.path)
        if state.version(intent.name) != intent.version:
            state.set(intent.name, intent.version)
            save_state(cfg.volume.path, state)
        checkpoint("after-state")
        if cfg.fleet.instances:
            reports = sync_locked(cfg)
    checkpoint("after-fleet")
    intent.instances = [r.instance for r in reports if r.ok]
    advance(cfg, intent, "fleet")
    return reports


def protected_versions(cfg: ProjectConfig, name: str) -> set[int]:
    """The versions of `name` nothing may delete: the desired one and the `production` one."""
    protected = {load_state(cfg.volume.path).version(name)}
    if registry.model_exists(cfg, name):
        protected.add(registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION))
    return {v for v in protected if v is not None}


@dataclass
class Recovery:
    """What the start of a transaction did with the record a killed predecessor left."""

    intent: Intent
    outcome: str  # completed | undone | abandoned
    note: str


def record_pruned(cfg: ProjectConfig, intent: Intent, versions: list[int]) -> None:
    """A `pruned` event on each version a prune deleted, and their headlines: without it `status` and the
    MLflow UI still said "PUBLISHED to <path>" of a directory that is gone. Once per transaction
    (`txn`), so a prune finished after a kill records each version once; versions whose directory is
    still there (kept, or re-published meanwhile) are left alone."""
    vol = cfg.volume.path
    gone = [v for v in versions if not os.path.lexists(version_dir(vol, intent.name, v))]
    for v in gone:
        registry.record_event(
            cfg,
            intent.name,
            v,
            {"type": "pruned", "path": str(version_dir(vol, intent.name, v))},
            txn=intent.id,
        )
    if gone:
        registry.refresh_ui(cfg, intent.name, gone)


def recover(
    cfg: ProjectConfig, name: str, prefer: str = "complete", wanted: frozenset[int] = frozenset()
) -> Recovery | None:
    """Finish or undo the transaction a killed command left on `name`; None when there is none.

    Call holding `name`'s adapter lock. `prefer`: `complete` (publish, promote, run) or `undo`
    (rollback: a publish whose `production` alias has not moved yet is undone). A rollback is
    always completed. A prune is finished, never deleting the desired or `production` version or one
    of `wanted` (what the command about to run asks for, e.g. `rollback --to N`). Raises FleetError/StoreError/VolumeError when neither is possible now
    (the record stays for the next command).
    """
    vol = cfg.volume.path
    intent = load_intent(vol, name)
    if intent is None:
        return None
    what = intent.describe()
    if intent.op == "prune":
        with fleet_lock(vol, cfg.fleet.lock_timeout_s):
            protected = protected_versions(cfg, name) | set(wanted)
            left = [v for v in intent.doomed if v not in protected]
            removed = [v for v in left if remove_version(vol, name, v, intent.id)]
            record_pruned(cfg, intent, [v for v in intent.doomed if v not in protected])
            clear_intent(vol, name)
        kept = sorted(set(intent.doomed) - set(left))
        note = f"finished an interrupted {what}: {len(removed)} more version director{'y' if len(removed) == 1 else 'ies'} removed"
        if kept:
            note += f"; kept v{', v'.join(map(str, kept))} (desired or production now)"
        return Recovery(intent, "completed", note)
    if intent.op == "publish" and intent.phase == "prepared":
        # Killed before the version directory was complete: nothing else had changed.
        clear_intent(vol, name)
        return Recovery(
            intent,
            "abandoned",
            f"an interrupted {what} had not finished writing the volume: abandoned (nothing else had changed)",
        )
    if intent.op == "publish":
        problems = verify_version(vol, name, intent.version, cache=False)
        prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
        if problems or (prefer == "undo" and prod != intent.version):
            with fleet_lock(vol, cfg.fleet.lock_timeout_s):
                undo(cfg, intent)
            why = (
                f"its version directory fails its manifest: {problems[0]}"
                if problems
                else "rollback requested"
            )
            return Recovery(
                intent,
                "undone",
                f"an interrupted {what} was undone ({why}): desired state, fleet and aliases are as before it",
            )
    with fleet_lock(vol, cfg.fleet.lock_timeout_s):
        if intent.phase != "fleet":
            try:
                fleet_step(cfg, intent)
            except FleetError as e:
                if intent.op != "publish":
                    raise
                undo(cfg, intent)
                return Recovery(
                    intent,
                    "undone",
                    f"an interrupted {what} could not be completed (the fleet refused it: "
                    f"{str(e).splitlines()[0]}); undone: desired state, fleet and aliases are as before it",
                )
        notes = commit(cfg, intent)
    return Recovery(intent, "completed", "; ".join([f"completed an interrupted {what}", *notes]))


@dataclass
class Transaction:
    """Handed to the body of `adapter_transaction`: notes for the user, and what recovery did."""

    name: str
    notes: list[str] = field(default_factory=list)
    recovered: Recovery | None = None

    def completed(self, op: str, version: int) -> Intent | None:
        """The recovered intent if recovery just completed this very operation (`op` to `version`)."""
        r = self.recovered
        if r and r.outcome == "completed" and r.intent.op == op and r.intent.version == version:
            return r.intent
        return None


@contextlib.contextmanager
def adapter_transaction(
    cfg: ProjectConfig, name: str, prefer: str = "complete", wanted: frozenset[int] = frozenset()
):
    """Hold `name`'s transaction lock; first finish what a killed transaction left. Yields a `Transaction`.

    `prefer`, `wanted`: see `recover`.

    Raises UsageError (bad name), LockedError (exit 3: another publish/rollback of `name` held
    the lock past `fleet.lock_timeout_s`), VolumeError (the lock file cannot be created).
    """
    check_name(name)
    vol = cfg.volume.path
    real_dir(Path(vol) / LOCKS, vol, create=True)
    # SIGTERM/SIGINT wait until the transaction is complete (pipeline/interrupt.py); SIGKILL is
    # what the intent record is for.
    with (
        shielded(),
        file_lock(
            adapter_lock_path(vol, name),
            cfg.fleet.lock_timeout_s,
            f"another publish, promote, rollback or prune of {name!r}",
        ),
    ):
        tx = Transaction(name)
        try:
            tx.recovered = recover(cfg, name, prefer, wanted)
        except Exception as e:
            raise stuck(cfg, name, e) from e
        if tx.recovered:
            tx.notes.append(tx.recovered.note)
        yield tx


def incomplete(cfg: ProjectConfig, e: BaseException, intent: Intent) -> BaseException:
    """The error that stopped `intent` part-way, saying that the next command on the adapter finishes it."""
    err = e if isinstance(e, PipelineError) else as_store_error(e)
    if err is None or not intent_path(cfg.volume.path, intent.name).exists():
        return e
    note = (
        f"\n{intent.describe()} stopped part-way; its record {intent_path(cfg.volume.path, intent.name)} "
        f"stays, and the next publish, promote or rollback of {intent.name} completes or undoes it"
    )
    try:
        return type(err)(str(err) + note)
    except TypeError:
        return err


def stuck(cfg: ProjectConfig, name: str, e: BaseException) -> BaseException:
    """The error that kept recovery from finishing `name`'s record, with the ways out: what to fix and run
    again, or how to give the record up. Any other exception is returned unchanged."""
    err = e if isinstance(e, PipelineError) else as_store_error(e)
    p = intent_path(cfg.volume.path, name)
    if err is None or not p.exists() or "; its record " in str(err):
        return e
    try:
        intent = load_intent(cfg.volume.path, name)
    except UsageError:
        return err  # the record itself is unreadable: its message says to delete it
    what = intent.describe() if intent else f"transaction on {name}"
    note = (
        f"\nthe interrupted {what} could not be completed or undone; its record {p} stays. Fix what is "
        f"named above and run the command again (every publish, promote, rollback, prune, follow-alias and "
        f"fleet sync of {name} completes or undoes it first); or give it up: compare `pipeline status {name}` "
        f"with `pipeline fleet status`, put back what differs (`pipeline rollback {name} --to N`), then "
        f"delete {p}"
    )
    try:
        return type(err)(str(err) + note)
    except TypeError:
        return err


def pending(cfg: ProjectConfig) -> list[str]:
    """Adapters whose unfinished transaction left a record (`<volume>/.txn/<NAME>.json`), sorted."""
    vol = Path(cfg.volume.path)
    if not real_dir(vol / TXN, vol):
        return []
    return sorted(p.stem for p in (vol / TXN).glob("*.json"))


def recover_pending(
    cfg: ProjectConfig, names: list[str] | None = None
) -> tuple[list[str], list[BaseException]]:
    """Complete or undo every unfinished transaction (of `names`, default all); what the follower and
    `fleet sync` run first, so that a record a killed publish left is never silently passed over
    (its desired state already matches `production`: nothing else would look at it).

    Returns (notes saying what was done, errors saying why one could not be finished and what to
    run: `stuck`). Takes each adapter's lock (LockedError among the errors when another command
    holds it: that command recovers it).
    """
    notes: list[str] = []
    errors: list[BaseException] = []
    for name in pending(cfg):
        if names and name not in names:
            continue
        try:
            with adapter_transaction(cfg, name) as tx:
                notes += [f"{name}: {n}" for n in tx.notes]
        except Exception as e:  # noqa: BLE001 - reported, with what to run; the other adapters go on
            errors.append(stuck(cfg, name, e))
    return notes, errors
