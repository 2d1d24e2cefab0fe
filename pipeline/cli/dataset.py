"""`pipeline dataset check`: chat JSONL checks before any training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, exit_as
from pipeline.errors import CheckFailed, UsageError
from pipeline.train.dataset import check_datasets

app = typer.Typer(help="Dataset checks.", no_args_is_help=True)


@app.command("check")
def check(
    train: Annotated[list[Path], typer.Argument(help="training JSONL files")],
    validation: Annotated[list[Path], typer.Option("--validation", help="validation JSONL files")] = [],
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer dir for length checks")] = None,
    sequence_len: Annotated[int | None, typer.Option(min=1, help="tokens")] = None,
    as_json: JsonOption = False,
):
    """Check chat JSONL datasets (schema, trainable turns, lengths, duplicates, overlap, fingerprint)."""
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer))
        except (OSError, ValueError) as e:  # transformers: not a tokenizer directory
            raise UsageError(
                f"--tokenizer {tokenizer}: not a tokenizer directory ({str(e).splitlines()[0]})"
            ) from e
    rep = check_datasets(train, validation, tokenizer=tok, sequence_len=sequence_len)
    if as_json:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        for f in rep.findings:
            typer.echo(str(f))
        for s in rep.files:
            typer.echo(
                f"{s.path}: {s.conversations} conversations, sha256 {s.sha256[:16]}, too long {s.too_long}"
            )
        typer.echo(f"fingerprint {rep.fingerprint}  {'OK' if rep.ok else 'FAILED'}")
    exit_as(CheckFailed, not rep.ok)
