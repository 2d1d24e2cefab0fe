#!/usr/bin/env bash
# One device call on a lent H200 (`nvidia-h200`): the fleet's kind of engine end to end (issue 23),
# vLLM 0.25.1 + ModelOpt NVFP4 + MTP + hot-loaded LoRA, driven by the `pipeline` CLI.
#
#   OUT=... [BASE=DIR] bash scripts/gpu/vllm_call.sh [PLAN] [DEADLINE_S]
#   PLAN: main (default) | main2 | sweep | prep | trained (needs BASE) | fleet64 (64-layer base in /dev/shm)
#
# BASE: a prebuilt bf16 base (e.g. `pipeline dev trained-base /dev/shm/tb`) the plans use instead of
# building the random 8-layer real-geometry one (`run --base`); plan trained measures it bf16 vs NVFP4.
#
# prep: the first call of a fresh machine, while the vLLM bundle's last parts are still to come (a call
# carries 64 MiB): base, MTP layer, both trainings, the NVFP4 checkpoint and the merged NVFP4 model, all
# reused by main on the same machine. Needs the training bundle and nvidia-modelopt only.
#
# Run from the checkout the device tool sends (tracked files are enough). Needs, unpacked before on
# the machine (outside the checkout; a warm machine keeps them between calls):
#   $VLLM_SITE  (default /tmp/vsite)  the vLLM 0.25.1 bundle (scripts/gpu/vllm_bundle.sh)
#   $TRAIN_SITE (default /tmp/site)   the training bundle (scripts/gpu/bundle.sh): axolotl, MLflow client ...
#   $EXTRA_SITE (default $VLLM_SITE) nvidia-modelopt + omegaconf + pulp + nvidia-ml-py
#               (scripts/gpu/modelopt-requirements.txt; scripts/gpu/vllm_bundle.sh puts them in the vLLM bundle)
# Everything else (the 8-layer base, the NVFP4 checkpoint, adapters, the project) is built in $WORK
# (default /tmp/vw) and reused by a later call on the same machine (`.done` markers), as is vLLM's
# torch.compile / Triton cache ($VLLM_CACHE_ROOT, default /tmp/vllm-cache).
#
# benchmarks/vllm_h200.py runs the stages; each writes $OUT/stages/<stage>.json as it ends and a stage
# that would end after DEADLINE_S (default 500 s of driver time) is skipped, so the record
# ($OUT/vllm_h200.json) is written even when time runs short. Logs of every engine and background
# job: $OUT/logs.tgz. Exit status: the driver's.
set -uo pipefail
PLAN=${1:-main}
DEADLINE=${2:-500}
: "${OUT:?OUT must name the results folder}"
cd "$(dirname "$0")/../.."
ROOT=$PWD
export VLLM_SITE=${VLLM_SITE:-/tmp/vsite} TRAIN_SITE=${TRAIN_SITE:-/tmp/site}
export EXTRA_SITE=${EXTRA_SITE:-$VLLM_SITE}  # nvidia-modelopt for the quantizing processes (the vLLM bundle carries it)
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
WORK=${WORK:-/tmp/vw}
mkdir -p "$WORK" "$OUT" "$VLLM_CACHE_ROOT"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }

# engines and jobs a killed earlier call on this machine left behind (their process groups, by pid)
if [ -f "$WORK/pids" ]; then
    while read -r pid; do kill -TERM -- "-$pid" 2>/dev/null; done <"$WORK/pids"
    sleep 2
    while read -r pid; do kill -KILL -- "-$pid" 2>/dev/null; done <"$WORK/pids"
    rm -f "$WORK/pids"
fi

{
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv
    df -h /tmp
    echo "VLLM_SITE=$VLLM_SITE TRAIN_SITE=$TRAIN_SITE EXTRA_SITE=${EXTRA_SITE:-}"
    PYTHONPATH=$VLLM_SITE python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    PYTHONPATH=$TRAIN_SITE:$ROOT${EXTRA_SITE:+:$EXTRA_SITE} python3 -c \
        "import axolotl, mlflow, modelopt, pipeline; print('axolotl', axolotl.__version__, 'modelopt', modelopt.__version__)"
} >"$OUT/host.txt" 2>&1
el "$(grep -E '^(vllm|axolotl) ' "$OUT/host.txt" | tr '\n' ' ')"
if [ "$PLAN" != prep ] && ! grep -q '^vllm 0\.25\.' "$OUT/host.txt"; then
    el "no vLLM 0.25 under VLLM_SITE=$VLLM_SITE (see host.txt): unpack scripts/gpu/vllm_bundle.sh's output there first"
    exit 3
fi
if ! grep -q '^axolotl ' "$OUT/host.txt"; then
    el "the training bundle or modelopt is missing (see host.txt): TRAIN_SITE=$TRAIN_SITE EXTRA_SITE=${EXTRA_SITE:-}"
    exit 3
fi

PYTHONPATH=$TRAIN_SITE:$ROOT timeout -k 10 $((DEADLINE + 45)) python3 benchmarks/vllm_h200.py run "$PLAN" \
    --work "$WORK" --out "$OUT" --deadline-s "$DEADLINE" ${BASE:+--base "$BASE"} ${TASK_ADAPTERS:+--task-adapters "$TASK_ADAPTERS"} 2>&1 | tee "$OUT/driver.log"
rc=${PIPESTATUS[0]}
el "driver exit $rc"
tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
[ -f "$OUT/vllm_h200.json" ] && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r['done_when'])); print('failed:', r['failed'])" "$OUT/vllm_h200.json"
el "end"
exit "$rc"
