"""The pipeline's one exception hierarchy.

Every error a user can cause or meet derives from `PipelineError` and carries a message that
says what is wrong, where (file, line, tensor, instance) and how to fix it. The CLI maps the
classes below to exit codes in one place (`pipeline.cli._common.EXIT_CODES`; README "Exit
codes"): a subclass inherits its parent's code. An error a user can meet is one of these (some
also derive from `ValueError`, which their callers catch); `tests/test_errors.py` checks that every
exception class under `pipeline/` is, except the few that never leave their module.

    PipelineError
    ├── UsageError        2  bad input: unknown name/version/alias, missing file, bad flag
    │   ├── ConfigError      pipeline.yaml (or its environment overrides) invalid
    │   ├── StoreError       the MLflow store is unreachable, locked or not a database
    │   └── VolumeError      the adapter volume cannot be written (read-only, full, permissions)
    ├── CheckFailed       1  input read fine but failed a check (dataset, config, validation, training)
    ├── LockedError       3  another operation holds the lock for this adapter / fleet
    ├── FleetError        4  the fleet did not converge (publish undid itself)
    ├── InstanceError     4  a request to one vLLM instance failed (an HTTP error, no answer)
    │   └── Unreachable      nothing answered; `Hung`: connected, no answer in time
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


class InstanceError(PipelineError):
    """A request to a vLLM instance failed; the message names the instance, request and reply.

    Not a `FleetError`: that one means the whole operation was undone; an `InstanceError` is one
    instance's failure, which the rollout turns into that instance's findings
    (`pipeline.fleet.instances`). Raised by `pipeline.fleet.client.InstanceClient`.

    `status`: the HTTP status (None when no reply came); `outcome_unknown`: a changing request
    (load/unload) may have taken effect although no success reply came; `check`: the finding id
    a report files it under (None: by class, `pipeline.fleet.instances`).
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        outcome_unknown: bool = False,
        check: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.outcome_unknown = outcome_unknown
        self.check = check


class Unreachable(InstanceError):
    """The instance did not answer (connection refused or reset, connect timeout)."""


class Hung(Unreachable):
    """The instance accepted the connection but sent no answer within the read timeout."""


class GateFailed(PipelineError):
    """The candidate was registered but a gate (validation, eval loss, canary) kept it from shipping.

    `outcome` is the `pipeline.jobs.run.RunOutcome` printed as the job's last JSON line.
    """

    def __init__(self, message: str, outcome=None):
        super().__init__(message)
        self.outcome = outcome
