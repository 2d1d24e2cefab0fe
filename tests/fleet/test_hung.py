"""Bounded waits and a consistent reported state when an instance accepts connections and never answers.

Fast: the hung peer is a TCP listener that never answers (tests/support/hung.py; what a stopped
process looks like to a client). The real thing, a vLLM instance stopped by SIGSTOP in the middle
of a rollout and resumed, is `test_hung_instance_mid_rollout_*` in test_fleet_vllm.py.
"""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from pipeline.config import Instance, load_config
from pipeline.errors import FleetError
from pipeline.fleet.client import Hung, InstanceClient, Timeouts, Unreachable
from pipeline.fleet.instances import InstanceReport, operator_hint
from pipeline.fleet.reconcile import status, sync
from pipeline.fleet.rollout import kept_versions, rollout
from pipeline.fleet.state import FleetState, load_state, save_state
from tests.support.fleet_server import free_port
from tests.support.helpers import write_project_config
from tests.support.hung import HungListener

FAST = {"timeout_s": 0.5, "connect_timeout_s": 0.5, "load_timeout_s": 0.7}


@pytest.fixture()
def hung():
    with HungListener() as h:
        yield h


def _cfg(tmp_path, instances, **fleet):
    return load_config(
        write_project_config(
            tmp_path,
            served={"model": "/models/base"},
            fleet={"instances": instances, "volume_mount": str(tmp_path / "volume"), **FAST, **fleet},
        )
    )


def test_every_request_is_bounded_and_hung_is_told_from_down(hung):
    inst = Instance(name="h", url=hung.url)
    with InstanceClient(inst, Timeouts(connect_s=0.5, read_s=0.4, load_s=0.6)) as c:
        t0 = time.monotonic()
        with pytest.raises(Hung, match="no answer within 0.4 s") as e:
            c.adapters()
        assert time.monotonic() - t0 < 5 and not e.value.outcome_unknown
        t0 = time.monotonic()
        with pytest.raises(Hung, match="no answer within 0.6 s.*may still take effect") as e:
            c.load("chat-v1", "/loras/chat-v1")  # the load timeout, not the read timeout
        assert e.value.outcome_unknown and time.monotonic() - t0 < 5
        with pytest.raises(Hung):
            c.unload("chat-v1")
        with pytest.raises(Hung):
            c.version()  # not swallowed as "no /version"
    down = Instance(name="d", url=f"http://127.0.0.1:{free_port()}")
    with InstanceClient(down, Timeouts(read_s=0.4)) as c:
        with pytest.raises(Unreachable) as e:
            c.adapters()
        assert not isinstance(e.value, Hung) and not e.value.outcome_unknown


def test_status_shows_hung_and_unreachable_apart(tmp_path, hung, monkeypatch):
    down = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(tmp_path, [{"name": "h", "url": hung.url}, {"name": "d", "url": down}])
    st = FleetState()
    st.set("chat", 1)
    st.mark_unknown("h", "publish of chat v2 was undone, but a change got no answer")
    save_state(cfg.volume.path, st)
    rows = status(cfg)
    assert [(r.instance, r.state) for r in rows] == [("h", "hung"), ("d", "unreachable")]
    assert "marked unknown since" in rows[0].detail and "chat v2" in rows[0].detail

    from pipeline.cli import app

    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["fleet", "status", "--json"])
    assert res.exit_code == 4, res.output
    states = [(r["instance"], r["state"]) for r in json.loads(res.output)]
    assert states[:2] == [("h", "hung"), ("d", "unreachable")]
    # the volume rows (instance `-`): desired chat v1 without a registry entry or a directory
    assert {s for i, s in states[2:]} <= {"drift", "absent"} and all(i == "-" for i, _ in states[2:])


def test_publish_refused_before_any_change_when_an_instance_hangs(tmp_path, hung):
    """All-or-nothing (default): a hung instance at the preflight stops the rollout, nothing changed."""
    cfg = _cfg(tmp_path, [{"name": "h", "url": hung.url}])
    (cfg.volume.path / "chat-v1").mkdir(parents=True)
    t0 = time.monotonic()
    with pytest.raises(FleetError) as e:
        rollout(cfg, "chat", 1, cfg.volume.path / "chat-v1")
    msg = str(e.value)
    assert "nothing was changed" in msg and "h (http" in msg and "HUNG" in msg
    assert "pipeline fleet sync" in msg  # says what to run
    assert time.monotonic() - t0 < 10
    assert load_state(cfg.volume.path).adapters == {}  # desired state untouched


