"""Canary pieces that need no server: /metrics parsing, the parity arithmetic, the rank fix-up, the verdict."""

from __future__ import annotations

import json

import pytest

# Shape of vLLM 0.32's exposition (names and labels as the CPU build prints them, FLEET_NOTES.md).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 21.0
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.01",model_name="/m"} 2.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="/m"} 4.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="/m"} 4.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="/m"} 0.04
"""


def test_prometheus_counters_and_delta():
    from pipeline.canary import prom

    before = prom.counters(METRICS)
    assert before[prom.SPEC_DRAFTS] == 10 and before[prom.SPEC_ACCEPTED] == 21
    assert before[prom.TPOT_COUNT] == 4 and before[prom.TPOT_SUM] == pytest.approx(0.04)
    assert not any(k.endswith(("_created", "_bucket")) for k in before)
    after = prom.counters(METRICS.replace("} 10.0", "} 14.0").replace("} 21.0", "} 30.0"))
    d = prom.delta(before, after)
    assert d[prom.SPEC_DRAFTS] == 4 and d[prom.SPEC_ACCEPTED] == 9  # mean acceptance length 1 + 9/4
    with pytest.raises(ValueError):
        prom.counters("not { prometheus")


def test_compare_counts_ties_and_first_divergence():
    from pipeline.canary import EngineOutput, Prompt, compare
    from pipeline.canary.reference import PositionScore

    prompts = [Prompt("a", [1, 2]), Prompt("b", [3])]
    outs = [EngineOutput([5, 6, 7], [{5: -1.0}, {6: -2.0}, {7: -1.0}]), EngineOutput([8], [{8: -0.5}])]
    scores = [
        [
            PositionScore(5, -1.0, {5: -1.0}),
            PositionScore(9, -1.995, {6: -2.0, 9: -1.995}),
            PositionScore(4, -0.2, {7: -1.2, 4: -0.2}),
        ],
        [PositionScore(8, -0.75, {8: -0.75})],
    ]
    p = compare(prompts, outs, scores, tie_margin=0.01)
    assert (p.positions, p.exact, p.tied) == (4, 2, 1)  # position 1 of "a" is a near tie, position 2 is not
    assert p.agreement == 0.75 and p.first_divergence == 1 and p.first_divergence_prompt == "a"
    assert p.diverged_prompts == 1
    assert p.max_logprob_diff == pytest.approx(0.25) and p.max_logprob_diff_at == "b@0"


def test_reference_uses_the_tensors_rank(tmp_path, tiny_base):
    from pipeline.canary.reference import rank_mismatches, trained_rank_copy
    from tests.support.helpers import peft_adapter

    d = peft_adapter(tiny_base, tmp_path / "a", r=8, alpha=16, targets=["q_proj", "v_proj"])
    assert rank_mismatches(d) == [] and trained_rank_copy(d, tmp_path)[0] == d
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    bad = rank_mismatches(d)
    assert bad and all(declared == 4 and rank == 8 for _, declared, rank in bad)
    fixed, notes = trained_rank_copy(d, tmp_path / "work")
    assert json.loads((fixed / "adapter_config.json").read_text())["r"] == 8 and fixed != d
    assert "declares r=4 but the tensors have rank 8" in notes[0]
    assert json.loads((d / "adapter_config.json").read_text())["r"] == 4  # the original is untouched


def _result(base_agree: float, base_diff: float, ad_agree: float, ad_diff: float, quantized: bool):
    from pipeline.canary import CanaryResult, Parity, Speed

    def par(a, d):
        return Parity(100, a, int(a * 100), 0, None if a == 1 else 3, "p", 1, d, "p@3")

    sp = Speed(8, 100, None, None, None, None, None, 0.01, 0.02, False)
    return CanaryResult(
        "a",
        "http://s",
        "canary-x",
        {"quantized": quantized, "engine_model": "m"},
        ["p"],
        12,
        {"base": par(base_agree, base_diff), "adapter": par(ad_agree, ad_diff)},
        {"base": sp, "adapter": sp},
        1.0,
        None,
        {},
        False,
        [],
        [],
        None,
        "t",
        0.0,
    )


@pytest.mark.parametrize(
    "figures, quantized, verdict, words",
    [
        ((1.0, 0.0, 0.99, 0.05), False, "pass", None),
        ((1.0, 0.0, 0.80, 0.05), False, "fail", ("canary.adapter_parity", "adapter parity failed")),
        ((0.90, 0.3, 0.90, 0.3), False, "fail", ("canary.base_gap", "engine/precision gap on the BASE")),
        # a quantized base: its own gap (agreement 0.90, diff 0.3 nats) sets the tolerance
        ((0.90, 0.3, 0.88, 0.5), True, "pass", None),
        ((0.90, 0.3, 0.70, 0.5), True, "fail", ("canary.adapter_parity", "adapter parity failed")),
    ],
)
def test_verdict_tolerance_from_the_base(figures, quantized, verdict, words):
    from pipeline.canary import judge
    from pipeline.config import ProjectConfig

    res = _result(*figures, quantized)
    judge(ProjectConfig(), res, [], [])
    assert res.verdict == verdict, res.problems
    if words:
        check_id, text = words
        assert res.findings[0].id == check_id and text in res.problems[0]
    if quantized:
        assert res.tolerance["max_logprob_diff"] == pytest.approx(0.6)


@pytest.mark.parametrize("url", ["not a url", "127.0.0.1:8000", "http://127.0.0.1:99999", "ftp://h/"])
def test_staging_url_is_checked_before_any_request(url, tmp_path):
    """New-user finding: `--staging "not a url"` waited ~12 s for connection errors, then exit 4."""
    from pipeline.canary.engine import staging_instance
    from pipeline.config import load_config
    from pipeline.errors import UsageError
    from tests.support.helpers import write_project_config

    cfg = load_config(write_project_config(tmp_path))
    with pytest.raises(UsageError, match="--staging: .*(http|range)"):
        staging_instance(cfg, url)
    assert staging_instance(cfg, "http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"
