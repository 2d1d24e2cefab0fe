"""The `pipeline` command line: a thin layer over the stage modules.

Heavy libraries (torch, transformers, mlflow, axolotl) are imported inside commands so that
`pipeline --help` stays fast. Exit codes: 0 ok, 1 check failed, 2 usage/input error,
3 locked, 4 fleet did not converge (see README).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Train, validate, register and publish LoRA adapters for a vLLM fleet.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
dev_app = typer.Typer(help="Developer tools: tiny models for demos and tests.", no_args_is_help=True)
config_app = typer.Typer(help="The project config file (pipeline.yaml).", no_args_is_help=True)
dataset_app = typer.Typer(help="Dataset checks.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
app.add_typer(config_app, name="config")
app.add_typer(dataset_app, name="dataset")

_state: dict = {"config": None}


def _err(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/] {msg}", highlight=False, markup=True, soft_wrap=True)


def handle_errors(fn):
    """Turn the pipeline's errors into a message on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from pipeline.config import ConfigError
        from pipeline.errors import PipelineError

        try:
            return fn(*args, **kwargs)
        except PipelineError as e:
            _err(str(e))
            raise typer.Exit(e.exit_code) from None
        except ConfigError as e:
            _err(str(e))
            raise typer.Exit(2) from None
        except FileNotFoundError as e:
            _err(str(e))
            raise typer.Exit(2) from None

    return wrapper


def project_config():
    from pipeline.config import load_config

    return load_config(_state["config"])


@app.callback()
def main(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="pipeline.yaml (default: $PIPELINE_CONFIG or ./pipeline.yaml)"),
    ] = None,
):
    _state["config"] = config


# -- config -----------------------------------------------------------------------------------
@config_app.command("show")
@handle_errors
def config_show(as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False):
    """Print the effective config (file + environment overrides + defaults); API keys are never shown."""
    cfg = project_config()
    data = json.loads(cfg.model_dump_json())
    data["source"] = str(cfg.source) if cfg.source else None
    data["effective"] = {"tracking_uri": cfg.tracking_uri, "artifact_root": str(cfg.artifact_root)}
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        import yaml

        typer.echo(yaml.safe_dump(data, sort_keys=False))


# -- dev ----------------------------------------------------------------------------------------
@dev_app.command("tiny-base")
@handle_errors
def dev_tiny_base(
    out: Annotated[Path, typer.Argument(help="directory to write (replaced)")],
    layout: Annotated[
        str, typer.Option(help="text (Qwen3_5ForCausalLM) or vl (real checkpoint layout + mtp.*)")
    ] = "text",
    seed: int = 0,
):
    """Build a tiny random-weight Qwen3.5 base with a local tokenizer and chat template."""
    from pipeline.tinybase import build_tiny_base

    build_tiny_base(out, layout=layout, seed=seed)
    typer.echo(f"wrote tiny {layout} base to {out}")


# -- dataset -------------------------------------------------------------------------------------
@dataset_app.command("check")
@handle_errors
def dataset_check(
    train: Annotated[list[Path], typer.Argument(help="training JSONL files")],
    validation: Annotated[list[Path], typer.Option("--validation", help="validation JSONL files")] = [],
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer dir for length checks")] = None,
    sequence_len: Annotated[int | None, typer.Option(help="tokens")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
):
    """Check chat JSONL datasets (schema, trainable turns, lengths, duplicates, overlap, fingerprint)."""
    from pipeline.dataset import check_datasets

    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer))
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
    raise typer.Exit(0 if rep.ok else 1)


# -- train -----------------------------------------------------------------------------------------
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def train(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="axolotl YAML (axolotl_configs/...)")],
    set_: Annotated[
        list[str], typer.Option("--set", help="override a config key: key=value (YAML value)")
    ] = [],
    overlay: Annotated[
        list[Path], typer.Option(help="YAML merged over CONFIG, e.g. axolotl_configs/fsdp2.yml")
    ] = [],
    allow: Annotated[list[str], typer.Option(help="accept a setting the fleet refuses (check id)")] = [],
    name: Annotated[str | None, typer.Option(help="adapter name (default: config file stem)")] = None,
    gpus: Annotated[int, typer.Option(help="GPUs: >1 uses axolotl's accelerate launcher")] = 1,
    launcher: Annotated[
        str | None, typer.Option(help="python | accelerate | torchrun (axolotl's launchers)")
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
):
    """Train a LoRA with axolotl; leaves <run>/adapter/ with manifest.json. Args after `--` go to the launcher."""
    from pipeline.train import train as run_train

    res = run_train(
        project_config(),
        config,
        overrides=set_,
        overlays=overlay,
        allow=set(allow),
        name=name,
        gpus=gpus,
        launcher=launcher,
        launcher_args=list(ctx.args),
        show_progress=progress and sys.stderr.isatty(),
        echo=typer.echo,
    )
    m = res.manifest["metrics"]
    typer.echo(
        f"adapter: {res.adapter_dir}\ntrain_loss {m.get('train_loss')}  eval_loss {m.get('eval_loss')}  "
        f"tokens/s {m.get('tokens_per_s', 0):.0f}  mfu {m.get('mfu')}  ({res.seconds:.1f} s)"
    )


