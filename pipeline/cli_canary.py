"""CLI commands for the canary area, registered on the main app by `pipeline.cli`.

Keep this module light: import heavy libraries inside the command functions.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands (or sub-apps) to the main `pipeline` app."""
