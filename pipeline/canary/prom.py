"""Read vLLM's Prometheus `/metrics` text into flat counters, with `prometheus_client`'s parser.

vLLM 0.32 names (verified on the CPU build, scripts/FLEET_NOTES.md and vllm/v1/metrics/loggers.py):
- speculative decoding (present only when the engine runs with `--speculative-config`):
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`;
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
