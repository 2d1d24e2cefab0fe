"""MLflow: training runs, the adapter as a LoggedModel, model versions, aliases and events.

Embedded default: sqlite at `<state_dir>/mlflow.db`, artifacts under `<state_dir>/mlartifacts`;
`MLFLOW_TRACKING_URI` or `registry.tracking_uri` select a server or PostgreSQL instead
(docs/registry.md). The package's names are the registry API the other stages call:
`store` (the connection), `runs` (training runs), `versions` (registered versions and aliases),
`events` (what happened to a version: publish, rollout, rollback).
"""

from __future__ import annotations

from pipeline.registry.events import (
    EVENT_TAG_PREFIX,
    EVENTS_TAG,
    events,
    record_event,
    rollback_aliases,
    ship_history,
)
from pipeline.registry.presentation import refresh as refresh_ui
from pipeline.registry.runs import finish_training_run, reopen_training_run, start_training_run
from pipeline.registry.store import (
    artifact_location,
    as_store_error,
    check_store,
    client,
    experiment_id,
    initialised,
    is_server_uri,
    keep_private,
    mlflow_for,
    redact_uri,
    store_exists,
    store_identity,
)
from pipeline.registry.versions import (
    ALIAS_CANDIDATE,
    ALIAS_PREVIOUS,
    ALIAS_PRODUCTION,
    EVAL_SET_TAG,
    FINGERPRINT_TAG,
    GATE_REASON_TAG,
    GATE_VERDICT_TAG,
    MODEL_TYPE,
    Registered,
    RegistryError,
    alias_version,
    aliases,
    download_version,
    model_exists,
    model_names,
    record_gate,
    register_adapter,
    resolve_version,
    same_weights,
    set_alias,
    set_version_tags,
    version_tags,
    versions,
)

__all__ = [
    "ALIAS_CANDIDATE",
    "ALIAS_PREVIOUS",
    "ALIAS_PRODUCTION",
    "EVAL_SET_TAG",
    "EVENT_TAG_PREFIX",
    "EVENTS_TAG",
    "FINGERPRINT_TAG",
    "GATE_REASON_TAG",
    "GATE_VERDICT_TAG",
    "MODEL_TYPE",
    "Registered",
    "RegistryError",
    "alias_version",
    "aliases",
    "artifact_location",
    "as_store_error",
    "check_store",
    "client",
    "download_version",
    "events",
    "experiment_id",
    "initialised",
    "keep_private",
    "finish_training_run",
    "is_server_uri",
    "mlflow_for",
    "model_exists",
    "model_names",
    "record_event",
    "redact_uri",
    "refresh_ui",
    "record_gate",
    "register_adapter",
    "reopen_training_run",
    "resolve_version",
    "rollback_aliases",
    "same_weights",
    "set_alias",
    "set_version_tags",
    "ship_history",
    "start_training_run",
    "store_exists",
    "store_identity",
    "version_tags",
    "versions",
]
