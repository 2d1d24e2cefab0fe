"""The registry's names: aliases and the version tags the stages read and write (one place)."""

from __future__ import annotations

from typing import Literal

ALIAS_CANDIDATE = "candidate"

ALIAS_PRODUCTION = "production"

ALIAS_PREVIOUS = "previous"

# The input fingerprint (pipeline/artifacts/fingerprint.py) every registration carries, so
# `pipeline run` skips inputs already registered however they were registered.
FINGERPRINT_TAG = "run.fingerprint"

# What the eval loss was measured on: sha256 over the validation files' sha256s (sorted). The
# eval-loss gate compares two versions only when this is the same (`pipeline.jobs.run`).
EVAL_SET_TAG = "eval_dataset_sha256"
# Metric tags: the exact value (float repr round-trips), never a rounded one.
METRIC_TAGS = ("eval_loss", "train_loss", "tokens_per_s", "mfu")

# A gate's outcome on a version (`pipeline run`: validation, eval loss, canary, publish's gates).
GATE_VERDICT_TAG = "gate.verdict"  # GateVerdict
GateVerdict = Literal["pass", "gated"]
GATE_REASON_TAG = "gate.reason"
