"""Every CLI command on hostile inputs: a clear error and an exit code, never a traceback (issue 16 "Tests").

`CASES` lists, per command of `pipeline.cli.COMMANDS` (and every subcommand of a group), argument
lists built from hostile inputs: names that are paths or too long, files that are missing, empty,
binary, directories, symlink loops or `/dev/null`, numbers out of range, a project config that is
not YAML, a desired-state file that is not JSON, and broken registry stores (a closed port, a file
store, a file that is not a database). `test_every_command_is_covered` fails when a command is
added without cases, so new commands join the harness.

Each case runs in-process through typer's CliRunner (the same `PipelineGroup` error mapping as the
console script). A case passes when the command exits with a documented code and neither stdout
nor stderr holds a traceback; `ok_codes` lists the codes allowed (0 where the hostile input is
legitimately harmless, e.g. `ui` against a tracking server only prints its URL).
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli import COMMANDS, app, load_command
from tests.support.helpers import REPO, write_project_config
from tests.support.registry_support import free_port

ERRORS = (1, 2, 3, 4, 5)
DEEP = "[" * 100_000
BIG = "9" * 5000


@dataclass
class Case:
    args: list[str]
    env: str = "project"  # key of the environments built by `world`
    ok_codes: tuple[int, ...] = ERRORS

    @property
    def id(self) -> str:
        text = " ".join(self.args)
        return f"{self.env}: {text[:70]}"


@dataclass
class World:
    root: Path
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)


def _hostile_files(root: Path) -> dict[str, Path]:
    p = {}
    p["missing"] = root / "no-such-thing"
    p["devnull"] = Path("/dev/null")
    p["empty"] = root / "empty.jsonl"
    p["empty"].write_text("")
    p["binary"] = root / "binary.bin"
    p["binary"].write_bytes(bytes(range(256)) * 64)
    loop = root / "loop"
    os.symlink(root / "loop2", loop)
    os.symlink(loop, root / "loop2")
    p["loop"] = loop
    p["dir"] = root / "a-directory"
    p["dir"].mkdir()
    bad = root / "bad-adapter"  # every file of an adapter, wrong
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": NaN, "lora_alpha": Infinity, "target_modules": 7}')
    (bad / "adapter_model.safetensors").mkdir()  # weights file that is a directory
    (bad / "manifest.json").write_text("[1, 2")
    p["bad-adapter"] = bad
    p["yaml"] = root / "broken.yml"
    p["yaml"].write_text("base_model: [unclosed\n  - : :\n")
    p["yaml-list"] = root / "list.yml"
    p["yaml-list"].write_text("- just\n- a list\n")
    p["out-exists"] = root / "out-exists"
    p["out-exists"].mkdir()
    # issue 30 kind 2: every file the pipeline parses, nested 100,000 levels deep
    deep = root / "deep-adapter"
    deep.mkdir()
    for f in ("manifest.json", "adapter_config.json", "tokenizer_config.json"):
        (deep / f).write_text(DEEP)
    raw = ('{"a":' + DEEP).encode()
    (deep / "adapter_model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    (deep / "chat_template.jinja").write_text("{% if a %}" * 5000 + "{{ " + "(" * 5000 + " }}")
    p["deep-adapter"] = deep
    p["deep-yaml"] = root / "deep.yml"
    p["deep-yaml"].write_text("base_model: x\nlora_r: " + "[" * 100_000 + "\n")
    p["deep-jsonl"] = root / "deep.jsonl"
    p["deep-jsonl"].write_text(DEEP + "\n")
    p["fifo"] = root / "fifo"  # a named pipe: opening it for reading blocked until a writer came
    os.mkfifo(p["fifo"])
    # numbers over Python's 4300-digit conversion limit (a bare ValueError), and JSON inside a string
    # that axolotl's dataset reader parses (its depth is not the line's)
    call = {"type": "function", "function": {"name": "f", "arguments": DEEP}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    p["deep-args-jsonl"] = root / "deep-args.jsonl"
    p["deep-args-jsonl"].write_text(json.dumps({"messages": msgs}) + "\n")
    p["bignum-jsonl"] = root / "bignum.jsonl"
    p["bignum-jsonl"].write_text('{"messages": [{"role": "user", "content": "hi", "n": ' + BIG + "}]}\n")
    big = root / "bignum-adapter"
    big.mkdir()
    (big / "adapter_config.json").write_text('{"r": ' + BIG + ', "lora_alpha": 16}')
    raw = ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + BIG + "]}}").encode()
    (big / "adapter_model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    (big / "manifest.json").write_text('{"schema": ' + BIG + "}")
    p["bignum-adapter"] = big
    p["bignum-yaml"] = root / "bignum.yml"
    p["bignum-yaml"].write_text(f"base_model: x\nlora_r: {BIG}\n")
    return p


def _mk(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("hostile")
    w = World(root, paths=_hostile_files(root))
    for d in ("proj", "broken-state", "not-db", "binary-state", "emptied", "foreign"):
        (root / d).mkdir()
    proj = write_project_config(root / "proj")
    broken_state = write_project_config(root / "broken-state")
    (root / "broken-state" / "volume").mkdir(parents=True)
    (root / "broken-state" / "volume" / "fleet-state.json").write_text("{not json")
    # duplicate instance names, a URL without scheme, min_healthy > instances
    bad_fleet = root / "bad-fleet.yaml"
    bad_fleet.write_text(
        "fleet: {min_healthy: 3, instances: [{name: a, url: '10.0.0.5:8000'}, {name: a, url: 'http://h:1'}]}\n"
    )
    bad_cfg = root / "bad-config.yaml"
    bad_cfg.write_text("fleet: {max_lora_rank: 7, instances: nope}\nunknown_key: 1\n")
    binary_state = write_project_config(root / "binary-state")
    (root / "binary-state" / "volume" / ".txn").mkdir(parents=True)
    (root / "binary-state" / "volume" / "fleet-state.json").write_bytes(b"\x80\xff" * 64)
    (root / "binary-state" / "volume" / ".txn" / "agent.json").write_bytes(b"\x80\xff" * 64)
    # issue 30: records on the volume nested 100,000 deep, and the volume's own entries as links out of it
    for d in ("deep-state", "link-state"):
        (root / d / "volume" / ".txn").mkdir(parents=True)
    deep_state = write_project_config(root / "deep-state")
    (root / "deep-state" / "volume" / "fleet-state.json").write_text(DEEP)
    (root / "deep-state" / "volume" / ".txn" / "agent.json").write_text(DEEP)
    link_state = write_project_config(root / "link-state")
    os.symlink("/etc/hostname", root / "link-state" / "volume" / "fleet-state.json")
    os.symlink("/etc/hostname", root / "link-state" / "volume" / ".txn" / "agent.json")
    os.symlink(root / "a-directory", root / "link-state" / "volume" / ".staging")
    deep_cfg = root / "deep-config.yaml"
    deep_cfg.write_text("fleet: " + DEEP + "\n")
    (root / "bignum-state" / "volume").mkdir(parents=True)
    bignum_state = write_project_config(root / "bignum-state")
    (root / "bignum-state" / "volume" / "fleet-state.json").write_text('{"schema": ' + BIG + "}")
    bignum_cfg = root / "bignum-config.yaml"
    bignum_cfg.write_text(f"fleet: {{max_lora_rank: {BIG}}}\n")
    # issue 40: the base served under a name an adapter could take; a volume the fleet cannot read
    served = write_project_config(
        _mk(root / "served"), served={"model": "org/base", "served_model_name": "qwen-base"}
    )
    served_vn = write_project_config(_mk(root / "served-vn"), served={"served_model_name": "qwen-v3"})
    fleet_user = write_project_config(_mk(root / "fleet-user"), volume={"fleet_user": "no-such-user-x"})
    closed = write_project_config(_mk(root / "closed-volume"))
    (root / "closed-volume" / "volume").mkdir(mode=0o700)
    os.chmod(root / "closed-volume" / "volume", 0o700)
    not_db = write_project_config(root / "not-db")
    (root / "not-db" / "state").mkdir(parents=True)
    (root / "not-db" / "state" / "mlflow.db").write_bytes(b"garbage" * 500)
    # issue 40: stores in a state the project did not leave (it created them: its marker is there)
    emptied = write_project_config(root / "emptied")
    (root / "emptied" / "state").mkdir()
    (root / "emptied" / "state" / "mlflow.db").write_bytes(b"")
    foreign = write_project_config(root / "foreign")
    (root / "foreign" / "state").mkdir()
    con = sqlite3.connect(root / "foreign" / "state" / "mlflow.db")
    con.execute("CREATE TABLE notes (body TEXT)")
    con.commit()
    con.close()
    for made in (emptied, foreign):
        from pipeline.config import load_config
        from pipeline.registry.store import _marker

        c = load_config(made)
        _marker(c, c.tracking_uri).write_text(c.tracking_uri + "\n")
    closed = free_port()
    base = {"PIPELINE_CONFIG": str(proj), "MLFLOW_TRACKING_URI": ""}
    w.envs = {
        "project": base,
        "bad-config": {**base, "PIPELINE_CONFIG": str(bad_cfg)},
        "bad-fleet": {**base, "PIPELINE_CONFIG": str(bad_fleet)},
        "yaml-config": {**base, "PIPELINE_CONFIG": str(w.paths["yaml"])},
        "missing-config": {**base, "PIPELINE_CONFIG": str(w.paths["missing"])},
        "closed-port": {**base, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"},
        "file-store": {**base, "MLFLOW_TRACKING_URI": str(root / "mlruns")},
        "not-a-db": {**base, "PIPELINE_CONFIG": str(not_db)},
        "broken-state": {**base, "PIPELINE_CONFIG": str(broken_state)},
        "binary-state": {**base, "PIPELINE_CONFIG": str(binary_state)},
        "binary-config": {**base, "PIPELINE_CONFIG": str(w.paths["binary"])},
        "deep-state": {**base, "PIPELINE_CONFIG": str(deep_state)},
        "link-state": {**base, "PIPELINE_CONFIG": str(link_state)},
        "deep-config": {**base, "PIPELINE_CONFIG": str(deep_cfg)},
        # issue 30 kind 3: settings from the environment that are not what they look like
        "env-json": {**base, "PIPELINE_FLEET": "{"},
        "env-uri": {**base, "MLFLOW_TRACKING_URI": "http://[::1"},
        # issue 40 kind 5: every URI form (a closed port where a server is needed; drivers not installed)
        "pg-plain": {**base, "MLFLOW_TRACKING_URI": f"postgresql://u:pw@127.0.0.1:{closed}/mlflow"},
        "pg-psycopg2": {**base, "MLFLOW_TRACKING_URI": f"postgresql+psycopg2://u:pw@127.0.0.1:{closed}/m"},
        "pg-psycopg": {**base, "MLFLOW_TRACKING_URI": f"postgresql+psycopg://u:pw@127.0.0.1:{closed}/m"},
        "pg-short": {**base, "MLFLOW_TRACKING_URI": f"postgres://u@127.0.0.1:{closed}/m"},
        "mysql": {**base, "MLFLOW_TRACKING_URI": f"mysql://u:pw@127.0.0.1:{closed}/m"},
        "mysql-pymysql": {**base, "MLFLOW_TRACKING_URI": f"mysql+pymysql://u:pw@127.0.0.1:{closed}/m"},
        "https-closed": {**base, "MLFLOW_TRACKING_URI": f"https://127.0.0.1:{closed}"},
        "file-uri": {**base, "MLFLOW_TRACKING_URI": f"file://{root / 'mlruns-uri'}"},
        "bad-scheme": {**base, "MLFLOW_TRACKING_URI": "ftp://127.0.0.1/mlflow"},
        "bad-driver": {**base, "MLFLOW_TRACKING_URI": f"postgresql+nodriver://u@127.0.0.1:{closed}/m"},
        "sqlite-rel": {**base, "MLFLOW_TRACKING_URI": "sqlite:///"},
        "emptied": {**base, "PIPELINE_CONFIG": str(emptied)},
        "foreign": {**base, "PIPELINE_CONFIG": str(foreign)},
        "env-typo": {**base, "PIPELINE_VOLUME_PATH": "/elsewhere"},
        "fifo-config": {**base, "PIPELINE_CONFIG": str(w.paths["fifo"])},
        "bignum-state": {**base, "PIPELINE_CONFIG": str(bignum_state)},
        "bignum-config": {**base, "PIPELINE_CONFIG": str(bignum_cfg)},
        "env-deep": {**base, "PIPELINE_FLEET": DEEP},
        "env-interval": {**base, "PIPELINE_PROGRESS_INTERVAL": "abc"},
        "served": {**base, "PIPELINE_CONFIG": str(served)},
        "served-vn": {**base, "PIPELINE_CONFIG": str(served_vn)},
        "served-env": {**base, "PIPELINE_SERVED__SERVED_MODEL_NAME": "qwen-base"},
        "fleet-user": {**base, "PIPELINE_CONFIG": str(fleet_user)},
        "closed-volume": {**base, "PIPELINE_CONFIG": str(closed)},
    }
    return w


NAMES = ["../escape", "a/b", "/etc/passwd", "x" * 300, "Foo", "foo-v1", "", "abc\n"]
STORES = ["closed-port", "file-store", "not-a-db", "env-uri"]
STORES += ["pg-plain", "pg-psycopg2", "pg-psycopg", "pg-short", "mysql", "mysql-pymysql", "https-closed"]
STORES += ["file-uri", "bad-scheme", "bad-driver", "sqlite-rel", "emptied", "foreign"]
CONFIGS = [
    "bad-config",
    "yaml-config",
    "missing-config",
    "binary-config",
    "deep-config",
    "env-json",
    "env-typo",
    "fifo-config",
    "bignum-config",
    "env-deep",
]
VOLUMES = ["broken-state", "binary-state", "deep-state", "link-state", "bignum-state"]


def cases(w: World) -> list[Case]:
    P = {k: str(v) for k, v in w.paths.items()}
    tiny = str(REPO / "axolotl_configs" / "tiny-cpu.yml")
    out: list[Case] = []
    add = out.append
    # train
    for n in NAMES:
        add(Case(["train", tiny, "--name", n]))
    for f in ("missing", "devnull", "binary", "dir", "loop", "yaml", "yaml-list", "empty", "fifo"):
        add(Case(["train", P[f]]))
    add(Case(["train", tiny], env="env-interval"))
    add(Case(["run", tiny], env="env-interval"))
    add(Case(["train", tiny, "--set", "=", "--name", "x"]))
    add(Case(["train", tiny, "--set", "nokey"]))
    add(Case(["train", tiny, "--overlay", P["missing"]]))
    add(Case(["train", tiny, "--overlay", P["yaml"]]))
    add(Case(["train", tiny, "--gpus", "-3"]))
    add(Case(["train", P["deep-yaml"]]))
    add(Case(["train", tiny, "--overlay", P["deep-yaml"]]))
    add(Case(["train", tiny, "--set", "lora_r=" + "[" * 5000]))
    # validate
    for f in (
        "missing",
        "devnull",
        "binary",
        "dir",
        "loop",
        "bad-adapter",
        "empty",
        "deep-adapter",
        "bignum-adapter",
    ):
        add(Case(["validate", P[f]]))
    add(Case(["validate", P["bad-adapter"], "--base", P["missing"]]))
    add(Case(["validate", P["dir"], "--served", P["binary"], "--json"]))
    # register
    for n in NAMES:
        add(Case(["register", P["dir"], "--name", n]))
    for f in ("missing", "devnull", "binary", "bad-adapter", "loop", "deep-adapter", "bignum-adapter"):
        add(Case(["register", P[f], "--name", "agent"]))
    add(Case(["validate", P["dir"], "--training-config", P["deep-yaml"]]))
    add(Case(["validate", P["dir"], "--training-config", P["fifo"]]))
    # publish / promote / rollback
    for n in NAMES:
        add(Case(["publish", n, "--version", "1"]))
        add(Case(["promote", n, "1"]))
        add(Case(["rollback", n]))
    add(Case(["publish", "ghost", "--version", "-1"]))
    add(Case(["publish", "ghost", "--version", "1", "--alias", "x"]))
    add(Case(["publish", "ghost"]))
    add(Case(["publish", "ghost", "--alias", "../x"]))
    add(Case(["promote", "ghost", "0"]))
    add(Case(["promote", "ghost", "99999999999999999999"]))
    add(Case(["rollback", "ghost", "--to", "-5"]))
    # status / ui
    for n in NAMES:
        add(Case(["status", n]))
    add(Case(["status", "ghost", "--json"]))
    add(Case(["ui", "--port", "-1"], env="file-store"))
    add(Case(["ui", "--port", "99999"]))
    add(Case(["ui"], env="closed-port"))
    # canary
    for n in NAMES:
        add(Case(["canary", n, "--staging", f"http://127.0.0.1:{free_port()}"]))
    add(Case(["canary", P["bad-adapter"], "--staging", f"http://127.0.0.1:{free_port()}"]))
    add(Case(["canary", P["deep-adapter"], "--staging", f"http://127.0.0.1:{free_port()}"]))
    add(Case(["canary", P["dir"], "--version", "1", "--staging", "not a url"]))
    add(Case(["canary", "ghost", "--staging", "http://127.0.0.1:9", "--instance-path", "/x"]))
    # draft
    for n in NAMES:
        add(Case(["draft", n, "--version", "1"]))
    add(Case(["draft", "ghost", "--version", "0"]))
    add(Case(["draft", "ghost", "--version", "1", "--base", P["binary"], "--budget-s", "nan"]))
    add(Case(["draft", "ghost", "--version", "1", "--base", P["missing"], "--device", "tpu"]))
    # merge
    add(Case(["merge", P["missing"], "--base", P["missing"], "--out", P["out-exists"]]))
    add(Case(["merge", P["bad-adapter"], "--base", P["dir"], "--out", str(w.root / "merged")]))
    add(Case(["merge", P["bad-adapter"], "--base", P["dir"], "--out", str(w.root / "merged"), "--dry-run"]))
    add(
        Case(["merge", P["deep-adapter"], "--base", P["binary"], "--out", "/proc/x/y", "--dry-run", "--json"])
    )
    add(Case(["merge-parity", P["binary"], "--merged", "http://127.0.0.1:9", "--dry-run"]))
    add(Case(["merge-parity", P["dir"], "--merged", "not a url", "--dry-run"]))
    add(Case(["merge", P["deep-adapter"], "--base", P["deep-adapter"], "--out", str(w.root / "merged-deep")]))
    # merge-parity
    add(Case(["merge-parity", P["missing"], "--merged", "http://127.0.0.1:9"]))
    add(
        Case(
            [
                "merge-parity",
                P["deep-adapter"],
                "--merged",
                "http://127.0.0.1:9",
                "--hot",
                "http://127.0.0.1:9",
            ]
        )
    )
    add(Case(["merge-parity", P["dir"], "--merged", "not a url"]))
    add(Case(["merge", P["dir"], "--base", P["binary"], "--out", P["devnull"]]))
    add(
        Case(
            [
                "merge",
                P["dir"],
                "--base",
                P["dir"],
                "--out",
                str(w.root / "m2"),
                "--name",
                "a/b",
                "--version",
                "1",
            ]
        )
    )
    add(Case(["merge", P["dir"], "--base", P["dir"], "--out", str(w.root / "m3"), "--name", "agent"]))
    add(
        Case(
            ["merge", P["dir"], "--base", P["dir"], "--out", str(w.root / "m4"), "--threads", "100000000000"]
        )
    )
    # run / follow-alias
    for n in NAMES:
        add(Case(["run", tiny, "--name", n]))
    for f in ("missing", "binary", "yaml", "dir", "deep-yaml"):
        add(Case(["run", P[f]]))
    for n in NAMES:
        add(Case(["follow-alias", "--once", "--name", n]))
    add(Case(["follow-alias", "production", "--once", "--interval", "0"]))
    add(Case(["follow-alias", "--webhook-port", "1", "--once"]))
    add(Case(["follow-alias", "--webhook-port", "99999", "--once"]))
    add(Case(["follow-alias", "--once", "--interval", "nan"]))
    # fleet
    add(Case(["fleet", "status"], env="broken-state"))
    add(Case(["fleet", "sync"], env="broken-state"))
    add(Case(["fleet", "sync", "--interval", "-1", "--follow-alias", "production"], env="closed-port"))
    add(Case(["fleet", "sync", "--watch", "--interval", "nan"]))
    add(Case(["fleet", "sync", "--watch", "--interval", "inf", "--json"]))
    for n in NAMES:
        add(Case(["fleet", "prune", n]))
    add(Case(["fleet", "prune", "ghost", "--keep", "0"]))
    add(Case(["fleet", "prune", "ghost"], env="broken-state"))
    for n in NAMES:
        add(Case(["fleet", "resolve", n]))
    add(Case(["fleet", "resolve", "ghost", "--json"], env="broken-state"))
    # schedule
    for n in NAMES:
        add(Case(["schedule", "emit", "--kind", "systemd", "--name", n, "--config", "c.yml"]))
    add(Case(["schedule", "emit", "--kind", "bogus", "--name", "a", "--config", "c.yml"]))
    add(
        Case(
            [
                "schedule",
                "emit",
                "--kind",
                "systemd",
                "--name",
                "a",
                "--config",
                "c",
                "--schedule",
                "61 3 * * *",
            ]
        )
    )
    add(Case(["schedule", "emit", "--kind", "cronjob", "--name", "a", "--config", "c", "--gpus", "-1"]))
    add(
        Case(
            ["schedule", "emit", "--kind", "scrontab", "--name", "a", "--config", "c", "--out", P["devnull"]]
        )
    )
    # dataset
    for f in (
        "missing",
        "devnull",
        "binary",
        "dir",
        "loop",
        "yaml",
        "deep-jsonl",
        "fifo",
        "deep-args-jsonl",
        "bignum-jsonl",
    ):
        add(Case(["dataset", "check", P[f]]))
    add(Case(["train", P["bignum-yaml"]]))
    add(Case(["train", tiny, "--set", "lora_r=" + BIG]))
    add(Case(["dataset", "check", P["empty"], "--validation", P["binary"], "--tokenizer", P["dir"]]))
    add(Case(["dataset", "check", P["empty"], "--sequence-len", "-5"]))
    for f in ("missing", "dir", "binary", "yaml", "devnull"):  # --config: an axolotl config that is not one
        add(Case(["dataset", "check", "--config", P[f]]))
    add(Case(["dataset", "check", "--config", tiny, "--set", "datasets=[x]"]))
    add(Case(["dataset", "check", "--config", tiny, "--allow", "bogus"]))
    add(
        Case(
            [
                "schedule",
                "emit",
                "--kind",
                "systemd",
                "--name",
                "a",
                "--config",
                tiny,
                "--workdir",
                P["missing"],
            ]
        )
    )
    add(
        Case(
            [
                "schedule",
                "emit",
                "--kind",
                "cronjob",
                "--name",
                "a",
                "--config",
                P["binary"],
                "--image",
                "r/i:1",
            ]
        )
    )
    # config
    for env in CONFIGS + ["bad-fleet"]:
        add(Case(["config", "show"], env=env))
    add(Case(["fleet", "status"], env="bad-fleet"))
    add(Case(["publish", "agent", "--version", "1"], env="bad-fleet"))
    # demo / dev
    for n in NAMES:
        add(Case(["demo", "--name", n]))
    add(Case(["demo", "--config", P["missing"]], env="bad-config"))
    add(Case(["dev", "real-base", "/proc/no-such-dir/x", "--layers", "4"]))
    add(Case(["dev", "real-base", P["devnull"], "--layers", "4"]))
    add(Case(["dev", "real-base", str(w.root / "rb"), "--layers", "3"]))
    add(Case(["dev", "real-base", str(w.root / "rb"), "--layers", "0"]))
    add(Case(["dev", "real-base", str(w.root / "rb"), "--device", "bogus"]))
    add(Case(["dev", "real-base", str(w.root / "rb"), "--shard-gb", "0"]))
    add(Case(["dev", "real-base", P["out-exists"], "--layers", "4", "--device", "cuda"]))  # CPU machine
    add(Case(["dev", "tiny-base", "/proc/no-such-dir/x"]))
    add(Case(["dev", "tiny-base", ""]))  # helper-7: removed every file in the working directory
    add(Case(["dev", "tiny-base", "."]))
    add(Case(["dev", "tiny-base", P["bad-adapter"]]))  # a directory that is no checkpoint
    add(Case(["dev", "tiny-base", str(w.root / "tb2"), "--seed", "99999999999999999999999"]))
    add(Case(["dev", "real-base", ".", "--layers", "4"]))
    add(Case(["dev", "real-base", str(w.root / "rb"), "--shard-gb", "nan"]))
    add(Case(["dev", "tiny-base", P["devnull"]]))
    add(Case(["dev", "tiny-base", str(w.root / "tb"), "--layout", "bogus"]))
    tb = str(w.root / "trained")
    add(Case(["dev", "trained-base", tb]))  # --device cuda by default: refused on a CPU machine
    add(Case(["dev", "trained-base", tb, "--device", "cpu", "--layers", "6"]))
    add(Case(["dev", "trained-base", tb, "--device", "cpu", "--hidden", "100"]))
    add(Case(["dev", "trained-base", tb, "--device", "cpu", "--minutes", "nan"]))
    add(Case(["dev", "trained-base", tb, "--device", "cpu", "--corpus", P["missing"]]))
    add(Case(["dev", "trained-base", tb, "--device", "cpu", "--corpus", P["devnull"]]))
    add(Case(["dev", "trained-base", ".", "--device", "cpu"]))
    add(Case(["dev", "trained-base", "/proc/no-such-dir/x", "--device", "cpu"]))
    add(Case(["dev", "trained-base", P["devnull"], "--device", "cpu"]))
    td = str(w.root / "tasks")
    add(Case(["dev", "task-data", "bogus", td]))
    add(Case(["dev", "task-data", "toolcall", P["devnull"]]))  # a file, not a directory
    add(Case(["dev", "task-data", "snake", P["empty"]]))
    add(Case(["dev", "task-data", "snake", "/proc/no-such-dir/x"]))
    add(Case(["dev", "task-data", "snake", "/proc/self/status/x"]))  # a parent that is a file
    add(Case(["dev", "task-data", "toolcall", td, "--train", "0"]))
    add(Case(["dev", "task-data", "toolcall", td, "--validation", BIG]))
    add(Case(["dev", "task-data", "toolcall", td, "--seed", "-1"]))
    add(Case(["dev", "served-base", P["missing"], str(w.root / "sb")]))
    add(Case(["dev", "served-base", P["deep-adapter"], str(w.root / "sb2")]))
    add(Case(["dev", "served-base", P["dir"], P["devnull"]]))
    # every registry and volume command against broken stores, project configs and volumes
    for env in STORES + CONFIGS + VOLUMES:
        for args in (
            ["register", P["dir"], "--name", "agent"],
            ["publish", "agent", "--version", "1"],
            ["promote", "agent", "1"],
            ["rollback", "agent"],
            ["status"],
            ["fleet", "status"],
            ["fleet", "prune", "agent"],
            ["fleet", "resolve", "agent"],
            ["follow-alias", "--once"],
            ["run", tiny, "--name", "agent"],
            ["canary", "agent", "--staging", "http://127.0.0.1:9"],
            ["draft", "agent", "--version", "1"],
            # the dry runs read the same stores and volumes (issue 41 item 5's siblings)
            ["follow-alias", "--dry-run"],
            ["canary", "agent", "--staging", "http://127.0.0.1:9", "--dry-run"],
            ["draft", "agent", "--version", "1", "--dry-run"],
        ):
            # status and the follower do not read the volume: a broken one is not their error
            harmless = env in VOLUMES and args[0] in ("status", "follow-alias")
            add(Case(args, env=env, ok_codes=(0, *ERRORS) if harmless else ERRORS))
    # issue 40 kind 2: a name the fleet serves the base under (or NAME-vN of it) is refused first, exit 2;
    # the readers (status, fleet resolve/prune) may say not found
    for env, n in (("served", "qwen-base"), ("served-vn", "qwen"), ("served-env", "qwen-base")):
        for args in (
            ["train", tiny, "--name", n],
            ["run", tiny, "--name", n],
            ["register", P["dir"], "--name", n],
            ["publish", n, "--version", "1"],
            ["promote", n, "1"],
            ["rollback", n],
            ["canary", n, "--staging", "http://127.0.0.1:9"],
            ["follow-alias", "--once", "--name", n],
            ["schedule", "emit", "--kind", "systemd", "--name", n, "--config", "c.yml"],
            [
                "merge",
                P["dir"],
                "--base",
                P["dir"],
                "--out",
                str(w.root / "m5"),
                "--name",
                n,
                "--version",
                "1",
            ],
            ["demo", "--name", n],
        ):
            add(Case(args, env=env, ok_codes=(2,)))
        for args in (["status", n], ["fleet", "resolve", n], ["fleet", "prune", n]):
            add(Case(args, env=env, ok_codes=(0, *ERRORS)))
    # issue 40 kind 3: an unknown volume.fleet_user, a volume root the fleet cannot enter
    for env in ("fleet-user", "closed-volume"):
        for args in (
            ["publish", "agent", "--version", "1"],
            ["promote", "agent", "1"],
            ["rollback", "agent"],
            ["status"],
            ["fleet", "status"],
            ["fleet", "prune", "agent"],
            ["follow-alias", "--once"],
        ):
            # readers, and a prune with nothing to prune, have nothing to refuse
            harmless = args[0] in ("status", "follow-alias", "fleet")
            add(Case(args, env=env, ok_codes=(0, *ERRORS) if harmless else ERRORS))
    return out


def _command_paths() -> set[str]:
    """`train`, ..., and `fleet status`, `fleet sync`... for groups."""
    out = set()
    for name, (_, is_group, _) in COMMANDS.items():
        cmd = load_command(name)
        if is_group:
            out |= {f"{name} {sub}" for sub in cmd.commands}
        else:
            out.add(name)
    return out


def _covered(args: list[str]) -> str:
    first = args[0]
    return f"{first} {args[1]}" if COMMANDS[first][1] else first


@pytest.fixture(scope="module")
def all_cases(world) -> list[Case]:
    return cases(world)


def test_every_command_is_covered(world):
    have = {_covered(c.args) for c in cases(world)}
    missing = sorted(_command_paths() - have)
    assert missing == [], f"commands without hostile cases in tests/test_no_tracebacks.py: {missing}"


def _run(world: World, case: Case):
    env = dict(world.envs[case.env])
    if not env.get("MLFLOW_TRACKING_URI"):
        env["MLFLOW_TRACKING_URI"] = None  # CliRunner: unset
    return CliRunner().invoke(app, case.args, env=env)


def test_no_command_prints_a_traceback(world, all_cases, monkeypatch):
    from pipeline.registry import store

    monkeypatch.chdir(world.root)
    failures = []
    for case in all_cases:
        store._checked.clear()
        r = _run(world, case)
        text = r.output
        crashed = r.exception is not None and not isinstance(r.exception, SystemExit | typer.Exit)
        if crashed or "Traceback" in text or r.exit_code not in case.ok_codes:
            what = f"{type(r.exception).__name__}: {r.exception}" if crashed else text.strip()[-300:]
            failures.append(f"[{case.id}] exit {r.exit_code}: {what}")
    assert failures == [], f"{len(failures)} of {len(all_cases)} cases:\n" + "\n".join(failures)
