"""Canary on a staging vLLM instance: does the engine apply the adapter as training did, and how fast?

`run_canary` loads the adapter on the staging instance under a temporary unique name, sends a
fixed canary set (validation-split prompts plus templated tool-call conversations, rendered
with the chat template and sent as token ids), and unloads it whatever happens. For the base
and then for the adapter it measures:

- parity against a PEFT + transformers reference (`pipeline.canary.reference`): greedy tokens
  and top logprobs from `/v1/completions` (temperature 0, `logprobs`, token ids), teacher-forced
  through the reference. Token agreement: share of generated positions where the engine's token
  is the reference's argmax (or within `canary.tie_margin` nats of it); first divergence: the
  first position where greedy decoding by the reference would differ; max logprob diff: over
  all positions and the engine's top tokens, nats. The base's own figures tell an engine or
  precision gap (quantized base, bf16 kernels) from an adapter problem; when the served base is
  quantized, the base's gap sets the tolerance (`canary.base_gap_factor`).
- speed, from `/metrics` scraped before and after each pass (`pipeline.canary.prom`): speculative
  decoding drafts, draft tokens and accepted tokens -> acceptance rate (accepted / draft
  tokens) and mean acceptance length (1 + accepted / drafts, vLLM's own definition); time per
  output token (the engine's per-request histogram, seconds); adapter/base ratios. The MTP
  drafter ignores LoRA (docs/vllm.md), so an adapter that moves the output
  distribution lowers acceptance and speed; the seed fleet measured 161 tok/s without LoRA and
  ~90 with, acceptance length 3.64 (docs/field-report.md).

The staging instance must be otherwise idle: vLLM's metrics are per engine, not per adapter
(a pass whose generated-token counter moved more than its own requests is flagged).
`record` stores the result on the MLflow model version; `gate` is the check `publish` runs.
"""

from __future__ import annotations

from pipeline.canary.engine import canary_plan, canary_version, run_canary, served_info, staging_instance
from pipeline.canary.prompts import TOOL_CONVERSATIONS, TOOLS, Prompt, canary_set
from pipeline.canary.record import REPORT_TAG, TAG, gate, record, show, summary_tags
from pipeline.canary.result import CanaryError, CanaryResult, EngineOutput, Parity, Speed, compare, judge

__all__ = [
    "REPORT_TAG",
    "TAG",
    "TOOLS",
    "TOOL_CONVERSATIONS",
    "CanaryError",
    "CanaryResult",
    "EngineOutput",
    "Parity",
    "Prompt",
    "Speed",
    "canary_set",
    "canary_plan",
    "canary_version",
    "compare",
    "gate",
    "judge",
    "record",
    "run_canary",
    "served_info",
    "show",
    "staging_instance",
    "summary_tags",
]
