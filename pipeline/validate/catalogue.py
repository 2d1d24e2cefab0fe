"""The one catalogue of finding ids: the validation rules (`pipeline.validate.rules.RULES`) and, declared here
next to them, the ids other commands report (`dataset check`, fleet operations, the canary).

Every id a finding can carry is in `catalogue()` with its severity and doc line: `--allow` (validate,
train) accepts any of them, `docs/validation.md`'s tables are generated from it
(`python -m pipeline.validate.docs`), and `tests/validate/test_catalogue.py` fails on an id the code
reports that is not declared, or a declaration nothing reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.validate.rules import RULES


@dataclass(frozen=True)
class Entry:
    """One finding id: default severity, when it fires (one line), and what reports it."""

    id: str
    severity: str
    doc: str
    reported_by: str
    severity_doc: str | None = None

    @property
    def area(self) -> str:
        return self.id.split(".")[0]


_DATASET = "pipeline dataset check, train, run"
_FLEET = "publish, promote, rollback, sync, prune, status (per instance)"
_CANARY = "pipeline canary, publish (a recorded canary)"
DECLARED: tuple[Entry, ...] = (
    # pipeline.train.dataset (where = file:line)
    Entry(
        "dataset.schema",
        "error",
        "a conversation that is no list of well-formed messages (roles, content, order)",
        _DATASET,
    ),
    Entry("dataset.json", "error", "a line that is not JSON", _DATASET),
    Entry("dataset.encoding", "error", "a file that is not UTF-8", _DATASET),
    Entry("dataset.empty", "error", "a dataset file without conversations", _DATASET),
    Entry(
        "dataset.tool_call",
        "error",
        "a malformed tool call (not an object, no function.name, arguments not JSON)",
        _DATASET,
    ),
    Entry(
        "dataset.no_trainable_turn",
        "error",
        "a conversation with no assistant turn axolotl would train on",
        _DATASET,
    ),
    Entry(
        "dataset.message_key",
        "error",
        "a message key holding reasoning (`thinking`, `reasoning`...) that axolotl's reader drops (not mapped, "
        "not read by the template)",
        _DATASET,
    ),
    Entry(
        "dataset.eos",
        "error",
        "the tokenizer's eos_token is not the token that ends an assistant turn in the chat template (the adapter "
        "never learns to stop)",
        _DATASET,
    ),
    Entry("dataset.duplicate", "warning", "an exact duplicate conversation", _DATASET),
    Entry(
        "dataset.overlap",
        "error",
        "a validation conversation that is also in the training data (leaks into eval)",
        _DATASET,
    ),
    Entry(
        "dataset.dropped",
        "error",
        "axolotl's own tokenisation and filters would keep no conversation, or drop more than "
        "`train.max_dropped_share` of the conversations or trainable tokens (pipeline.train.gate)",
        "pipeline train, run",
    ),
    Entry(
        "dataset.too_long",
        "warning",
        "conversations longer than `sequence_len` tokens (axolotl drops them)",
        _DATASET,
    ),
    # pipeline.fleet (where = the instance)
    Entry("fleet.unreachable", "error", "connection refused or lost, connect timeout", _FLEET),
    Entry("fleet.hung", "error", "accepted the connection, no answer within the timeout", _FLEET),
    Entry("fleet.request_failed", "error", "an HTTP error status (load refused, unknown name ...)", _FLEET),
    Entry(
        "fleet.root_mismatch", "error", "after a load, `/v1/models` lists another path for the name", _FLEET
    ),
    Entry(
        "fleet.canary_no_effect",
        "error",
        "greedy output through the adapter equals the base's, or its log-probabilities are missing or not finite",
        _FLEET,
    ),
    Entry("fleet.version_mismatch", "error", "`GET /version` differs from `fleet.vllm_version`", _FLEET),
    Entry(
        "fleet.model_mismatch",
        "error",
        "the base card differs from `served.model` / `served.served_model_name`",
        _FLEET,
    ),
    Entry("fleet.volume_missing", "error", "a desired version's directory is not on the volume", _FLEET),
    Entry("fleet.restore_failed", "error", "undoing a failed rollout failed on this instance", _FLEET),
    Entry(
        "fleet.refused",
        "error",
        "the operation refused this instance (e.g. prune: still serves a version)",
        _FLEET,
    ),
    Entry("fleet.behind", "warning", "publish completed without this instance (`fleet.min_healthy`)", _FLEET),
    Entry("fleet.cleanup_failed", "warning", "unloading an old version name failed", _FLEET),
    Entry("fleet.swap", "warning", "the swap strategy in use and why", _FLEET, "info or warning"),
    # pipeline.canary.result (a staging vLLM against the PEFT reference)
    Entry(
        "canary.base_gap",
        "error",
        "the engine disagrees with the PEFT reference on the base alone (precision, dtype, version); for a "
        "quantized base, its agreement is below `canary.min_quantized_base_agreement`; or no base token was compared",
        _CANARY,
    ),
    Entry(
        "canary.adapter_is_base",
        "error",
        "the engine's greedy output with the adapter equals the base's",
        _CANARY,
    ),
    Entry(
        "canary.adapter_parity",
        "error",
        "token agreement or logprob difference with the PEFT reference beyond `canary` tolerances (a NaN or inf "
        "log-probability is beyond any), or no adapter token was compared",
        _CANARY,
    ),
    Entry(
        "canary.speed",
        "error",
        "decode speed with the adapter below `canary.min_speed_ratio` of the base's, or not measured while that is set",
        _CANARY,
    ),
    Entry(
        "canary.acceptance",
        "error",
        "MTP acceptance length with the adapter below `canary.min_acceptance_ratio` of the base's, or not measured "
        "while that is set",
        _CANARY,
    ),
    Entry(
        "canary.effect",
        "error",
        "the adapter's effect on the served base below `canary.min_effect_retention` of PEFT's, or not measured "
        "(or with non-finite engine log-probabilities) while that is set",
        _CANARY,
    ),
)


def catalogue() -> dict[str, Entry]:
    """Every finding id: the validation rules (registered when `pipeline.validate` is imported) and the declared
    ones."""
    out = {
        s.id: Entry(
            s.id,
            s.severity,
            s.doc,
            ", ".join({"adapter": "validate, register, publish", "train": "train, run"}[x] for x in s.scopes),
            s.severity_doc,
        )
        for s in RULES.values()
    }
    for e in DECLARED:
        assert e.id not in out, f"{e.id} declared twice"
        out[e.id] = e
    return out
