"""`pipeline dev ...` (tiny models for demos and tests) and `pipeline demo` (the main job end to end)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, adapter_name, emit_json, finite, project_config
from pipeline.cli.render import Column, Output, print_rows
from pipeline.dev.demo import run_demo
from pipeline.dev.realbase import DEFAULT_SHARD_GB, build_real_base
from pipeline.dev.servedbase import build_served_base
from pipeline.dev.tasks import write_task_data
from pipeline.dev.tinybase import build_tiny_base
from pipeline.dev.trainedbase import build_trained_base

app = typer.Typer(help="Developer tools: tiny models for demos and tests.", no_args_is_help=True)
demo_app = typer.Typer()


class Layout(StrEnum):
    text = "text"  # Qwen3_5ForCausalLM, keys model.layers.N
    vl = "vl"  # the real checkpoint layout: model.language_model.layers.N, mtp.*, visual.*


@app.command("tiny-base")
def tiny_base(
    out: Annotated[Path, typer.Argument(help="directory to write (replaced)")],
    layout: Annotated[
        Layout, typer.Option(help="text (Qwen3_5ForCausalLM) or vl (real checkpoint layout + mtp.*)")
    ] = Layout.text,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="random seed")] = 0,
):
    """Build a tiny random-weight Qwen3.5 base with a local tokenizer and chat template."""
    build_tiny_base(out, layout=layout.value, seed=seed)
    typer.echo(f"wrote tiny {layout.value} base to {out}")


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"  # draws the weights on the GPU: the 64-layer model in seconds (needs ~55 GB free)


@app.command("real-base")
def real_base(
    out: Annotated[Path, typer.Argument(help="directory to write (replaced)")],
    layers: Annotated[
        int,
        typer.Option(
            min=4,
            help="decoder layers (3 linear-attention + 1 full-attention, repeated); 64 = the real model",
        ),
    ] = 64,
    device: Annotated[Device, typer.Option(help="where to draw the random weights")] = Device.cpu,
    shard_gb: Annotated[
        float, typer.Option(min=0.001, callback=finite, help="target shard size, GB (1e9 bytes)")
    ] = DEFAULT_SHARD_GB,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="random seed")] = 0,
):
    """Build a random-weight bf16 base with the exact Qwen3.6-27B geometry in the real checkpoint layout.

    `model.language_model.*` + `model.visual.*` + `mtp.*`, sharded with an index, tokenizer and chat
    template: what `pipeline train axolotl_configs/qwen3.6-27b-lora.yml --set base_model=OUT` needs
    on a host without the model hub. 64 layers: ~54 GB on disk.
    """
    build_real_base(out, layers, device=device.value, seed=seed, shard_gb=shard_gb)


@app.command("trained-base")
def trained_base(
    out: Annotated[Path, typer.Argument(help="directory to write (replaced)")],
    layers: Annotated[
        int, typer.Option(min=4, help="decoder layers, a multiple of 4 ([linear x3, full] repeated)")
    ] = 8,
    hidden: Annotated[int, typer.Option(min=64, help="model width (a multiple of 64)")] = 1024,
    minutes: Annotated[
        float,
        typer.Option(min=0.01, callback=finite, help="training-loop budget, minutes (data and eval on top)"),
    ] = 4.0,
    device: Annotated[Device, typer.Option(help="where to train (cuda: bf16 autocast)")] = Device.cuda,
    corpus: Annotated[
        list[Path] | None, typer.Option(help="folders of text files to train on (default: site-packages)")
    ] = None,
    corpus_mb: Annotated[
        float, typer.Option(min=0.01, callback=finite, help="corpus cap, MB (1e6 bytes)")
    ] = 150.0,
    vocab: Annotated[
        int, typer.Option(min=300, max=1 << 17, help="BPE vocabulary, special tokens included")
    ] = 8192,
    seq_len: Annotated[int, typer.Option(min=16, max=1 << 16, help="tokens per training window")] = 1024,
    batch: Annotated[int, typer.Option(min=1, max=4096, help="windows per step")] = 32,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="random seed")] = 0,
    json_out: JsonOption = False,
):
    """Train a stand-in base of the fleet's architecture from scratch on an offline corpus.

    `Qwen3_5ForConditionalGeneration` with [linear x3, full] layers, gated attention, Gated-DeltaNet and
    one MTP layer (`mtp.*`), trained on the installed packages' sources and docs with LM + MTP loss
    (the MTP layer fed as vLLM's `qwen3_5_mtp` feeds it). Writes the checkpoint and `trained_base.json`
    (corpus sha256, held-out perplexity, MTP agreement per draft position).
    """
    rep = build_trained_base(
        out, layers=layers, hidden=hidden, minutes=minutes, device=device.value, corpus_roots=corpus,
        corpus_mb=corpus_mb, vocab_size=vocab, seq_len=seq_len, batch=batch, seed=seed,
    )  # fmt: skip
    summary = {
        "out": str(out),
        "heldout_ppl": round(rep["heldout_ppl"], 3),
        "heldout_ppl_initial": round(rep["heldout_ppl_initial"], 1),
        "mtp_acceptance_length_greedy": rep["mtp_greedy"]["acceptance_length"],
        "mtp_agreement_greedy": rep["mtp_greedy"]["agreement"],
        "training": {k: rep["training"][k] for k in ("steps", "tokens", "seconds", "tokens_per_s")},
        "corpus": {k: rep["corpus"][k] for k in ("files", "bytes", "sha256")},
    }
    if json_out:
        emit_json(summary)
    else:
        for k, v in summary.items():
            typer.echo(f"{k}: {v}")


class QuantDevice(StrEnum):
    auto = "auto"  # cuda when torch sees a GPU
    cpu = "cpu"
    cuda = "cuda"


class Task(StrEnum):
    toolcall = "toolcall"  # a tool call in the chat template's format; metric tool_call
    snake = "snake"  # words -> snake_case identifier; metric exact_match


@app.command("task-data")
def task_data(
    task: Annotated[Task, typer.Argument(help="toolcall or snake")],
    out: Annotated[Path, typer.Argument(help="directory for TASK_train.jsonl and TASK_validation.jsonl")],
    train: Annotated[int, typer.Option(min=1, max=1_000_000, help="training conversations")] = 1200,
    validation: Annotated[int, typer.Option(min=1, max=10_000, help="held-out conversations")] = 64,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="random seed")] = 0,
    json_out: JsonOption = False,
):
    """Write a stand-in task's chat-format training and held-out data (a task metric to train an adapter for)."""
    res = write_task_data(task.value, out, train, validation, seed)
    if json_out:
        emit_json(res)
    else:
        typer.echo(
            f"wrote {res['n_train']} + {res['n_validation']} {task.value} conversations to {out} (metric {res['metric']})"
        )


@app.command("served-base")
def served_base(
    src: Annotated[Path, typer.Argument(help="bf16 checkpoint (e.g. written by `pipeline dev real-base`)")],
    out: Annotated[Path, typer.Argument(help="directory to write (replaced)")],
    device: Annotated[
        QuantDevice, typer.Option(help="where modelopt calibrates and packs")
    ] = QuantDevice.auto,
    calib_data: Annotated[
        Path | None, typer.Option(help="chat JSONL for calibration (default: built-in prompts)")
    ] = None,
    max_seq_len: Annotated[int, typer.Option(min=8, max=1 << 20, help="tokens per calibration sample")] = 512,
    shard_gb: Annotated[
        float, typer.Option(min=0.001, callback=finite, help="largest shard, GB (1e9 bytes)")
    ] = 5.0,
):
    """Quantize a bf16 base into the fleet's served format: ModelOpt NVFP4, MTP kept in bf16, text only.

    nvidia-modelopt's NVFP4_DEFAULT_CFG plus `*mtp*` / `*visual*` disabled (the recipe of the fleet's
    checkpoint class), calibrated, exported with `hf_quant_config.json`, `mtp.*` grafted back from SRC.
    Serve with `--quantization modelopt --language-model-only`.
    """
    build_served_base(
        src,
        out,
        device=device.value,
        calib_data=calib_data,
        max_seq_len=max_seq_len,
        max_shard_size=f"{int(shard_gb * 1000)}MB",
    )


@demo_app.command()
def demo(
    name: Annotated[str, typer.Option(help="adapter name", callback=adapter_name)] = "agent-tools",
    config: Annotated[Path, typer.Option(help="axolotl config")] = Path("axolotl_configs/tiny-cpu.yml"),
    as_json: JsonOption = False,
):
    """Run the main job on the embedded default: tiny base to published adapter.

    Stages: tiny base, dataset check + axolotl training, validate, register (sqlite MLflow), publish.
    """
    summary = run_demo(project_config(), name=name, axolotl_config=config)
    if as_json:
        return emit_json(summary)
    rows = [{"field": k, "value": v} for k, v in summary.items() if k not in ("seconds", "version")]
    rows += [{"field": f"seconds {k}", "value": round(v, 1)} for k, v in summary["seconds"].items()]
    print_rows(
        rows, (Column("FIELD", lambda r: r["field"]), Column("VALUE", lambda r: r["value"])), Output.table
    )
