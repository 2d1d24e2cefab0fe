"""Examples at the end of every command's `--help` (kubectl's and gh's habit), and help text that reads whole.

`EXAMPLES` maps a command's path (`publish`, `fleet prune`) to (what it does, the command line)
pairs; `polish` puts them in the command's epilog and joins the single line breaks of its help
paragraphs: typer's rich help keeps a docstring's own line breaks and then wraps at the terminal's
width, so a 100-character source line printed at 80 columns broke mid-sentence ("... A" / "version").
`tests/cli/test_help.py` checks every command has examples and that each example parses.
"""

from __future__ import annotations

import re

import click

EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "pipeline": [
        ("a first day: check, train, validate, register, publish", "pipeline dataset check data/train.jsonl"),
        ("help on one command, with its examples", "pipeline publish --help"),
        ("shell completion (bash, zsh, fish)", "pipeline --install-completion"),
    ],
    "train": [
        ("train the CPU demo config", "pipeline train axolotl_configs/tiny-cpu.yml"),
        (
            "show the resolved config and launcher command, train nothing",
            "pipeline train my-task.yml --dry-run",
        ),
        (
            "override a key, two GPUs with FSDP2",
            "pipeline train my-task.yml --set learning_rate=1e-4 --gpus 2 --strategy fsdp2",
        ),
    ],
    "validate": [
        (
            "check an adapter against the configured base and fleet",
            "pipeline validate adapters/runs/my-task-X/adapter",
        ),
        ("machine-readable findings", "pipeline validate ADAPTER -o json"),
    ],
    "register": [
        (
            "record a trained adapter as the next version (alias candidate)",
            "pipeline register ADAPTER --name my-task",
        ),
        (
            "what it would register, and whether a version holds the same weights",
            "pipeline register ADAPTER --name my-task --dry-run",
        ),
    ],
    "publish": [
        ("ship version 3 to the volume and the fleet", "pipeline publish my-task --version 3"),
        (
            "what would be written and moved, nothing changed",
            "pipeline publish my-task --alias candidate --dry-run",
        ),
    ],
    "promote": [
        ("make version 3 production", "pipeline promote my-task 3"),
        ("the plan as JSON", "pipeline promote my-task 3 --dry-run --json"),
    ],
    "rollback": [
        ("back to the previous version", "pipeline rollback my-task"),
        ("which version it would go to", "pipeline rollback my-task --dry-run"),
        ("back to version 1", "pipeline rollback my-task --to 1"),
    ],
    "status": [
        ("every model's versions", "pipeline status"),
        ("one model, with gate reasons and absolute paths", "pipeline status my-task -o wide"),
        ("count versions in production", "pipeline status --no-headers | grep -c production"),
    ],
    "ui": [("the MLflow UI, printing the model's page", "pipeline ui --name my-task")],
    "canary": [
        (
            "a registered version on a staging vLLM",
            "pipeline canary my-task --version 3 --staging http://127.0.0.1:8000",
        )
    ],
    "merge": [
        ("a bf16 merged checkpoint", "pipeline merge ADAPTER --base /models/base --out /models/merged")
    ],
    "merge-parity": [
        ("merged vs hot-loaded", "pipeline merge-parity MERGED_DIR --merged http://127.0.0.1:8001")
    ],
    "draft": [
        ("a drafter for version 3, trained on the GPU", "pipeline draft my-task --version 3 --device cuda"),
        ("on CPU, a short budget (the tiny base)", "pipeline draft my-task --version 3 --budget-s 60"),
    ],
    "run": [
        ("the nightly job", "pipeline run my-task.yml --name my-task"),
        ("would it skip, ship or train?", "pipeline run my-task.yml --name my-task --dry-run"),
        ("retrain even if the inputs are unchanged", "pipeline run my-task.yml --name my-task --force"),
    ],
    "follow-alias": [
        ("ship whatever `production` points at, as it moves", "pipeline follow-alias production")
    ],
    "fleet status": [
        ("what every instance serves", "pipeline fleet status"),
        ("one adapter only", "pipeline fleet status my-task"),
    ],
    "fleet resolve": [("the model id clients send now", "pipeline fleet resolve my-task")],
    "fleet sync": [
        ("what sync would load or unload", "pipeline fleet sync --dry-run"),
        ("reconcile every 30 s as a sidecar", "pipeline fleet sync --watch"),
    ],
    "fleet prune": [
        ("list what would be deleted", "pipeline fleet prune my-task --keep 2 --dry-run"),
        ("delete without asking (scripts)", "pipeline fleet prune my-task --keep 2 --yes"),
    ],
    "schedule emit": [
        (
            "a systemd service and timer for this project",
            'pipeline schedule emit --kind systemd --name my-task --config my-task.yml --workdir "$PWD" --out schedule/',
        ),
    ],
    "dataset check": [
        (
            "check files before training",
            "pipeline dataset check data/train.jsonl --validation data/validation.jsonl",
        )
    ],
    "config show": [("the effective config and where it came from", "pipeline config show")],
    "demo": [("tiny base to a published adapter", "pipeline demo")],
    "dev tiny-base": [("a tiny random base", "pipeline dev tiny-base .state/tiny-base")],
    "dev real-base": [("the real geometry, 4 layers", "pipeline dev real-base /tmp/base --layers 4")],
    "dev trained-base": [
        (
            "a stand-in base of the fleet's architecture, trained from scratch",
            "pipeline dev trained-base /dev/shm/tb --layers 8 --minutes 4 --device cuda",
        ),
    ],
    "dev served-base": [
        ("its served NVFP4 + MTP form", "pipeline dev served-base /tmp/base /tmp/served --device cuda")
    ],
    "dev task-data": [
        ("a tool-call task's training and held-out data", "pipeline dev task-data toolcall datasets/tasks"),
        ("the snake_case task, more training rows", "pipeline dev task-data snake /tmp/tasks --train 2000"),
    ],
}


def epilog(path: str) -> str | None:
    """The examples of command `path` as an epilog (typer prints each paragraph as one line)."""
    ex = EXAMPLES.get(path)
    if not ex:
        return None
    return "Examples:\n\n" + "\n\n".join(f"  # {what}\n\n  $ {line}" for what, line in ex)


def unwrap(text: str | None) -> str | None:
    """`text` with each paragraph on one line (a `\\b` paragraph, click's no-rewrap marker, kept as is)."""
    if not text:
        return text
    paragraphs = re.split(r"\n\s*\n", text.strip("\n"))
    return "\n\n".join(p if p.lstrip().startswith("\b") else " ".join(p.split()) for p in paragraphs)


def polish(cmd: click.Command, path: str) -> click.Command:
    """Whole-paragraph help and the examples of `cmd` (and of its subcommands, for a group)."""
    cmd.help = unwrap(cmd.help)
    if cmd.epilog is None:
        cmd.epilog = epilog(path)
    for name, sub in getattr(cmd, "commands", {}).items():
        polish(sub, f"{path} {name}")
    return cmd
