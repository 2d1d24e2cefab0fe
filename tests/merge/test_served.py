"""Merged NVFP4 vs hot-loaded adapter: the engine-against-engine comparison, the record, `pipeline status`.

The engines themselves are vLLM instances on a GPU (an NVFP4 checkpoint is served by vLLM's CUDA
Marlin/FP4 kernels; the CPU build has no ModelOpt NVFP4 path), run by the lead's device call
(benchmarks/vllm_h200.py); here the comparison runs on engine outputs shaped as `/v1/completions`
returns them, and the record goes into a real sqlite MLflow store.
"""

from __future__ import annotations

import json

from pipeline.artifacts.manifest import MergedBase, MergedFrom, MergedManifest, MergeStats, write_manifest
from pipeline.canary.result import EngineOutput
from pipeline.merge.served import compare_outputs, record, served_tags, show


def out(tokens, tops=None):
    return EngineOutput(tokens, tops or [{t: -0.1, t + 1: -2.5} for t in tokens])


def test_identical_runs_agree():
    p = compare_outputs(["a", "b"], [out([1, 2, 3]), out([4, 5])], [out([1, 2, 3]), out([4, 5])], 0.5)
    assert p["agreement"] == 1.0 and p["identical_prompts"] == 2 and p["compared"] == 5
    assert p["max_logprob_diff"] == 0.0


def test_a_real_divergence_counts_and_stops_the_prompt():
    hot = [out([1, 2, 3, 4])]
    merged = [out([1, 9, 7, 7], [{1: -0.1}, {9: -0.1, 2: -3.0}, {}, {}])]
    p = compare_outputs(["a"], hot, merged, 0.5)
    # steps 0 (equal) and 1 (diverged, margin 2.9 nats in the merged engine: no tie); steps 2-3 not compared
    assert p["compared"] == 2 and p["agreement"] == 0.5 and p["per_prompt"][0]["first_divergence"] == 1
    assert p["near_ties"] == 0 and p["identical_prompts"] == 0


def test_a_near_tie_divergence_agrees():
    hot = [out([1, 2], [{1: -0.1}, {2: -0.60, 9: -0.75}])]
    merged = [out([1, 9], [{1: -0.1}, {9: -0.65, 2: -0.70}])]
    p = compare_outputs(["a"], hot, merged, 0.5)
    assert p["agreement"] == 1.0 and p["near_ties"] == 1
    assert abs(p["max_logprob_diff"] - 0.10) < 1e-9 and p["max_logprob_diff_at"] == "a@1"


def test_a_nan_logprob_is_an_unbounded_difference():
    """A NaN (or an infinity on one side) was skipped: an engine answering NaN everywhere had
    max_logprob_diff 0.0 and the served parity passed."""
    nan = float("nan")
    hot = [out([1, 2])]
    merged = [out([1, 2], [{1: nan, 2: -2.5}, {2: -0.1, 3: -2.5}])]
    p = compare_outputs(["a"], hot, merged, 0.5)
    assert p["max_logprob_diff"] == float("inf") and p["max_logprob_diff_at"] == "a@0"
    # vLLM's -9999 (its -inf) on both sides is no value on either: both engines are broken there
    clamped = [out([1], [{1: -9999.0}])]
    assert compare_outputs(["a"], clamped, clamped, 0.5)["max_logprob_diff"] == float("inf")
    # nothing compared: nothing agreed (it was 1.0)
    assert compare_outputs(["a"], [out([])], [out([])], 0.5)["agreement"] == 0.0


def _rec(tmp_path, verdict="pass"):
    d = tmp_path / "merged"
    d.mkdir()
    man = MergedManifest(
        files={},
        base=MergedBase(path="/b"),
        adapter=MergedFrom(path="/a"),
        merge=MergeStats(dtype="bfloat16", lora_pairs=1, merged_modules=1),
    )
    write_manifest(d, man)
    side = {"engine_model": "m", "decode_tok_s": 90.5, "tpot_s": 0.011, "acceptance_length": 2.1}
    return {
        "time": "2026-12-01T00:00:00+00:00",
        "merged_dir": str(d),
        "base": {**side, "decode_tok_s": 160.0, "acceptance_length": 3.6},
        "hot": side,
        "merged": {**side, "decode_tok_s": 150.25, "acceptance_length": 3.4},
        "parity": {"verdict": verdict, "agreement": 0.98, "max_logprob_diff": 0.4, "reasons": []},
    }


def test_record_on_the_version_and_status(project, tmp_path):
    from mlflow import MlflowClient

    from pipeline.registry import mlflow_for
    from pipeline.release.status import collect

    mlflow_for(project)
    client = MlflowClient()
    client.create_registered_model("agent-tools")
    mv = client.create_model_version("agent-tools", source=str(tmp_path))
    rec = _rec(tmp_path)
    record(project, rec, {"name": "agent-tools", "version": mv.version})
    tags = client.get_model_version("agent-tools", mv.version).tags
    assert show(tags)["merged_tok_s"] == "150.2" and tags["merge.served.hot_acceptance_length"] == "2.1"
    man = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert man["served_parity"]["status"] == "pass" and man["served_parity"]["hot"]["decode_tok_s"] == 90.5
    m = collect(project, "agent-tools", fleet=False)["models"][0]["versions"][0]["merged"]
    assert m["verdict"] == "pass" and m["hot_tok_s"] == 90.5 and m["merged_tok_s"] == 150.2
    assert m["merged_acceptance_length"] == 3.4 and m["agreement"] == 0.98


def test_status_wide_shows_the_side_by_side(project, tmp_path):
    from pipeline.cli.render import STATUS_COLUMNS

    col = next(c for c in STATUS_COLUMNS if c.header == "MERGED")
    tags = served_tags(_rec(tmp_path, "fail"))
    from pipeline.release.status import _merged

    assert col.value({"merged": _merged(tags)}) == "fail:hot=90.5/2.1,merged=150.2/3.4"
    assert col.value({"merged": None}) == ""
