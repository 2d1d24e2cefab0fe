"""The loading modes behind one interface (`pipeline.fleet.modes`) and the client-side resolver."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.config import load_config
from pipeline.errors import UsageError
from pipeline.fleet.modes import ApiMode, ResolverMode, loading_mode, resolve_served_name
from pipeline.fleet.state import FleetState, save_state
from tests.support.helpers import write_project_config


def _cfg(tmp_path, **fleet):
    return load_config(write_project_config(tmp_path, served={"model": "/models/base"}, fleet=fleet))


@pytest.mark.parametrize(
    "fleet, cls, strategy, served",
    [
        ({"vllm_version": "0.19.2rc1.dev123+gabc"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.32.0"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.33.0"}, ApiMode, "repoint", "chat"),
        ({"vllm_version": "0.33.0", "swap_strategy": "versioned"}, ApiMode, "versioned", "chat-v3"),
        ({"vllm_version": "0.19.1", "loading_mode": "resolver"}, ResolverMode, None, "chat-v3"),
    ],
)
def test_mode_and_served_name_per_config(tmp_path, fleet, cls, strategy, served):
    cfg = _cfg(tmp_path, **fleet)
    mode = loading_mode(cfg)
    assert isinstance(mode, cls)
    assert getattr(getattr(mode, "plan", None), "strategy", None) == strategy
    assert mode.served_name("chat", 3) == served
    st = FleetState()
    st.set("chat", 3)
    save_state(cfg.volume.path, st)
    assert resolve_served_name(cfg, "chat") == served


def test_unsafe_repoint_is_refused_before_any_request(tmp_path):
    cfg = _cfg(tmp_path, vllm_version="0.19.2rc1.dev123+gabc", swap_strategy="repoint")
    with pytest.raises(UsageError, match="keyed by adapter name only"):
        loading_mode(cfg)


def test_fleet_resolve_cli(tmp_path, monkeypatch):
    from pipeline.cli import app

    cfg = _cfg(tmp_path, vllm_version="0.32.0")
    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat"])
    assert res.exit_code == 2 and "no desired version" in res.output
    st = FleetState()
    st.set("chat", 7)
    save_state(cfg.volume.path, st)
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat"])
    assert res.exit_code == 0 and res.output.strip() == "chat-v7"
    res = CliRunner().invoke(app, ["fleet", "resolve", "chat", "--json"])
    assert json.loads(res.output) == {"adapter": "chat", "model": "chat-v7"}


class _Replies:
    """Stands in for InstanceClient with the replies vLLM 0.25.1 gave on the H200 (a random 8-layer base whose
    greedy replies stop at once): the CPU engine's tiny base cannot be made to produce them. The request the
    canary sends is checked against the real engine in tests/fleet/test_fleet_vllm.py."""

    name = "fleet-a"

    def __init__(self, by_model: dict[str, tuple[list[str], list[float]]]):
        self.by_model = by_model

    def completion(self, model, prompt, max_tokens, **params):
        assert params == {"ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        tokens, lps = self.by_model[model]
        return {"choices": [{"text": "", "logprobs": {"tokens": tokens, "token_logprobs": lps}}]}


def test_the_publish_canary_compares_tokens_and_logprobs_not_text(tmp_path):
    """Both texts were '' on the H200, so publish refused a good adapter as having no effect on both
    instances. Same tokens with log-probabilities moved by a trained adapter: an effect; the same tokens
    and log-probabilities: none; other tokens: an effect."""
    from pipeline.fleet.client import InstanceError
    from pipeline.fleet.modes import NO_EFFECT_NATS, canary

    cfg = _cfg(tmp_path, vllm_version="0.25.1")
    base = cfg.served_base_name
    eos = ["token_id:248046"] * 8
    canary(_Replies({base: (eos, [-0.1] * 8), "good": (eos, [-0.1] * 7 + [-0.9])}), cfg, "good")
    canary(_Replies({base: (eos, [-0.1] * 8), "other": (["token_id:7"] + eos[1:], [-0.1] * 8)}), cfg, "other")
    same = [-0.1] * 7 + [-0.1 - NO_EFFECT_NATS / 2]
    with pytest.raises(InstanceError, match="no effect") as e:
        canary(_Replies({base: (eos, [-0.1] * 8), "zero": (eos, same)}), cfg, "zero")
    assert e.value.check == "fleet.canary_no_effect" and "token_id:248046" in str(e.value)


@pytest.mark.parametrize(
    "reply",
    [
        (["token_id:7"] * 8, [float("nan")] * 8),  # NaN compared as 'moved': a NaN-emitting engine passed
        (["token_id:7"] * 8, [-0.1] * 7 + [float("inf")]),
        (["token_id:7"] * 8, [-0.1] * 7 + [None]),
        ([], []),  # a reply without logprobs
    ],
)
def test_the_publish_canary_refuses_replies_it_cannot_judge(tmp_path, reply):
    """No evidence is no effect: a reply whose log-probabilities are missing or not finite fails the canary,
    on the base's side or the adapter's."""
    from pipeline.fleet.client import InstanceError
    from pipeline.fleet.modes import canary

    cfg = _cfg(tmp_path, vllm_version="0.25.1")
    base, good = cfg.served_base_name, (["token_id:7"] * 8, [-0.1] * 8)
    for replies in ({base: good, "a": reply}, {base: reply, "a": good}):
        with pytest.raises(InstanceError, match="cannot be judged") as e:
            canary(_Replies(replies), cfg, "a")
        assert e.value.check == "fleet.canary_no_effect"
