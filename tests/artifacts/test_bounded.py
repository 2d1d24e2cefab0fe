"""Parsers without bounds (issue 30 kind 2): every file the pipeline parses is checked for size and depth
first, and a file over a bound is a clear error naming it, never a RecursionError.

Unit level: the readers of each record (manifest, desired state, intent, safetensors header, adapter
config, project config, axolotl config, chat template, dataset line). The commands on the same
inputs are in tests/test_no_tracebacks.py.
"""

from __future__ import annotations

import json
import struct

import pytest

from pipeline.artifacts.bounded import (
    BoundsError,
    check_template,
    loads_json,
    loads_yaml,
    nesting_depth,
    read_bounded,
)

DEEP = "[" * 100_000


def test_depth_is_counted_outside_strings():
    assert nesting_depth('{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert nesting_depth('"\\"[[["') == 0
    assert nesting_depth(DEEP) == 100_000


def test_real_records_are_well_inside_the_bounds(tiny_base):
    for p in tiny_base.glob("*.json"):
        loads_json(p.read_text(), str(p))
    check_template((tiny_base / "chat_template.jinja").read_text(), "template")


def test_the_issues_records_name_the_file(tmp_path):
    """100,000 `[` in manifest.json, fleet-state.json and the .txn record: RecursionError before."""
    from pipeline.artifacts.manifest import read_manifest
    from pipeline.errors import UsageError
    from pipeline.fleet.state import load_state
    from pipeline.release.transaction import load_intent

    (tmp_path / "manifest.json").write_text(DEEP)
    with pytest.raises(ValueError, match=r"manifest.json: nested 100000 levels deep \(at most 64\)"):
        read_manifest(tmp_path)
    (tmp_path / "fleet-state.json").write_text(DEEP)
    with pytest.raises(UsageError, match=r"fleet-state.json: nested 100000 levels"):
        load_state(tmp_path)
    (tmp_path / ".txn").mkdir()
    (tmp_path / ".txn" / "agent.json").write_text(DEEP)
    with pytest.raises(UsageError, match=r"agent.json: unreadable record.*nested 100000 levels"):
        load_intent(tmp_path, "agent")


def test_safetensors_header_adapter_config_and_checkpoint_config(tmp_path):
    """Siblings: the other JSON the pipeline reads from untrusted directories."""
    from pipeline.artifacts.adapter import AdapterConfigError, read_adapter_config
    from pipeline.artifacts.checkpoint import read_checkpoint
    from pipeline.artifacts.safetensors import HeaderError, read_safetensors_header

    raw = ('{"a":' + DEEP).encode()
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(HeaderError, match=r"w.safetensors: header: nested"):
        read_safetensors_header(tmp_path / "w.safetensors")
    (tmp_path / "adapter_config.json").write_text(DEEP)
    with pytest.raises(AdapterConfigError, match=r"adapter_config.json: nested"):
        read_adapter_config(tmp_path)
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ValueError, match=r"config.json: nested"):
        read_checkpoint(tmp_path)


def test_size_is_checked_before_reading(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b" " * 2048)
    with pytest.raises(BoundsError, match=r"big.json: 2048 bytes, more than 1 KiB allowed for the record"):
        read_bounded(p, 1024, "the record")


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    """Sibling (FIFO files): `--config` or a record that is a named pipe blocked `open` until another
    process wrote to it: every command hung. It is refused on its fstat; /dev/null still reads."""
    import os
    import socket

    fifo = tmp_path / "pipeline.yaml"
    os.mkfifo(fifo)
    with pytest.raises(BoundsError, match=r"pipeline.yaml: a named pipe \(FIFO\), not a regular file"):
        read_bounded(fifo, 1024)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))
    with pytest.raises(OSError):  # a socket cannot even be opened (ENXIO)
        read_bounded(tmp_path / "s", 1024)
    assert read_bounded("/dev/null", 1024) == b""
    with pytest.raises(IsADirectoryError):
        read_bounded(tmp_path, 1024)


@pytest.mark.parametrize(
    "text,says",
    [
        ("a: " + "[" * 5000, "nested more than 64 levels deep"),  # flow style
        (
            "a:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(200)),
            "nested more than 64",
        ),  # block style
        (  # a billion laughs: 10 aliases per level, 9 levels
            "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join(["*" + chr(97 + i)] * 10) + "]\n"
                for i in range(9)
            ),
            "aliases expand to more than",
        ),
        ("a: &a [*a]", "refers to a node that contains it"),
    ],
    ids=["flow", "block", "laughs", "recursive"],
)
def test_yaml_bounds(text, says):
    with pytest.raises(BoundsError, match=says):
        loads_yaml(text, "cfg.yaml")
    assert loads_yaml("a: {b: [1, 2]}\nc: &x 1\nd: *x", "ok") == {"a": {"b": [1, 2]}, "c": 1, "d": 1}