# -- validate ----------------------------------------------------------------------------------------
def render_report(rep) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"validation: {rep.adapter}", show_lines=False)
    for col in ("check", "severity", "where", "message"):
        t.add_column(col, overflow="fold")
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for c in rep.checks:
        t.add_row(c.id, f"[{colors.get(c.severity, 'white')}]{c.severity}[/]", c.where, c.message)
    con = Console()
    if rep.checks:
        con.print(t)
    con.print(f"verdict: [bold {'green' if rep.passed else 'red'}]{rep.verdict}[/]  stats: {rep.stats}")


@app.command()
@handle_errors
def validate(
    adapter: Annotated[Path, typer.Argument(help="adapter directory")],
    base: Annotated[
        Path | None, typer.Option(help="bf16 base checkpoint dir (headers only are read)")
    ] = None,
    served: Annotated[
        Path | None, typer.Option(help="served checkpoint dir, e.g. NVFP4 (default: served.path)")
    ] = None,
    training_config: Annotated[
        Path | None, typer.Option(help="resolved axolotl config of the run (default: from manifest.json)")
    ] = None,
    behaviour: Annotated[
        bool,
        typer.Option(
            "--behaviour",
            help="also compare eval loss and canary outputs (loads the model: CPU for tiny models)",
        ),
    ] = False,
    fold_rslora: Annotated[
        bool,
        typer.Option(
            "--fold-rslora",
            help="rewrite an rsLoRA adapter's lora_alpha to the "
            "plain-LoRA equivalent (in place, parity-checked) before validating",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
):
    """Check an adapter against the base, the served checkpoint and the fleet. Exit 0 pass, 1 fail, 2 usage."""
    from pipeline.errors import UsageError
    from pipeline.validate import default_base, validate_with_config

    cfg = project_config()
    if not adapter.is_dir():
        raise UsageError(f"{adapter}: adapter directory not found")
    if base is not None and not base.is_dir():
        raise UsageError(f"{base}: base checkpoint directory not found")
    if (base or default_base(cfg, adapter)) is None:
        raise UsageError("no base checkpoint: pass --base DIR or set base.path in pipeline.yaml")
    rep = validate_with_config(
        cfg,
        adapter,
        base,
        served_dir=served,
        training_config=training_config,
        behaviour=behaviour,
        fold_rslora=fold_rslora,
    )
    if as_json:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        render_report(rep)
    raise typer.Exit(0 if rep.passed else 1)


# -- register -------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def register(
    adapter: Annotated[
        Path, typer.Argument(help="adapter directory from `pipeline train` (with manifest.json)")
    ],
    name: Annotated[str, typer.Option(help="registered model name (the fleet's stable adapter name)")],
    base: Annotated[Path | None, typer.Option(help="bf16 base checkpoint dir for validation")] = None,
):
    """Validate, then record the adapter in MLflow as a model version with alias `candidate`."""
    from pipeline import registry
    from pipeline.validate import validate_with_config

    cfg = project_config()
    rep = validate_with_config(cfg, adapter, base)
    reg = registry.register_adapter(cfg, adapter, name, rep.to_dict())
    typer.echo(
        f"registered {reg.name} version {reg.version} (alias candidate), validation {rep.verdict}, "
        f"model {reg.model_id}, run {reg.run_id}"
    )
    if not rep.passed:  # recorded for lineage, but it must not look like a success
        failed = ", ".join(sorted({c.id for c in rep.checks if c.severity == "error"}))
        _err(
            f"validation failed ({failed}): version {reg.version} is registered but `publish` will refuse it; "
            f"see `pipeline validate {adapter}`"
        )
        raise typer.Exit(1)


# -- publish ----------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def publish(
    name: Annotated[str, typer.Argument(help="registered model name")],
    version: Annotated[int | None, typer.Option(help="model version")] = None,
    alias: Annotated[str | None, typer.Option(help="model alias, e.g. candidate")] = None,
):
    """Publish a validated version to <volume>/<NAME>-v<N>/ atomically; alias `production` follows."""
    from pipeline.publish import publish as do_publish

    res = do_publish(project_config(), name, version, alias)
    what = "published" if res.created else "already on the volume (not rewritten)"
    typer.echo(f"{what}: {res.name} v{res.version} -> {res.path}")
    if res.previous_production not in (None, res.version):
        typer.echo(
            f"alias production: v{res.previous_production} -> v{res.version} (previous = "
            f"v{res.previous_production})"
        )
    if res.instances:
        typer.echo(f"serving on: {', '.join(res.instances)}")
    for w in res.warnings:
        typer.echo(f"warning: {w}", err=True)


# -- demo -------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def demo(
    name: Annotated[str, typer.Option(help="adapter name")] = "agent-tools",
    config: Annotated[Path, typer.Option(help="axolotl config")] = Path("axolotl_configs/tiny-cpu.yml"),
):
    """Run the main job on the embedded default: tiny base, train, validate, register, publish."""
    from pipeline.demo import run_demo

    run_demo(project_config(), name=name, axolotl_config=config, echo=typer.echo)


# Areas with their own command modules (each a thin layer over its library module).
from pipeline import cli_canary, cli_fleet, cli_merge, cli_registry, cli_schedule  # noqa: E402

for _area in (cli_fleet, cli_registry, cli_merge, cli_canary, cli_schedule):
    _area.register(app)


if __name__ == "__main__":
    app()
