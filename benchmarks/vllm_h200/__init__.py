"""The fleet's own kind of engine on one H200: vLLM 0.25.1, ModelOpt NVFP4 + MTP, hot-loaded LoRA, via `pipeline`.

A package (issue 37 item 4); `benchmarks/vllm_h200.py` is its command line. Modules, in reading order:

| module | what |
|---|---|
| `plans` | the plans (stage lists), what each stage needs, the runner `run`, every engine's command line |
| `engines` | the fleet's flags, each plan's engines, processes on the GPU |
| `context` | `Ctx`: paths (the bf16 base, its NVFP4 build), environments, CLI calls, engines started and stopped, `exclusive` |
| `measure` | completions, /metrics, decode rows (warm-up + 3 repeats: median, min-max), greedy agreement |
| `stages` | setting up a fleet: host, base, MTP layer, trainings, NVFP4 build, project, engines, registrations |
| `fleet` | the release path and checks: canary, publish, decode, rollback, stale KV, merged model |
| `speed` | the settings sweep, publish latency, plan fleet64 (the 64-layer checkpoint) |
| `trained` | plan trained: a trained base's bf16 then NVFP4 engine |
| `record` | the record `OUT/vllm_h200.json`, its "Done when", its RESULTS.md section |
| `cli` | `run`, `argv`, `record` |


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

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `pipeline` for every module (the driver also runs from a bare checkout)
    sys.path.insert(0, str(REPO))