def test_project_and_axolotl_configs(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.errors import UsageError
    from pipeline.train.config import load_training_config

    p = tmp_path / "pipeline.yaml"
    p.write_text("fleet: " + "[" * 100_000)
    with pytest.raises(ConfigError, match=r"pipeline.yaml:1: nested more than 64"):
        load_config(p)
    a = tmp_path / "axolotl.yml"
    a.write_text("base_model: x\nlora: " + "{a: " * 3000)
    with pytest.raises(UsageError, match=r"axolotl.yml:2: nested more than 64.*not an axolotl config"):
        load_training_config(a)
    from pipeline.train.config import parse_override

    with pytest.raises(UsageError, match=r"--set x:1: nested more than 64"):
        parse_override("x=" + "[" * 5000)


@pytest.mark.parametrize(
    "template,says",
    [
        ("{{ " + "(" * 100 + "x" + ")" * 100 + " }}", "brackets nested 102 levels"),
        ("{% if a %}" * 100 + "{% endif %}" * 100, "blocks nested more than 32"),
        ("{% for x in y %}" * 40 + "{% endfor %}" * 40, "blocks nested more than 32"),
    ],
)
def test_chat_templates(tmp_path, template, says):
    from pipeline.validate.chat import TokenizerError, read_template

    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(TokenizerError, match=says):
        read_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(TokenizerError, match=says):
        read_template(tmp_path)


def test_a_dataset_line_is_a_finding(tmp_path):
    from pipeline.train.dataset import check_datasets  # noqa: F401 - the reader the CLI uses

    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + DEEP + "\n")
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["dataset", "check", str(f)])
    assert r.exit_code in (1, 2) and "Traceback" not in r.output and "nested 100000 levels" in r.output


def test_a_number_of_5000_digits_is_a_bounds_error(tmp_path):
    """Sibling (parsers without bounds, numbers): Python refuses to convert more than 4300 decimal
    digits with a bare ValueError ("use sys.set_int_max_str_digits()"): a traceback from every command
    reading pipeline.yaml or fleet-state.json, from `dataset check`, `train --set` and `validate` (a
    safetensors header). Now it is a BoundsError naming the file and line; real values still read
    (a tokenizer's model_max_length has 31 digits)."""
    from pipeline.artifacts.safetensors import HeaderError, read_safetensors_header

    big = "9" * 5000
    with pytest.raises(BoundsError, match=r"fleet-state.json: a number of 5000 digits \(at most 4300\)"):
        loads_json('{"v": ' + big + "}", "fleet-state.json")
    with pytest.raises(BoundsError, match=r"pipeline.yaml:2: a number of 5000 digits"):
        loads_yaml("fleet:\n  max_lora_rank: " + big + "\n", "pipeline.yaml")
    assert loads_json('{"m": 1000000000000000019884624838656}', "t") == {"m": 10**30 + 19884624838656}
    assert loads_yaml("n: -1_000\nh: 0x1f\n", "y") == {"n": -1000, "h": 31}
    raw = ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + big + "]}}").encode()
    p = tmp_path / "adapter_model.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(HeaderError, match="a number of 5000 digits"):
        read_safetensors_header(p)


def test_json_inside_a_dataset_string_is_bounded_too(tmp_path):
    """Sibling: axolotl's reader parses a tool call's `arguments` string with json.loads; its depth was
    not the line's (a string literal there): 100,000 `[` in it ended `dataset check` in a RecursionError."""
    from pipeline.train.dataset import check_datasets

    call = {"type": "function", "function": {"name": "f", "arguments": DEEP}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    report = check_datasets([f])
    (finding,) = [x for x in report.findings if x.severity == "error"]
    assert "tool call 'f' arguments: nested 100000 levels deep" in finding.message, finding
