"""Start and stop real vLLM CPU instances for fleet tests (no fake server).

Runs `.fleet-venv/bin/python tests/support/vllm_cpu_launcher.py serve MODEL ...` with the flags from
scripts/FLEET_NOTES.md in its own process group (killing the group takes down the API server,
EngineCore and worker). Start-up is ~35-75 s on 2 busy cores, so start several at once with
`start_all`. Every instance gets a free port on 127.0.0.1 and its log in `log_dir`.

CPU placement (docs/fleet.md "A CPU test fleet"): vLLM's default `VLLM_CPU_OMP_THREADS_BIND=auto`
reserves the last core of a NUMA node and binds the worker to the rest, so on a 2-core machine
the worker of EVERY instance is pinned to core 0. `cpu_fleet_env(i)` gives instance `i` its own
core instead (the whole process tree via the affinity mask, the OpenMP worker via
`VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
FLEET_PY = REPO / ".fleet-venv" / "bin" / "python"
LAUNCHER = REPO / "tests" / "support" / "vllm_cpu_launcher.py"

# --max-num-seqs 1: the CPU engine gives base rows of a mixed base/LoRA batch the last LoRA slot
# (test-environment.md); the canary compares base and adapter output while clients stream requests.
SERVE_ARGS = [
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "1",
    "--enforce-eager",
    "--enable-lora",
    "--max-lora-rank",
    "16",
    "--max-loras",
    "2",
    "--max-cpu-loras",
    "8",
]


def fleet_env_available() -> bool:
    return FLEET_PY.exists()


def fleet_vllm_version() -> str:
    """The vLLM version the fleet environment's servers report on `GET /version` (e.g. "0.32.0")."""
    site = next((REPO / ".fleet-venv" / "lib").glob("python*/site-packages"))
    dist = next(site.glob("vllm_cpu-*.dist-info"), None) or next(site.glob("vllm-*.dist-info"))
    return dist.name.removesuffix(".dist-info").split("-")[1].split("+")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM CPU instance serving `model` (an absolute directory; also its served name)."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        name: str,
        extra_env: dict | None = None,
        extra_args: list[str] | None = None,
        cpus: list[int] | None = None,
    ):
        self.model = str(Path(model).resolve())
        self.name = name
        self.port = free_port()
        self.log = Path(log_dir) / f"{name}.log"
        self.extra_env = extra_env or {}
        self.extra_args = list(extra_args or [])  # after SERVE_ARGS: a repeated flag overrides (e.g. --dtype)
        self.cpus = cpus  # CPU affinity of the whole process tree (None: inherit)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            **self.extra_env,
        )
        env.pop("PYTHONPATH", None)
        cmd = [
            str(FLEET_PY),
            str(LAUNCHER),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *SERVE_ARGS,
            *self.extra_args,
        ]
        cpus = self.cpus
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        return self

    def pause(self) -> None:
        """SIGSTOP the whole instance (API server, engine, worker): it still accepts connections
        (the kernel queues them) but answers nothing: a hung instance."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        os.killpg(self.proc.pid, signal.SIGCONT)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Poll /health until 200. Raises RuntimeError with the log tail if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGCONT)  # a paused instance cannot handle SIGTERM
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"


def cpu_fleet_env(index: int | None, ncores: int | None = None) -> dict:
    """VllmServer keyword arguments that put instance `index` on its own core (None: vLLM's default).

    Core `index % ncores` of this process's allowed CPUs: the process tree's affinity, and the
    OpenMP worker bound there explicitly (no core reserved: the engine and API server share it).
    """
    if index is None:
        return {}
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[index % (ncores or len(allowed))]
    return {"cpus": [core], "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}


def start_all(servers: list[VllmServer], timeout_s: float = 240.0) -> list[VllmServer]:
    """Start all servers at once, then wait for each; stops them all if one fails."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
