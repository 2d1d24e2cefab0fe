"""`pipeline validate` output for people: identical findings grouped, stats as a table (issue 17 item 9)."""

import subprocess
import sys

from pipeline.cli.validate import flatten_stats, group_findings, render_report
from pipeline.findings import Finding
from pipeline.validate import ValidationReport

MODULES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "mlp.down_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.out_proj",
]


def _rank_findings() -> list[Finding]:
    """The issue's instance: one finding per adapted module (25 = 5 modules x 5 layers), same message."""
    msg = "lora_A rank 32 exceeds the fleet's --max-lora-rank 16: retrain with a smaller r"
    return [
        Finding(
            "fleet.rank",
            "error",
            msg,
            f"adapter_model.safetensors:base_model.model.model.layers.{i}.{m}.lora_A.weight",
        )
        for i in range(5)
        for m in MODULES
    ]


def test_25_identical_findings_are_one_row_with_count_modules_and_layers():
    groups = group_findings(_rank_findings())
    assert len(groups) == 1 and groups[0].count == 25
    where = groups[0].where()
    assert where.startswith("25 places in adapter_model.safetensors")
    assert "modules self_attn.q_proj, self_attn.k_proj, mlp.down_proj" in where and "layers 0-4" in where


def test_messages_that_name_their_own_module_or_layer_group_too():
    """Sibling: the message embeds the tensor (or a layer index), so the raw messages all differ."""
    fs = [
        Finding(
            "keys.dtype",
            "warning",
            f"layers.{i}.mlp.up_proj.lora_B.weight is float32; vLLM casts to bf16",
            f"w:layers.{i}.mlp.up_proj",
        )
        for i in (0, 1, 2, 7)
    ]
    groups = group_findings(fs)
    assert len(groups) == 1 and groups[0].count == 4 and "layers 0-2, 7" in groups[0].where()


def test_different_findings_stay_apart():
    fs = [
        *_rank_findings()[:3],
        Finding("fleet.rank", "warning", "other", "x"),
        Finding("keys.shape", "error", "bad", "y"),
    ]
    assert [g.count for g in group_findings(fs)] == [3, 1, 1]


def test_stats_render_as_a_table_not_a_dict(capsys):
    rep = ValidationReport(adapter="a", findings=_rank_findings())
    rep.stats = {
        "lora_modules": 25,
        "update_norm_median": {"self_attn.q_proj": 2.99271234},
        "served": {"quant_algo": "NVFP4"},
    }
    assert ("update_norm_median.self_attn.q_proj", "2.99271") in flatten_stats(rep.stats)
    render_report(rep)
    out = capsys.readouterr().out
    assert "{" not in out and "served.quant_algo" in out and "NVFP4" in out
    assert out.count("fleet.rank") == 1 and "25 error(s)" in out


def test_third_party_warnings_hidden_unless_verbose(tmp_path):
    """Warnings raised by libraries (here: a DeprecationWarning from a non-pipeline module) are not
    shown to the operator; `--verbose` shows them."""
    code = (
        "import sys, warnings\nfrom pipeline.cli import app\n"
        "sys.modules['torchao_like'] = type(sys)('torchao_like')\n"
        "def noisy():\n    warnings.warn_explicit('torchao kernels missing', UserWarning, 'torchao/__init__.py', 1, module='torchao')\n"
        "import pipeline.cli._common as c\n"
        "orig = c.setup_logging\n"
        "def patched(**kw):\n    orig(**kw)\n    noisy()\n"
        "c.setup_logging = patched\nimport pipeline.cli as pc\npc.setup_logging = patched\n"
        "try:\n    app(sys.argv[1:], prog_name='pipeline')\nexcept SystemExit:\n    pass\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", code, "config", "show"], capture_output=True, text=True, cwd=tmp_path
    )
    loud = subprocess.run(
        [sys.executable, "-c", code, "-v", "config", "show"], capture_output=True, text=True, cwd=tmp_path
    )
    assert "torchao kernels missing" not in quiet.stderr
    assert "torchao kernels missing" in loud.stderr