def test_sync_reports_hung_and_keeps_the_mark(tmp_path, hung, monkeypatch):
    cfg = _cfg(tmp_path, [{"name": "h", "url": hung.url}])
    st = FleetState()
    st.set("chat", 1)
    st.mark_unknown("h", "publish of chat v2 was undone ...")
    save_state(cfg.volume.path, st)
    reports = sync(cfg)
    assert not reports[0].ok and reports[0].hung
    assert "h" in load_state(cfg.volume.path).instances  # cleared only once verified

    from pipeline.cli import app

    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    res = CliRunner().invoke(app, ["fleet", "sync", "--json"])
    assert res.exit_code == 4
    out = json.loads(res.output)[0]
    assert out["outcome"] == "HUNG" and out["findings"][0]["id"] == "fleet.hung"


def test_min_healthy_cannot_be_met_by_a_hung_fleet(tmp_path, hung):
    with HungListener() as hung2:  # two instances, two servers (one URL twice is refused by the config)
        cfg = _cfg(
            tmp_path, [{"name": "h", "url": hung.url}, {"name": "h2", "url": hung2.url}], min_healthy=1
        )
        _rollout_fails_for_all(cfg)


def _rollout_fails_for_all(cfg):
    (cfg.volume.path / "chat-v1").mkdir(parents=True)
    with pytest.raises(FleetError, match=r"0 of 2 instance\(s\) answer, 1 must"):
        rollout(cfg, "chat", 1, cfg.volume.path / "chat-v1")


def test_min_healthy_must_be_positive(tmp_path):
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="min_healthy"):
        _cfg(tmp_path, [], min_healthy=0)


def test_state_marks_round_trip_and_old_files_still_load(tmp_path):
    st = FleetState()
    st.set("chat", 3)
    st.mark_unknown("b", "why")
    save_state(tmp_path, st)
    back = load_state(tmp_path)
    assert back.instances["b"]["state"] == "unknown" and back.instances["b"]["reason"] == "why"
    assert back.clear_mark("b") and not back.clear_mark("b")
    save_state(tmp_path, back)
    assert "instances" not in json.loads(
        (tmp_path / "fleet-state.json").read_text()
    )  # schema-1 files as before


def test_kept_versions_follow_the_desired_history():
    st = FleetState()
    for v in (1, 2, 5, 3):  # v4 was never desired (an undone publish): never kept
        st.set("chat", v)
    assert kept_versions(st, "chat", 1) == {3}
    assert kept_versions(st, "chat", 2) == {3, 5}
    assert kept_versions(st, "chat", 3) == {2, 3, 5}
    assert kept_versions(st, "other", 2) == set()


def test_report_outcomes_and_hint():
    hung = InstanceReport("b", "http://b")
    hung.error("fleet.hung", "no answer")
    hung.unknown = True
    ok = InstanceReport("a", "http://a", ok=True)
    refused = InstanceReport("c", "http://c")
    refused.error("fleet.request_failed", "HTTP 500")
    assert hung.outcome == "HUNG (serving unknown)" and not hung.answered
    assert ok.outcome == "ok" and refused.answered and refused.outcome == "FAILED"
    assert "b" in operator_hint([ok, hung, refused]) and "fleet sync" in operator_hint([hung])
    assert operator_hint([ok]) == ""


def test_error_messages_keep_their_brackets(capsys):
    """Bug: `err()` printed messages as rich markup, so `[fleet.hung]` and `[vLLM 0.32.0]` in a fleet
    report vanished from the terminal (seen in the SIGSTOP test's publish output)."""
    from pipeline.cli._common import err

    err("b: HUNG [vLLM 0.32.0]\n    error: no answer [fleet.hung] [/tmp/x] [bold]")
    out = capsys.readouterr().err
    assert "[vLLM 0.32.0]" in out and "[fleet.hung]" in out and "[/tmp/x]" in out and "[bold]" in out


def test_status_table_shows_details_with_brackets(tmp_path, hung, monkeypatch):
    from pipeline.cli import app

    cfg = _cfg(tmp_path, [{"name": "h", "url": hung.url}])
    st = FleetState()
    st.mark_unknown("h", "publish of chat v2: no answer [fleet.hung]")
    save_state(cfg.volume.path, st)
    monkeypatch.setenv("PIPELINE_CONFIG", str(cfg.source))
    monkeypatch.setenv("COLUMNS", "400")
    res = CliRunner().invoke(app, ["fleet", "status"])
    assert res.exit_code == 4 and "[fleet.hung]" in res.output, res.output
