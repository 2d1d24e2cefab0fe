"""The run context `Ctx`: paths, environments, CLI and background processes, engines started and stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from . import REPO
from .engines import COMMON, GPU_ONLY, NCCL_ENV, TRAINED_REPORT, Engine, _kill, gpu_apps
from .measure import DEFAULT_IDS


@dataclass
class Ctx:
    plan: str
    work: Path
    out: Path
    deadline_s: float
    gpu: bool
    t0: float = field(default_factory=time.time)
    engines: dict[str, Engine] = field(default_factory=dict)
    bg: dict[str, tuple[subprocess.Popen, Path, float]] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # what stages hand on (adapter dirs, versions, mount ...)
    adapters_given: list[Path] | None = None
    attach: dict[str, str] | None = None  # NAME=URL: running instances instead of engines started here
    base_given: Path | None = None  # `--base DIR`: a prebuilt bf16 base instead of the random real8

    @property
    def bf16(self) -> Path:
        """The bf16 base every stage trains, registers and canaries against: `--base DIR`, else WORK/real8
        (built by stage `base`)."""
        if self.base_given is not None:
            return self.base_given
        return SHM / "real64" if self.plan == "fleet64" else self.work / "real8"

    @property
    def nvfp4(self) -> Path:
        """The NVFP4 build of `bf16` (`pipeline dev served-base`): WORK/<bf16's name>-nvfp4; its name is the
        engines' `--served-model-name`."""
        return self.work / f"{self.bf16.name}-nvfp4"

    @property
    def trained(self) -> dict | None:
        """The base's `trained_base.json` (`pipeline dev trained-base`: its MTP layer is trained), or None."""
        p = self.bf16 / TRAINED_REPORT
        return json.loads(p.read_text()) if p.is_file() else None

    @property
    def ids(self):
        """The token ids random prompts are drawn from (stage `base` sets them from the base's tokenizer)."""
        return self.facts.get("prompt_ids") or DEFAULT_IDS

    @property
    def mtp_json(self) -> Path:
        """benchmarks/mtp_distill.py's report on `bf16` (one per base: a later `--base` reuses none of real8's)."""
        return self.work / ("mtp.json" if self.base_given is None else f"{self.bf16.name}-mtp.json")

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {msg}", flush=True)

    # environments ------------------------------------------------------------------------------------------------
    def pipeline_env(self, modelopt: bool = False) -> dict:
        """The environment of every `pipeline` / helper process.

        GPU: the training bundle (`$TRAIN_SITE`, scripts/gpu/bundle.sh) and the checkout; for the
        processes that quantize (`modelopt=True`: `dev served-base`, `merge --quantize`) also
        `$EXTRA_SITE` last (nvidia-modelopt + its deps, scripts/gpu/modelopt-requirements.txt; the
        vLLM bundle carries them: vllm_call.sh defaults it to `$VLLM_SITE`), all behind a shim that makes `import fla` fail (`WORK/nofla`): transformers then takes its torch
        Gated-DeltaNet path (`use_kernel_func_from_hub_with_fallback` falls back on any import
        error; axolotl's Qwen3.5 patch guards its fla imports the same way). On a fresh H200, fla's
        tilelang kernels compile for ~100 s in the first process that runs them (benchmarks/results/
        axolotl_h200_call1_log.txt: 107 s vs 7 s of train runtime); here every such process is short
        (8-layer training, calibration, the canary's float32 reference, whose precision fla's
        kernels do not give), so the compile would be most of the call. Throughput with fla is
        measured in benchmarks/axolotl_h200.py.
        """
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", PIPELINE_CONFIG=str(self.project / "pipeline.yaml"),
                   **NCCL_ENV)  # fmt: skip
        if self.gpu:
            site = os.environ.get("TRAIN_SITE", "/tmp/site")
            extra = os.environ.get("EXTRA_SITE") if modelopt else None
            parts = [str(self.nofla()), site, str(REPO)] + ([extra] if extra else [])
            env["PYTHONPATH"] = ":".join(parts)
            env["PATH"] = f"{site}/bin:{env.get('PATH', '')}"
        else:
            env["PYTHONPATH"] = str(REPO)
        return env

    def nofla(self) -> Path:
        d = self.work / "nofla" / "fla"
        if not (d / "__init__.py").exists():
            d.mkdir(parents=True, exist_ok=True)
            (d / "__init__.py").write_text(
                'raise ImportError("fla is disabled in this process by benchmarks/vllm_h200.py (torch Gated-DeltaNet path)")\n'
            )
        return d.parent

    def common(self) -> list[str]:
        return COMMON + GPU_ONLY if self.gpu else ["--seed", "0"]

    def pipeline_cmd(self) -> list[str]:
        return [sys.executable, "-m", "pipeline"]

    def vllm_cmd(self) -> list[str]:
        if self.gpu:
            return ["python3", "-m", "vllm.entrypoints.cli.main", "serve"]
        return [
            str(REPO / ".fleet-venv" / "bin" / "python"),
            str(REPO / "tests/support/vllm_cpu_launcher.py"),
            "serve",
        ]

    def vllm_env(self, engine: Engine) -> dict:
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", **NCCL_ENV)  # fmt: skip
        env.pop("PYTHONPATH", None)
        if self.gpu:
            env["PYTHONPATH"] = os.environ.get("VLLM_SITE", "/tmp/vsite")
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # no FlashInfer in the bundle (GPU_ONLY says why)
            # one torch.compile / Triton cache for every engine and restart on this machine
            env["VLLM_CACHE_ROOT"] = os.environ.get("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
        else:
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
        return env

    @property
    def project(self) -> Path:
        return self.work / "project"

    # subprocesses ------------------------------------------------------------------------------------------------
    def cli(self, *args, timeout: float = 300, check: bool = True) -> dict:
        """`pipeline ARGS --json` in the project; returns {rc, wall_s, json|stdout, stderr tail}."""
        cmd = [*self.pipeline_cmd(), *map(str, args)]
        t = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=self.pipeline_env(), cwd=REPO,
                               timeout=min(timeout, max(5.0, self.left() + 30)))  # fmt: skip
            rc, so, se = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, so, se = (
                "timeout",
                (e.stdout or b"").decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else (e.stdout or ""),
                "",
            )
        rec = {"cmd": " ".join(cmd[2:]), "rc": rc, "wall_s": round(time.time() - t, 2), "stderr": se[-3000:]}
        rec["json"] = _json_in(so)
        if rec["json"] is None:
            rec["stdout"] = so[-3000:]
        with open(self.out / "cli.jsonl", "a") as f:
            f.write(
                json.dumps({k: v for k, v in rec.items() if k != "json"} | {"at_s": round(self.elapsed, 1)})
                + "\n"
            )
        self.log(f"pipeline {' '.join(map(str, args))[:120]} -> rc {rc} in {rec['wall_s']} s")
        if check and rc != 0:
            raise RuntimeError(f"pipeline {' '.join(map(str, args))} exited {rc}: {(se or so)[-1500:]}")
        return rec

    def start_bg(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        """Start `cmd` in its own process group: stderr to WORK/logs/NAME.log, stdout to WORK/logs/NAME.out."""
        log, out = self.work / "logs" / f"{name}.log", self.work / "logs" / f"{name}.out"
        with open(log, "w") as f, open(out, "w") as o:
            f.write(" ".join(map(str, cmd)) + "\n")
            f.flush()
            proc = subprocess.Popen(list(map(str, cmd)), stdout=o, stderr=f, cwd=REPO,
                                    env=env or self.pipeline_env(), start_new_session=True)  # fmt: skip
        self.bg[name] = (proc, log, time.time())
        self._pid(proc)
        self.log(f"started {name} (pid {proc.pid})")

    def bg_json(self, name: str) -> dict:
        """The JSON object a background `pipeline ... --json` printed on stdout ({} if none)."""
        got = _json_in((self.work / "logs" / f"{name}.out").read_text(errors="replace"))
        return got if isinstance(got, dict) else {}

    def wait_bg(self, name: str, timeout: float) -> dict:
        proc, log, t = self.bg[name]
        try:
            rc = proc.wait(timeout=max(1.0, min(timeout, self.left())))
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = "timeout"
        tail = log.read_text(errors="replace").splitlines()[-40:]
        res = {"rc": rc, "wall_s": round(time.time() - t, 1), "log_tail": tail}
        self.log(f"{name}: rc {rc} after {res['wall_s']} s")
        if rc != 0:
            raise RuntimeError(f"{name} exited {rc}:\n" + "\n".join(tail[-25:]))
        return res

    # engines -----------------------------------------------------------------------------------------------------
    def start_engine(self, e: Engine, port: int) -> Engine:
        if e.name in self.engines and (old := self.engines[e.name].proc) is not None and old.poll() is None:
            return self.engines[e.name]
        e.port = port
        cmd = [
            *self.vllm_cmd(),
            str(e.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.common(),
            *e.args,
        ]
        if e.served_name:
            cmd += ["--served-model-name", e.served_name]
        log = self.work / "logs" / f"{e.name}.log"
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            e.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.vllm_env(e), cwd=self.work,
                                      start_new_session=True)  # fmt: skip
        e.started = time.time()
        self._pid(e.proc)
        self.engines[e.name] = e
        self.log(f"engine {e.name} starting on :{port} ({e.model.name})")
        return e

    def wait_engine(self, name: str, timeout: float) -> Engine:
        e = self.engines[name]
        if e.ready_s is not None:
            return e
        limit = time.time() + max(1.0, min(timeout, self.left()))
        while time.time() < limit:
            if e.proc is not None and e.proc.poll() is not None:
                raise RuntimeError(f"engine {name} exited {e.proc.returncode}:\n{engine_tail(self, name)}")
            try:
                if httpx.get(f"{e.url}/health", timeout=2).status_code == 200:
                    e.ready_s = round(time.time() - e.started, 1)
                    self.log(f"engine {name} ready after {e.ready_s} s")
                    return e
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"engine {name} not ready after {timeout:.0f} s:\n{engine_tail(self, name)}")

    def _pid(self, proc: subprocess.Popen) -> None:
        """Process groups this run started (scripts/gpu/vllm_call.sh ends those a killed call left)."""
        with open(self.work / "pids", "a") as f:
            f.write(f"{proc.pid}\n")

    def stop_engine(self, name: str, settle_s: float = 60.0) -> dict:
        """Stop engine `name` (its process group) and wait until the GPU holds no process any more
        (`gpu_apps`, at most `settle_s`), so that the next engine starts and is timed alone. Returns
        {stopped, gpu_apps_after, waited_s}."""
        e = self.engines.get(name)
        stopped = e is not None and e.proc is not None and e.proc.poll() is None
        if not stopped:  # nothing of ours to wait for
            return {"stopped": False, "gpu_apps_after": None, "waited_s": 0.0}
        _kill(e.proc)
        t = time.time()
        apps = gpu_apps()
        while apps and time.time() - t < settle_s:
            time.sleep(1.0)
            apps = gpu_apps()
        self.log(f"engine {name} stopped; GPU processes now: {apps}")
        return {"stopped": stopped, "gpu_apps_after": apps, "waited_s": round(time.time() - t, 1)}

    def exclusive(self, keep: str | None, wait_s: float = 600.0) -> dict:
        """Make engine `keep` (None: no engine) the GPU's only user before a timed row: stop every other
        engine this run started and wait for the background jobs (builds, trainings) to end. Returns
        {stopped, waited_for, gpu_apps}. Raises RuntimeError when a job is still running after `wait_s`
        (the row is then not measured, and the stage's error says why)."""
        stopped = [
            n for n, e in self.engines.items() if n != keep and e.proc is not None and e.proc.poll() is None
        ]
        for n in stopped:
            self.stop_engine(n, settle_s=0)
        waited = []
        for n, (proc, _, _) in self.bg.items():
            if proc.poll() is None:
                waited.append(n)
                try:
                    proc.wait(timeout=max(1.0, min(wait_s, self.left())))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"background job {n} still runs on the GPU: no timed row beside it"
                    ) from None
        if stopped:
            time.sleep(3.0)  # the killed engines' memory returns to the driver
        res = {"stopped": stopped, "waited_for": waited, "gpu_apps": gpu_apps()}
        self.log(f"GPU exclusive to {keep}: {res}")
        return res

    def stop_all(self) -> None:
        for e in self.engines.values():
            if e.proc is not None and e.proc.poll() is None:
                _kill(e.proc)
        for proc, _, _ in self.bg.values():
            if proc.poll() is None:
                _kill(proc)


def _json_in(text: str):
    """The JSON value `text` holds (a `--json` command's stdout), or one starting at its first { or [."""
    for start in [0] + [i for i in (text.find("{"), text.find("[")) if i > 0]:
        try:
            return json.loads(text[start:])
        except ValueError:
            continue
    return None


def engine_tail(ctx: Ctx, name: str, n: int = 40) -> str:
    p = ctx.work / "logs" / f"{name}.log"
    return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else "(no log)"


# plan fleet64 --------------------------------------------------------------------------------------------------------
# The fleet's own size: `pipeline dev real-base --layers 64` (52 GB bf16) in /dev/shm (the host's 128 GiB
# of RAM; its 64 GiB disk cannot hold it beside the ~17 GB NVFP4 build), `pipeline dev served-base` to
# WORK (disk), the bf16 copy deleted, then one engine alone on the GPU: decode rows at batch 1, 8 and 32,
# base vs an r16 adapter on the shipped config's targets. Random weights: no MTP (nothing to predict).
SHM = Path(os.environ.get("SHM_DIR", "/dev/shm"))
