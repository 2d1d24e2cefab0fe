"""Errors the CLI turns into a clear message and a non-zero exit code.

Exit codes (documented in README): 0 ok, 1 check failed (validation, gate, dataset),
2 usage or input error, 3 another run holds the lock, 4 fleet did not converge,
5 a gate kept the candidate from shipping (`pipeline run`).
"""

from __future__ import annotations


class PipelineError(Exception):
    """A failure with a user-facing message: what is wrong, where, and how to fix it."""

    exit_code = 2


class UsageError(PipelineError):
    exit_code = 2


class CheckFailed(PipelineError):
    """Input was read fine but failed a check (dataset, validation, gate)."""

    exit_code = 1


class LockedError(PipelineError):
    exit_code = 3


class FleetError(PipelineError):
    exit_code = 4


class GateFailed(PipelineError):
    """The candidate was registered but a gate (validation, eval loss) kept it from shipping."""

    exit_code = 5

    def __init__(self, message: str, outcome=None):
        super().__init__(message)
        self.outcome = outcome
