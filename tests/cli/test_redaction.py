"""Secrets printed (issue 30 kind 4): no command prints a registry password, token or API key.

Every command that prints a tracking URI (results, `--json`, error messages) runs against stores
whose URIs carry credentials; the secrets must not appear in what it prints. The stores are
unreachable on purpose (a closed port on 127.0.0.1): the commands fail within seconds, and their
error messages name the store.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.redact import RedactingStream, add_secret, redact, redact_uri
from tests.support.helpers import write_project_config
from tests.support.registry_support import free_port

SECRET = "Pa55-w0rd-xyz"  # in the URI
TOKEN = "tok-abcdef-123456"  # in MLflow's credential variables


def test_redact_uri_masks_user_info_and_credential_parameters():
    assert redact_uri("postgresql://bob:pw@db:5432/m") == "postgresql://***@db:5432/m"
    assert redact_uri("postgresql://db/m?sslmode=require&password=pw") == (
        "postgresql://db/m?sslmode=require&password=***"
    )
    assert redact_uri("https://h/x?X-Amz-Signature=abc&y=1") == "https://h/x?X-Amz-Signature=***&y=1"
    assert redact_uri("sqlite:////abs/mlflow.db") == "sqlite:////abs/mlflow.db"


def test_redact_masks_secret_variables_and_registered_values(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")  # a name, not a secret
    add_secret("instance-api-key-42")
    text = f"token {TOKEN}, key instance-api-key-42, user alice"
    assert redact(text) == "token ***, key ***, user alice"
    # an instance's API key, read from a variable whose name says nothing (`api_key_env`)
    from pipeline.config import Instance

    monkeypatch.setenv("VLLM0_AUTH", "vllm-key-0123456789")
    assert Instance(name="vllm-0", url="http://h:1", api_key_env="VLLM0_AUTH").api_key()
    assert redact("Authorization: Bearer vllm-key-0123456789") == "Authorization: Bearer ***"


def test_the_stream_redacts_whatever_writes_to_it(capsys):
    import sys

    s = RedactingStream(sys.stdout)
    print("mlflow at http://u:verysecret@h/", file=s)
    assert capsys.readouterr().out == "mlflow at http://***@h/\n"


def test_redact_survives_another_thread_changing_the_environment(monkeypatch):
    """MLflow's telemetry thread deleted `_MLFLOW_TELEMETRY_SESSION_ID` while `redact` walked os.environ, and
    `pipeline train` died with KeyError (H200, every time). Here a thread adds and removes a variable in a
    tight loop while `redact` walks the environment again and again: every call masks the secret, none
    raises (KeyError for a key gone mid-walk, RuntimeError for one added)."""
    import os
    import sys
    import threading
    import time

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    for i in range(200):  # a longer walk: more thread switches fall inside one
        monkeypatch.setenv(f"PIPELINE_TEST_PAD_{i}", "x")
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            os.environ["_MLFLOW_TELEMETRY_SESSION_ID"] = "s"
            del os.environ["_MLFLOW_TELEMETRY_SESSION_ID"]

    writer = threading.Thread(target=churn, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often (default 5 ms: longer than a walk)
    writer.start()
    calls = 0
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert redact(f"token {TOKEN}") == "token ***"
            calls += 1
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(interval)
    assert calls > 100


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("redact")
    port = free_port()
    (root / "file-uri").mkdir()
    (root / "plain").mkdir()
    in_file = write_project_config(
        root / "file-uri",
        registry={"tracking_uri": f"postgresql://svc:{SECRET}@127.0.0.1:{port}/mlflow?password={SECRET}"},
    )
    plain = write_project_config(root / "plain")
    envs = {
        "http": {
            "PIPELINE_CONFIG": str(plain),
            "MLFLOW_TRACKING_URI": f"http://alice:{SECRET}@127.0.0.1:{port}",
        },
        "postgres-file": {"PIPELINE_CONFIG": str(in_file), "MLFLOW_TRACKING_URI": ""},
        "token": {
            "PIPELINE_CONFIG": str(plain),
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
            "MLFLOW_TRACKING_TOKEN": TOKEN,
            "MLFLOW_TRACKING_PASSWORD": SECRET,
        },
    }
    return root, envs


COMMANDS = [
    ["config", "show"],
    ["config", "show", "--json"],
    ["status"],
    ["status", "--json"],
    ["status", "agent"],
    ["ui"],
    ["register", "/nonexistent", "--name", "agent"],
    ["publish", "agent", "--version", "1"],
    ["publish", "agent", "--version", "1", "--json"],
    ["promote", "agent", "1"],
    ["rollback", "agent"],
    ["fleet", "status"],
    ["fleet", "prune", "agent"],
    ["fleet", "sync", "--follow-alias", "production"],
    ["follow-alias", "--once"],
    ["canary", "agent", "--version", "1", "--staging", "http://127.0.0.1:9"],
]


@pytest.mark.parametrize("env", ["http", "postgres-file", "token"])
def test_no_command_prints_a_secret(world, env, monkeypatch):
    """`config show` printed the password of PIPELINE_REGISTRY__TRACKING_URI (issue 30); every other
    command that prints the store's URI is checked with it."""
    from pipeline.registry import store

    root, envs = world
    monkeypatch.chdir(root)
    leaks = []
    for args in COMMANDS:
        store._checked.clear()
        e = {k: (v or None) for k, v in envs[env].items()}
        r = CliRunner().invoke(app, args, env=e)
        out = r.output + (str(r.exception) if r.exception and not isinstance(r.exception, SystemExit) else "")
        if SECRET in out or TOKEN in out or "Traceback" in out:
            leaks.append(f"{' '.join(args)} (exit {r.exit_code}): {out[-400:]}")
    assert leaks == []


