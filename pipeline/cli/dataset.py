"""`pipeline dataset check`: chat JSONL checks before any training.

With `--config CONFIG` it runs the dataset half of `pipeline train`'s checks on the files the
config names (pipeline.train.data_gate: each file read with its own datasets entry, then what
axolotl keeps of it with the config's tokenizer, chat template and `sequence_len`, counted by
axolotl's own preprocessing), with train's refusals and exit codes. With FILES alone it checks the
files' format, and their lengths only when given `--tokenizer` and `--sequence-len`; what it did
not check it says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, exit_as, project_config
from pipeline.errors import CheckFailed, UsageError
from pipeline.train.config import ALLOWABLE, check_dataset_entries, load_training_config, missing_inputs
from pipeline.train.data_gate import check_config_datasets
from pipeline.train.dataset import DatasetReport, check_datasets

app = typer.Typer(help="Dataset checks.", no_args_is_help=True)


def _kept_line(k: dict) -> str:
    reasons = ", ".join(
        f"{k[n]} {what}"
        for n, what in (
            ("too_long", f"longer than sequence_len {k['sequence_len']}"),
            ("too_short", "shorter than min_sample_len"),
            ("no_trainable", "without a trainable token"),
        )
        if k[n]
    )
    cut = f", truncates {k['truncated']}" if k["truncated"] else ""
    return (
        f"{k['split']}: axolotl keeps {k['kept']} of {k['conversations']} conversations "
        f"(dropped {k['dropped']}{': ' + reasons if reasons else ''}{cut}), "
        f"{k['kept_trainable_tokens']} of {k['trainable_tokens']} trainable tokens"
    )


def _not_checked(rep: DatasetReport, config: Path | None, lengths: bool) -> list[str]:
    """What this check did not look at, in words (a report must not read as a pass of it)."""
    if config is not None and not rep.kept:
        return [
            "NOT CHECKED: lengths against sequence_len and what axolotl keeps (the base's config or "
            "tokenizer cannot be read here; see the warning above): train counts them when it runs"
        ]
    if config is None and not lengths:
        return [
            "NOT CHECKED: lengths against sequence_len and what axolotl keeps: pass --config CONFIG "
            "(the axolotl config: its tokenizer, template and sequence_len), or --tokenizer and --sequence-len"
        ]
    return []


@app.command("check")
def check(
    train: Annotated[
        list[Path] | None, typer.Argument(help="training JSONL files (or --config: the files it names)")
    ] = None,
    validation: Annotated[list[Path], typer.Option("--validation", help="validation JSONL files")] = [],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="axolotl config: check the files it names as `pipeline train` does, with its dataset gate",
        ),
    ] = None,
    set_: Annotated[list[str], typer.Option("--set", help="with --config: override a key, key=value")] = [],
    allow: Annotated[
        list[str], typer.Option(help="with --config: accept a finding train would refuse (check id)")
    ] = [],
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer dir for length checks")] = None,
    sequence_len: Annotated[int | None, typer.Option(min=1, help="tokens")] = None,
    as_json: JsonOption = False,
):
    """Check chat JSONL datasets (schema, trainable turns, lengths, duplicates, overlap, fingerprint).

    With --config, the checks and the dataset gate `pipeline train` applies to the files the config
    names: what axolotl keeps, with the config's tokenizer, template and sequence_len; exit 1 where
    train would refuse. Without it, lengths are checked only with --tokenizer and --sequence-len.

    Examples:
      pipeline dataset check --config my-task.yml
      pipeline dataset check data/train.jsonl --validation data/validation.jsonl"""
    if config is not None:
        if train or validation or tokenizer or sequence_len:
            raise UsageError(
                "--config names the files, tokenizer and sequence_len: give FILES, --validation, --tokenizer "
                "and --sequence-len only without it (or change the config, or --set sequence_len=N)"
            )
        if unknown := set(allow) - set(ALLOWABLE):
            raise UsageError(f"--allow {sorted(unknown)}: unknown check id; allowed: {sorted(ALLOWABLE)}")
        tc = load_training_config(config, set_)
        check_dataset_entries(tc)
        if not tc.data.get("datasets"):
            raise UsageError(f"{config}: names no datasets (a list of mappings with a path)")
        if missing := missing_inputs(tc):
            raise UsageError("\n  ".join(missing))
        rep = check_config_datasets(project_config(), tc, set(allow))
        lengths = bool(rep.kept)
    else:
        if set_ or allow:
            raise UsageError("--set and --allow apply to --config CONFIG")
        if not train:
            raise UsageError(
                "give the JSONL FILES to check, or --config CONFIG (the axolotl config naming them)"
            )
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
        lengths = tok is not None and bool(sequence_len)
    missing_checks = _not_checked(rep, config, lengths)
    if as_json:
        typer.echo(json.dumps({**rep.to_dict(), "not_checked": missing_checks}, indent=2))
    else:
        for f in rep.findings:
            typer.echo(str(f))
        for s in rep.files:
            too_long = f", too long {s.too_long}" if lengths and config is None else ""
            typer.echo(f"{s.path}: {s.conversations} conversations, sha256 {s.sha256[:16]}{too_long}")
        for k in rep.kept:
            typer.echo(_kept_line(k))
        for line in missing_checks:
            typer.echo(line)
        typer.echo(f"fingerprint {rep.fingerprint}  {'OK' if rep.ok else 'FAILED'}")
    exit_as(CheckFailed, not rep.ok)
