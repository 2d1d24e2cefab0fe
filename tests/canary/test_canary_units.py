"""Canary pieces that need no server: /metrics parsing, the parity arithmetic, the rank fix-up, the verdict."""

from __future__ import annotations

import json

import pytest

from pipeline.canary import judge
from pipeline.canary.effect import Effect

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
        # the H200's NVFP4 random base (2026-12-02): agreement 0.023 widened the floor to -0.027, so any
        # adapter passed on agreement; a base this far from the reference is no test of the adapter
        ((0.023, 0.3, 0.90, 0.5), True, "fail", ("canary.base_gap", "quantized base alone agrees")),
    ],
)
def test_verdict_tolerance_from_the_base(figures, quantized, verdict, words):
    from pipeline.canary import judge
    from pipeline.config import ProjectConfig

    res = _result(*figures, quantized)
    judge(ProjectConfig().canary, res, [], [])
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
        staging_instance(cfg.canary, url)
    assert staging_instance(cfg.canary, "http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"


PER_POS = """\
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="2"} 5.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="1056",cache_dtype="fp8",engine="0"} 1.0
"""


def test_per_position_acceptance_and_info_labels():
    """vLLM 0.25.1's SpecDecodingProm counts accepted tokens per draft position (label `position`)."""
    from pipeline.canary import prom

    text = METRICS + PER_POS
    assert prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position") == {"0": 9.0, "1": 7.0, "2": 5.0}
    assert prom.counters(text)[prom.SPEC_ACCEPTED_PER_POS] == 21.0  # the flat sum equals the total accepted
    assert prom.info_label(text, "vllm:cache_config_info", "block_size") == "1056"
    assert prom.info_label(METRICS, "vllm:cache_config_info", "block_size") is None


def test_effect_retention_correlation_and_gaps():
    from pipeline.canary.effect import measure

    ref_base = [[-5.0, -6.0, -4.0], [-7.0]]
    ref_ad = [[-1.0, -2.0, -3.0], [-1.0]]  # shifts 4, 4, 1 | 6
    eng_base = [[-5.5, -6.5, -4.5], [-7.5]]  # the served base is 0.5 nats/token off
    eng_ad = [[-3.5, -4.5, -4.0], [-4.5]]  # shifts 2, 2, 0.5 | 3: half of the reference's
    e = measure(eng_ad, eng_base, ref_ad, ref_base)
    assert (
        e.positions == 4
        and e.reference_nats == pytest.approx(15 / 4)
        and e.engine_nats == pytest.approx(7.5 / 4)
    )
    assert e.retention == pytest.approx(0.5) and e.correlation == pytest.approx(1.0)
    assert e.base_gap_nats == pytest.approx(0.5) and e.adapter_gap_nats == pytest.approx(
        (2.5 + 2.5 + 1 + 3.5) / 4
    )
    # vLLM's clamped -inf (-9999) and missing values drop the position; no effect -> no retention
    e = measure([[-9999.0, -1.0]], [[-1.0, -1.0]], [[-1.0, float("nan")]], [[-1.0, -1.0]])
    assert e is None
    e = measure([[-1.0, -2.0]], [[-1.0, -2.0]], [[-1.0, -2.01]], [[-1.0, -2.0]])
    assert e.retention is None and e.reference_nats == pytest.approx(-0.005)
    with pytest.raises(ValueError, match="different lengths"):
        measure([[-1.0]], [[-1.0, -2.0]], [[-1.0]], [[-1.0]])


@pytest.mark.parametrize(
    "retention, floor, verdict", [(0.9, 0.8, "pass"), (0.5, 0.8, "fail"), (0.5, None, "pass")]
)
def test_effect_floor(retention, floor, verdict):
    from pipeline.canary import judge
    from pipeline.canary.effect import Effect
    from pipeline.config import ProjectConfig

    res = _result(1.0, 0.0, 1.0, 0.0, True)
    res.effect = Effect(40, 2.0, 2.0 * retention, retention, 0.9, 0.3, 0.4)
    cfg = ProjectConfig()
    cfg.canary.min_effect_retention = floor
    judge(cfg.canary, res, [], [])
    assert res.verdict == verdict, res.problems
    if verdict == "fail":
        assert res.findings[0].id == "canary.effect" and "retention 0.50" in res.problems[0]


def test_effect_and_positions_are_tagged():
    from pipeline.canary.effect import Effect
    from pipeline.canary.record import summary_tags

    res = _result(1.0, 0.0, 1.0, 0.0, True)
    res.speed["adapter"].acceptance_per_position = [0.9, 0.75, 0.5]
    res.effect = Effect(40, 2.0, 1.9, 0.95, 0.8, 0.3, 0.4)
    tags = summary_tags(res)
    assert tags["canary.acceptance_per_position"] == "0.9,0.75,0.5"
    assert tags["canary.effect_retention"] == "0.95" and tags["canary.reference_effect_nats"] == "2.0"


def test_quantized_is_what_the_staging_engine_serves(tmp_path):
    """A bf16 staging engine next to an NVFP4 fleet profile: the staging root decides (it was called
    quantized because served.path was read first, which widened the parity tolerance)."""
    from pipeline.canary.engine import _quantized
    from pipeline.config import ProjectConfig

    nvfp4, bf16 = tmp_path / "nvfp4", tmp_path / "bf16"
    for d in (nvfp4, bf16):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    (nvfp4 / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    cfg = ProjectConfig()
    cfg.served.path = nvfp4
    assert _quantized(cfg, str(bf16)) is False
    assert _quantized(cfg, str(nvfp4)) is True
    assert _quantized(cfg, "Qwen/Qwen3.6-27B-NVFP4") is True  # not readable here: the fleet profile's
    cfg.canary.quantized = False
    assert _quantized(cfg, str(nvfp4)) is False


def test_compare_counts_a_non_finite_engine_logprob_as_unbounded():
    """Sibling of the NaN eval-loss gate: a NaN engine log-probability was skipped, so an engine returning
    NaN for every one had max_logprob_diff 0.0 and passed."""
    import math

    from pipeline.canary import EngineOutput, Prompt, compare
    from pipeline.canary.reference import PositionScore

    prompts = [Prompt("p", [1, 2])]
    scores = [[PositionScore(5, -1.0, {5: -1.0, 6: -2.0})]]
    nan = compare(prompts, [EngineOutput([5], [{5: math.nan, 6: -2.0}])], scores, 0.01)
    assert nan.max_logprob_diff == math.inf and nan.max_logprob_diff_at == "p@0"
    ok = compare(prompts, [EngineOutput([5], [{5: -1.01, 6: -2.0}])], scores, 0.01)
    assert ok.max_logprob_diff == pytest.approx(0.01)
    # no token compared: nothing agreed (it was 1.0)
    assert compare(prompts, [EngineOutput([], [])], [[]], 0.01).agreement == 0.0


def test_a_canary_without_compared_tokens_fails():
    from pipeline.config import ProjectConfig

    res = _result(1.0, 0.0, 1.0, 0.0, quantized=False)
    res.parity["adapter"].positions = 0
    judge(ProjectConfig().canary, res, [], [])
    assert res.verdict == "fail" and res.findings[0].id == "canary.adapter_parity"
    assert "generated no token to compare" in res.problems[0]
    # both passes empty: one finding each, not also a 'base gap' of agreement 0.000 or 'adapter is the base'
    res = _result(0.0, 0.0, 0.0, 0.0, quantized=False)
    res.parity["base"].positions = res.parity["adapter"].positions = 0
    res.engine_adapter_equals_base = True
    judge(ProjectConfig().canary, res, [], [])
    assert [f.id for f in res.findings] == ["canary.base_gap", "canary.adapter_parity"]


@pytest.mark.parametrize(
    "floor, unmeasured, check, words",
    [
        ("min_speed_ratio", lambda r: setattr(r, "speed_ratio", None), "canary.speed", "speed ratio"),
        ("min_speed_ratio", lambda r: setattr(r, "speed_ratio", float("nan")), "canary.speed", "speed ratio"),
        ("min_acceptance_ratio", lambda r: None, "canary.acceptance", "drafted nothing"),
        ("min_effect_retention", lambda r: None, "canary.effect", "teacher-forced scoring failed"),
        (
            "min_effect_retention",
            lambda r: setattr(r, "effect", Effect(4, 0.01, 0.0, None, None, 0.1, 0.1)),
            "canary.effect",
            "too small for a retention to be measured",
        ),
        (
            "min_effect_retention",
            lambda r: setattr(r, "effect", Effect(4, 2.0, 2.0, 1.0, 0.9, 0.1, 0.1, engine_unusable=3)),
            "canary.effect",
            "at 3 position(s)",
        ),
    ],
)
def test_a_floor_is_met_only_by_a_measurement(floor, unmeasured, check, words):
    """A floor the user set was skipped when the engine gave no figure (no TPOT histogram, no drafts, effect
    not scored): the canary passed on no evidence. Without the floor the same result passes."""
    from pipeline.config import ProjectConfig

    res = _result(1.0, 0.0, 1.0, 0.0, quantized=False)
    unmeasured(res)
    c = ProjectConfig().canary
    judge(c, res, [], [])
    assert res.verdict == "pass", res.problems
    res.findings = []
    setattr(c, floor, 0.5)
    judge(c, res, [], [])
    assert res.verdict == "fail" and [f.id for f in res.findings] == [check]
    assert words in res.problems[0] and f"canary.{floor} is 0.5" in res.problems[0]


def test_effect_counts_positions_the_engine_could_not_score():
    from pipeline.canary.effect import measure

    e = measure([[float("nan"), -1.0]], [[-1.0, -2.0]], [[-1.0, -1.0]], [[-2.0, -2.0]])
    assert e.positions == 1 and e.engine_unusable == 1
    # the reference's own non-finite value is no engine fault
    e = measure([[-1.0, -1.0]], [[-2.0, -2.0]], [[float("nan"), -1.0]], [[-2.0, -2.0]])
    assert e.positions == 1 and e.engine_unusable == 0


@pytest.mark.parametrize("quantized", [True, False])
def test_an_unbounded_base_gap_fails_instead_of_widening_the_tolerance(quantized):
    """A quantized base's gap sets the tolerance (factor x its max diff): one NaN on the base pass made that
    diff inf, the tolerance inf, and an adapter 50 nats off passed."""
    import math

    from pipeline.config import ProjectConfig

    res = _result(0.9, math.inf, 0.9, 50.0, quantized=quantized)
    judge(ProjectConfig().canary, res, [], [])
    assert res.verdict == "fail" and res.findings[0].id == "canary.base_gap"
    assert "the base gap is unbounded" in res.problems[0]


def test_compare_counts_a_reference_nan_and_the_engines_clamp_as_unbounded():
    import math

    from pipeline.canary import EngineOutput, Prompt, compare
    from pipeline.canary.reference import PositionScore

    prompts = [Prompt("p", [1, 2])]
    ref_nan = [[PositionScore(5, -1.0, {5: -1.0, 6: math.nan})]]
    assert (
        compare(prompts, [EngineOutput([5], [{5: -1.0, 6: -2.0}])], ref_nan, 0.01).max_logprob_diff
        == math.inf
    )
    ref = [[PositionScore(5, -1.0, {5: -1.0, 6: -2.0})]]
    clamp = compare(prompts, [EngineOutput([5], [{5: -1.0, 6: -9999.0}])], ref, 0.01)
    assert clamp.max_logprob_diff == math.inf


def test_a_reply_without_logprobs_is_a_canary_error():
    """An engine (or a proxy) that drops logprobs gave no token to compare; the canary passed on nothing."""
    from types import SimpleNamespace

    from pipeline.canary import Prompt
    from pipeline.canary.engine import _generate
    from pipeline.canary.result import CanaryError

    class Client:  # stands in for InstanceClient: the reply shape of vLLM's /v1/completions without logprobs
        instance = SimpleNamespace(url="http://staging")

        def completion(self, model, ids, max_tokens, **params):
            return {"choices": [{"text": "hi", "logprobs": None}], "usage": {"completion_tokens": 2}}

    with pytest.raises(CanaryError, match="carries no logprobs.*--max-logprobs >= 5"):
        _generate(Client(), "m", Prompt("p", [1, 2]), 2, 5)


def test_a_partial_effect_records_no_retention():
    from pipeline.canary.record import summary_tags

    res = _result(1.0, 0.0, 1.0, 0.0, True)
    res.effect = Effect(40, 2.0, 1.9, 0.95, 0.8, 0.3, 0.4, engine_unusable=2)
    tags = summary_tags(res)
    assert "canary.effect_retention" not in tags and tags["canary.effect_engine_unusable"] == "2"


def test_a_speed_just_below_its_floor_reads_below_it():
    """Sibling of issue 41.8: a speed ratio of 0.796 against canary.min_speed_ratio 0.8 failed with "decode
    speed with the adapter is 0.80x the base's ..., below canary.min_speed_ratio 0.8"."""
    from pipeline.config import ProjectConfig

    res = _result(1.0, 0.0, 1.0, 0.0, quantized=False)
    res.speed_ratio = 0.79612
    c = ProjectConfig().canary
    c.min_speed_ratio = 0.8
    judge(c, res, [], [])
    (msg,) = [f.message for f in res.findings if f.id == "canary.speed"]
    assert msg.startswith("decode speed with the adapter is 0.7961x the base's") and msg.endswith(
        "below canary.min_speed_ratio 0.8"
    ), msg