def test_a_child_s_log_is_redacted_line_by_line(tmp_path, monkeypatch):
    """Sibling (a secret in a log): the trainer's output went straight to train.log (0644, uploaded to
    MLflow when training fails), where MLflow prints `View run ... at: <tracking URI>` with its
    credentials and axolotl its whole config. `pipeline train` now copies it through the redaction."""
    import subprocess
    import sys

    from pipeline.redact import copy_redacted

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "env-password-123")
    child = (
        "import sys\n"
        "print('🏃 View run r at: http://bob:Pa55-w0rd-xyz@127.0.0.1:5000/#/experiments/1/runs/x')\n"
        "sys.stdout.write('step 1/2\\rstep 2/2 env-password-123\\r')\n"
        "print()\n"
        "sys.stdout.buffer.write(b'\\xff not utf-8\\n')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        t = copy_redacted(proc.stdout, out)
        proc.wait(30)
        t.join(10)
    text = log.read_text()
    assert SECRET not in text and "env-password-123" not in text, text
    assert "http://***@127.0.0.1:5000/#/experiments/1/runs/x" in text and "step 2/2 ***" in text
    assert "not utf-8" in text


def test_a_real_training_keeps_its_whole_log_and_no_tracking_uri(trained):
    """End to end with the session's one axolotl training: the log arrives through the copy whole
    (axolotl's config dump and the trainer's last lines), and resolved.yml names no store."""
    cfg, res = trained
    log = (res.run_dir / "train.log").read_text()
    assert '"base_model"' in log and "mlflow_tracking_uri" not in log, log[-2000:]
    assert "mlflow_tracking_uri" not in (res.run_dir / "resolved.yml").read_text()
    assert res.run_id and res.adapter_dir.is_dir()


def test_run_params_are_redacted(monkeypatch):
    """Sibling (a secret in MLflow run params): the axolotl config becomes the training run's params;
    a dataset URL with its token or a URI with its password was stored as given."""
    from pipeline.registry.store import flatten_params

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    flat = flatten_params(
        {
            "axolotl": {
                "datasets": [{"path": "https://h/d.jsonl?token=tok-abcdef-123456"}],
                "base_model": "hf_abcdefghijklmnop",
                "hub": "postgresql://bob:Pa55-w0rd-xyz@db/x",
            }
        }
    )
    text = str(flat)
    assert TOKEN not in text and SECRET not in text and "hf_abcdefghijklmnop" not in text, flat
    assert flat["axolotl.hub"] == "postgresql://***@db/x"


def test_the_traceback_of_a_bug_is_redacted(tmp_path):
    """Sibling (a secret in a traceback): a bug's traceback is printed by Python after the command's
    redacted streams are put back, and its message may hold the store's URI with the password."""
    import subprocess
    import sys

    from tests.support.helpers import REPO

    child = (
        "import sys\n"
        "import pipeline.cli.registry as r\n"
        "def boom(*a, **k):\n"
        f"    raise RuntimeError('unexpected: postgresql://u:{SECRET}@127.0.0.1:1/db')\n"
        "r.collect = boom\n"
        "from pipeline.cli import app\n"
        "sys.argv = ['pipeline', 'status']\n"
        "app(prog_name='pipeline')\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "PIPELINE_CONFIG": str(write_project_config(tmp_path)),
    }
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr, r.stderr[-2000:]  # a bug still says so
    assert SECRET not in r.stderr and "postgresql://***@127.0.0.1:1/db" in r.stderr
