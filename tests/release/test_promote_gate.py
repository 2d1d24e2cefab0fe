"""Issue 27.8: a candidate `pipeline run` gated is not shipped by promote/publish without --force, and the
override is recorded on the version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.validate.test_normalise import _project, _register


def test_promote_of_a_gated_candidate_needs_force_and_is_recorded(tmp_path, monkeypatch, tiny_base):
    from pipeline import registry
    from pipeline.errors import CheckFailed
    from pipeline.release.publish import publish

    cfg = _project(tmp_path, monkeypatch, None)
    _, reg = _register(cfg, tiny_base, tmp_path, "gated")
    registry.record_gate(cfg, "gated", reg.version, "gated", "eval loss 6.89 > production 6.21 + 0.02")
    with pytest.raises(CheckFailed) as e:
        publish(cfg, "gated", version=reg.version)
    assert "gated (eval loss 6.89" in str(e.value) and "--force" in str(e.value)
    assert not list(Path(cfg.volume.path).glob("gated-v*"))
    assert registry.aliases(cfg, "gated").get(registry.ALIAS_PRODUCTION) is None

    pub = publish(cfg, "gated", version=reg.version, force=True)
    assert pub.gate_overridden and any("--force" in w for w in pub.warnings)
    mv = registry.resolve_version(cfg, "gated", reg.version)
    events = [e for e in registry.events(mv) if e.get("type") == "gate_override"]
    assert events and events[0]["reason"].startswith("eval loss 6.89") and events[0]["forced"] is True
