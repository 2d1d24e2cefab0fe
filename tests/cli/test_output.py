"""What the read commands print: facts of the adapter asked about only (issue 27 item 2), and plain
lines a pipe can use: `-o table|wide|json|tsv|name`, `--no-headers` (issue 27 item 3)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.release.publish import publish
from pipeline.release.transaction import Intent, save_intent
from tests.support import release_support
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters
LONG = "agent-tools-with-a-rather-long-descriptive-name"  # 47 characters: rich wrapped it at 80 columns


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, release_adapters):
    """`make demo` then `register --name b`: agent-tools v1 published, v2 candidate; b v1 candidate; a
    third model with a long name in production."""
    cfg = new_project(tmp_path_factory.mktemp("output"))
    register_versions(cfg, "agent-tools", release_adapters, 2)
    publish(cfg, "agent-tools", version=1)
    register_versions(cfg, "b", release_adapters, 1)
    register_versions(cfg, LONG, release_adapters, 1)
    publish(cfg, LONG, version=1)
    return cfg


def cli(cfg, *args, columns: int = 80):
    return CliRunner().invoke(
        app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source), "COLUMNS": str(columns)}
    )


def test_status_of_one_model_reports_no_drift_of_another(cfg):
    """Item 2: `pipeline status b` said agent-tools has no `production` alias (the unfiltered view did not)."""
    r = cli(cfg, "status", "b", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["volume"] == []
    r = cli(cfg, "status", "b")
    assert r.exit_code == 0 and "agent-tools" not in r.output and "drift" not in r.output, r.output
    r = cli(cfg, "status", "--json")
    assert json.loads(r.stdout)["volume"] == []


def test_status_of_one_model_shows_its_own_drift_and_transactions_only(cfg):
    """Siblings: the filter still shows the asked adapter's drift, and another's unfinished transaction
    stays out of it (and in the unfiltered view)."""
    from pipeline import registry

    registry.set_alias(cfg, "b", "production", 1)  # moved in the UI, no follower: real drift for b
    save_intent(
        cfg.volume.path,
        Intent("publish", "agent-tools", 2, 1, 1, None, {"version": 1}, "models:/x", phase="prepared"),
    )
    try:
        vol = json.loads(cli(cfg, "status", "b", "--json").stdout)["volume"]
        assert [(v["adapter"], v["state"]) for v in vol] == [("b", "drift")]
        assert "`production` is v1 but fleet-state.json has no entry" in vol[0]["detail"]
        vol = json.loads(cli(cfg, "status", LONG, "--json").stdout)["volume"]
        assert vol == []
        vol = json.loads(cli(cfg, "status", "--json").stdout)["volume"]
        assert sorted(v["adapter"] for v in vol) == ["agent-tools", "b"]
    finally:
        (cfg.volume.path / ".txn" / "agent-tools.json").unlink()
        registry.client(cfg).delete_registered_model_alias("b", "production")


def test_status_table_is_one_line_per_version_at_80_columns(cfg):
    """Item 3: rich boxes wrapped one version over 9 lines, so `status | grep -c production` printed 0."""
    r = cli(cfg, "status", columns=80)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["MODEL", "VERSION", "ALIASES", "VALIDATION"]
    assert len(lines) == 1 + 4  # header + four versions
    assert sum("production" in ln for ln in lines) == 2  # `grep -c production`
    rows = [ln.split() for ln in lines[1:]]
    assert {(row[0], row[1]) for row in rows} == {
        ("agent-tools", "2"),
        ("agent-tools", "1"),
        ("b", "1"),
        (LONG, "1"),
    }
    assert all(len(row) == len(lines[0].split()) for row in rows)  # `awk '{print $N}'` finds each column
    assert not any(c in r.stdout for c in "│┃━─╇")  # no box drawing
    assert "\x1b[" not in r.stdout  # no colour into a pipe
    r = cli(cfg, "status", "--no-headers")
    assert len(r.stdout.splitlines()) == 4 and "MODEL" not in r.stdout


def test_status_output_formats(cfg):
    r = cli(cfg, "status", "-o", "name")
    assert r.stdout.split() == [
        f"models:/{LONG}/1",
        "models:/agent-tools/2",
        "models:/agent-tools/1",
        "models:/b/1",
    ] or sorted(r.stdout.split()) == sorted(
        [f"models:/{LONG}/1", "models:/agent-tools/2", "models:/agent-tools/1", "models:/b/1"]
    )
    r = cli(cfg, "status", "agent-tools", "-o", "tsv")
    header, *rows = [ln.split("\t") for ln in r.stdout.splitlines()]
    assert header[:2] == ["MODEL", "VERSION"] and header[-1] == "GATE_REASON" and "RUN_ID" in header
    assert all(len(row) == len(header) for row in rows) and len(rows) == 2
    v1 = dict(zip(header, rows[1], strict=True))
    assert v1["ALIASES"] == "production" and v1["PUBLISHED"].endswith("agent-tools-v1") and v1["GATE"] == ""
    wide = cli(cfg, "status", "agent-tools", "-o", "wide").stdout.splitlines()
    table = cli(cfg, "status", "agent-tools").stdout.splitlines()
    assert len(wide) == len(table) == 3 and len(wide[0].split()) > len(table[0].split())
    assert json.loads(cli(cfg, "status", "-o", "json").stdout) == json.loads(
        cli(cfg, "status", "--json").stdout
    )
    r = cli(cfg, "status", "-o", "yaml")
    assert r.exit_code == 2
    r = cli(cfg, "status", "--json", "-o", "tsv")
    assert r.exit_code == 2 and "two formats" in r.output


def test_fleet_status_and_validate_print_plain_rows_too(cfg, release_adapters, tiny_base):
    """Siblings of item 3: `fleet status` and `validate` drew rich boxes as well."""
    from pipeline import registry

    registry.set_alias(cfg, "b", "production", 1)
    try:
        r = cli(cfg, "fleet", "status")
        assert r.exit_code == 4, r.output
        lines = r.stdout.splitlines()
        assert lines[0].split() == ["INSTANCE", "VLLM", "ADAPTER", "DESIRED", "SERVING", "STATE", "DETAIL"]
        assert [ln.split()[:6] for ln in lines[1:]] == [["-", "-", "b", "-", "production=v1", "drift"]]
        r = cli(cfg, "fleet", "status", "-o", "tsv", "--no-headers")
        (row,) = [ln.split("\t") for ln in r.stdout.splitlines()]
        assert row[2] == "b" and row[5] == "drift" and "fleet-state.json has no entry" in row[6]
        assert cli(cfg, "fleet", "status", "-o", "name").stdout.split() == ["-/b"]
    finally:
        registry.client(cfg).delete_registered_model_alias("b", "production")
    adapter = release_adapters[0][0]
    r = cli(cfg, "validate", adapter, "--base", tiny_base, "-o", "tsv")
    assert r.exit_code == 0, r.output
    header, *rows = [ln.split("\t") for ln in r.stdout.splitlines()]
    assert header == ["CHECK", "SEVERITY", "N", "WHERE", "MESSAGE"] and all(len(x) == 5 for x in rows)
    r = cli(cfg, "validate", adapter, "--base", tiny_base)
    assert r.stdout.splitlines()[-1].startswith("verdict: pass") and "┃" not in r.stdout


def test_canary_prints_one_plain_line_per_run(capsys):
    """Sibling of item 3: the canary's rich table (7 columns) wrapped at 80 columns too."""
    from pipeline.cli.canary import render
    from pipeline.cli.render import Output
    from tests.canary.test_canary_units import _result

    res = _result(1.0, 0.0, 0.98, 0.1, quantized=False)
    render(res)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["RUN", "TOKEN_AGREEMENT"]
    assert [ln.split()[0] for ln in lines[1:3]] == ["base", "adapter"]
    assert all(len(ln.split()) == 7 for ln in lines[:3]) and lines[-1].startswith("verdict: ")
    render(res, Output.tsv, no_headers=True)
    rows = [ln.split("\t") for ln in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["base", "adapter"] and rows[1][1].startswith("0.980")


def test_published_is_relative_in_the_table_and_absolute_only_in_wide(cfg, monkeypatch):
    """Issue 41.8: PUBLISHED printed `/tmp/.../adapters/volume/agent-tools-v1`, so a row wrapped at 80
    columns. The table shows it relative (to the working directory when the volume is below it, else to
    the volume); `-o wide`, tsv and JSON keep the absolute path."""
    absolute = str(cfg.volume.path / "agent-tools-v1")
    r = cli(cfg, "status", "agent-tools")
    header, _, v1 = (ln.split() for ln in r.stdout.splitlines())
    assert dict(zip(header, v1, strict=True))["PUBLISHED"] == "agent-tools-v1"
    assert absolute not in r.stdout
    monkeypatch.chdir(cfg.root)  # the README's first day: commands run in the project
    r = cli(cfg, "status", "agent-tools")
    header, _, v1 = (ln.split() for ln in r.stdout.splitlines())
    assert dict(zip(header, v1, strict=True))["PUBLISHED"] == str(
        cfg.volume.path.relative_to(cfg.root) / "agent-tools-v1"
    )
    wide = cli(cfg, "status", "agent-tools", "-o", "wide").stdout.splitlines()
    header, _, v1 = (ln.split() for ln in wide)
    assert dict(zip(header, v1, strict=True))["PUBLISHED_PATH"] == absolute
    doc = json.loads(cli(cfg, "status", "agent-tools", "--json").stdout)
    assert doc["models"][0]["versions"][1]["published_path"] == absolute


def test_fleet_status_takes_a_name(cfg):
    """Issue 41.8: `fleet status NAME` was refused ("Got unexpected extra argument"), while `status NAME`
    takes one. The rows are NAME's (and the instances' own), and so is the exit code."""
    from pipeline import registry

    registry.set_alias(cfg, "b", "production", 1)  # b drifts: production set, no desired state
    try:
        r = cli(cfg, "fleet", "status", "b")
        assert r.exit_code == 4 and [ln.split()[2] for ln in r.stdout.splitlines()[1:]] == ["b"], r.output
        r = cli(cfg, "fleet", "status", "agent-tools")
        assert r.exit_code == 0 and r.stdout == "", r.output  # another adapter's drift is not its own
        assert cli(cfg, "fleet", "status", "Bad_Name").exit_code == 2
    finally:
        registry.client(cfg).delete_registered_model_alias("b", "production")
