"""Read vLLM's Prometheus `/metrics` text into flat counters, with `prometheus_client`'s parser.

Names, the same in vLLM 0.25.1 (the H200 engine; read in the wheel's `vllm/v1/metrics/loggers.py` and
`vllm/v1/spec_decode/metrics.py` `SpecDecodingProm`) and 0.32 (verified on the CPU build,
scripts/FLEET_NOTES.md):
- speculative decoding (present only when the engine runs with `--speculative-config`):
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`, and per draft position (label `position`, 0 ..
  num_speculative_tokens - 1) `vllm:spec_decode_num_accepted_tokens_per_pos_total`;
- per-request time per output token, a histogram: `vllm:request_time_per_output_token_seconds_sum`
  and `..._count` (seconds, one observation per finished request);
- generated tokens: `vllm:generation_tokens_total`.
Every sample carries `engine` and `model_name` labels (the base's name, also for LoRA requests),
so figures for one adapter come from the difference of two scrapes around its own requests.
"""

from __future__ import annotations

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
TPOT_SUM = "vllm:request_time_per_output_token_seconds_sum"
TPOT_COUNT = "vllm:request_time_per_output_token_seconds_count"
GENERATION_TOKENS = "vllm:generation_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


def counters(text: str) -> dict[str, float]:
    """{sample name: value summed over label sets} for counters, gauges and histogram sums/counts.

    `_created` timestamps and histogram `_bucket` samples are left out. Raises ValueError when
    the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per sample name (names absent before count from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """{value of `label`: sample value summed over the other labels} for samples called `name`.

    E.g. `by_label(text, SPEC_ACCEPTED_PER_POS, "position")` -> {"0": 812.0, "1": 640.0, "2": 431.0}.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + float(s.value)
    return out


def info_label(text: str, name: str, label: str) -> str | None:
    """A label of an info gauge, e.g. `info_label(text, "vllm:cache_config_info", "block_size")` -> "1056"."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and label in s.labels:
                return s.labels[label]
    return None
