"""Every error a user can meet is a `PipelineError`, so the CLI gives it an exit code and no traceback.

`InstanceError` (a failed vLLM request) was a bare `Exception` (issue 26); the same kind held for a
truncated safetensors header, an unreadable adapter_config.json or tokenizer, an unknown vLLM
version and a fold that would change the adapter's output. A `pipeline merge` onto a truncated
base shard printed HeaderError's traceback.
"""

from __future__ import annotations

import importlib
import inspect
import shutil

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cli._common import as_pipeline_error, exit_code_for
from pipeline.errors import Hung, InstanceError, PipelineError, Unreachable
from tests.support.helpers import peft_adapter
from tests.test_architecture import _modules

# Exceptions that never leave their module: control flow between a raiser and its one catcher.
INTERNAL = {
    "pipeline.validate.facts.Unavailable": "a rule lacks a fact another rule reports: the orchestrator skips it",
    "pipeline.validate.behaviour.BehaviourUnavailable": "caught by the behaviour rule, reported as a finding",
    "pipeline.registry.read.SchemaMismatch": "the SQL reader falls back to the MLflow client",
    "pipeline.train.gate.GateUnavailable": "train counts tokens at training time instead (pipeline.train.launch)",
}


def _exception_classes() -> dict[str, type]:
    out = {}
    for m in _modules():
        if m.endswith("__main__"):
            continue
        mod = importlib.import_module(m)
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            # an Exception: `pipeline.interrupt.Interrupted` is a BaseException on purpose (exit 128 + signal)
            if issubclass(cls, Exception) and cls.__module__ == m:
                out[f"{m}.{cls.__name__}"] = cls
    return out


def test_every_exception_a_user_can_meet_is_a_pipeline_error():
    classes = _exception_classes()
    assert set(INTERNAL) <= set(classes), "INTERNAL names a class that no longer exists"
    outside = sorted(n for n, c in classes.items() if not issubclass(c, PipelineError) and n not in INTERNAL)
    assert outside == []


def test_instance_errors_exit_as_fleet_failures():
    for e in (InstanceError("i0: POST /v1/load_lora_adapter: 500"), Unreachable("i0: refused"), Hung("i0")):
        assert as_pipeline_error(e) is e
        assert exit_code_for(e) == 4


def test_merge_onto_a_truncated_base_shard_is_an_input_error(tmp_path, tiny_base):
    adapter = peft_adapter(tiny_base, tmp_path / "adapter")
    bad = tmp_path / "bad-base"
    shutil.copytree(tiny_base, bad)
    shard = bad / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    r = CliRunner().invoke(
        app, ["merge", str(adapter), "--base", str(bad), "--out", str(tmp_path / "merged")]
    )
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert "model.safetensors" in r.output and "truncated" in r.output
    assert not (tmp_path / "merged").exists()
