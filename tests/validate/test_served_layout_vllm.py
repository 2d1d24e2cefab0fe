"""The served-layout rule on a REAL vLLM CPU server (issue 14): a checkpoint in the real Qwen3.6 layout
(`model.language_model.layers.N`, `Qwen3_5ForConditionalGeneration`: the tiny VL base) served by vLLM; a
text-layout adapter (`model.layers.N`, what `make demo` trains) loads with HTTP 200 and changes nothing, and
the copy publish normalises (keys renamed, parity proven) changes the output.

vLLM's CPU build is 0.32 (docs/vllm.md): the VL class's weight mapper has no `model.layers.` rule there too
(upstream vllm#48019), so the rule this test exercises holds for it as for 0.19-0.25.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support import prestart
from tests.support.fleet_server import VllmServer, fleet_env_available
from tests.support.helpers import peft_adapter, tiny_base_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.skipif(not fleet_env_available(), reason=".fleet-venv missing: run `make fleet-env`"),
]
PROMPT = "The quick brown fox"


def _complete(server, model: str) -> str:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _load(server, name: str, path: Path) -> None:
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter", timeout=120, json={"lora_name": name, "lora_path": str(path)}
    )
    assert r.status_code == 200, r.text


def _vl_instance(root: Path, factory) -> list[VllmServer]:
    """The tiny VL base served text-only (started early: tests/support/prestart.py)."""
    # The checkpoint as vLLM serves it text-only: `--language-model-only` skips the (stub) vision tower; the
    # processor files the multimodal front end reads are the Qwen-VL defaults.
    served = Path(shutil.copytree(tiny_base_dir(factory, layout="vl"), root / "served-vl"))
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 3136,
        "max_pixels": 1003520,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "do_normalize": True,
        "do_resize": True,
        "processor_class": "Qwen3VLProcessor",
    }
    (served / "preprocessor_config.json").write_text(json.dumps(image))
    (served / "video_preprocessor_config.json").write_text(
        json.dumps({**image, "video_processor_type": "Qwen3VLVideoProcessor"})
    )
    return [VllmServer(served, root, "vl", extra_args=["--language-model-only"])]


prestart.plan("served-vl", __file__, _vl_instance)


def test_text_layout_keys_never_apply_on_the_vl_class_and_the_renamed_copy_does(
    tiny_base, tiny_vl_base, tmp_path, tmp_path_factory
):
    from pipeline.artifacts.normalise import normalise_for_serving
    from pipeline.serving.versions import VL_CLASS, rules_for
    from pipeline.validate import FleetRules, validate_adapter

    text = peft_adapter(tiny_base, tmp_path / "text", r=8, alpha=16, b_std=0.5, seed=3)
    rep = validate_adapter(text, tiny_vl_base, FleetRules(served_path=tiny_vl_base, vllm_version="0.32.0"))
    assert "keys.served_layout" in {c.id for c in rep.checks}
    fixed = Path(shutil.copytree(text, tmp_path / "fixed"))
    assert normalise_for_serving(fixed, VL_CLASS, rules_for("0.32.0"))["layout"]

    _, (server,) = prestart.take("served-vl", tmp_path_factory)
    try:
        try:
            server.wait_ready(300)
        except RuntimeError as e:  # the CPU build cannot start the VL class here: say so, do not fake it
            pytest.skip(f"vLLM CPU could not serve the tiny VL checkpoint: {str(e)[-400:]}")
        _load(server, "text", text)
        _load(server, "fixed", fixed)
        base = _complete(server, server.model)
        assert _complete(server, "text") == base  # loaded (HTTP 200), never applied
        assert _complete(server, "fixed") != base  # the same tensors under the served layout apply
    finally:
        server.stop()
