"""The pipeline's one exception hierarchy.

Every error a user can cause or meet derives from `PipelineError` and carries a message that
says what is wrong, where (file, line, tensor, instance) and how to fix it. The CLI maps the
classes below to exit codes in one place (`pipeline.cli._common.EXIT_CODES`; README "Exit
codes"): a subclass inherits its parent's code.

    PipelineError
    ├── UsageError        2  bad input: unknown name/version/alias, missing file, bad flag
    │   ├── ConfigError      pipeline.yaml (or its environment overrides) invalid
    │   ├── StoreError       the MLflow store is unreachable, locked or not a database
    │   └── VolumeError      the adapter volume cannot be written (read-only, full, permissions)
    ├── CheckFailed       1  input read fine but failed a check (dataset, config, validation, training)
    ├── LockedError       3  another operation holds the lock for this adapter / fleet
    ├── FleetError        4  the fleet did not converge (publish undid itself)
    └── GateFailed        5  `pipeline run`: registered, but a gate kept it from shipping
"""

from __future__ import annotations


class PipelineError(Exception):
    """A failure with a user-facing message: what is wrong, where, and how to fix it."""


class UsageError(PipelineError):
    """Bad input: an unknown model/version/alias, a missing file, an invalid option or name."""


class ConfigError(UsageError):
    """The project config file (`pipeline.yaml`) is missing, unreadable or invalid."""


class StoreError(UsageError):
    """The MLflow tracking/registry store cannot be used (unreachable, locked, wrong kind)."""


class VolumeError(UsageError):
    """The adapter volume (or another directory the pipeline writes) cannot be written: read-only, full, denied."""


class CheckFailed(PipelineError):
    """Input was read fine but failed a check (dataset, training config, validation, training run)."""


class LockedError(PipelineError):
    """Another operation holds the lock (a `pipeline run` of the same adapter, a fleet operation)."""


class FleetError(PipelineError):
    """The fleet did not converge on the desired state; the message holds the per-instance report."""


class GateFailed(PipelineError):
    """The candidate was registered but a gate (validation, eval loss, canary) kept it from shipping.

    `outcome` is the `pipeline.jobs.run.RunOutcome` printed as the job's last JSON line.
    """

    def __init__(self, message: str, outcome=None):
        super().__init__(message)
        self.outcome = outcome
