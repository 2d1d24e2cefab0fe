#!/usr/bin/env bash
# One device call on a lent H200 machine: run from the staged folder (scripts/gpu/stage.sh),
# `bash scripts/gpu/h200_call.sh PLAN [DEADLINE_S]`; results under $OUT.
#
# Self-contained on a fresh machine: unpacks the bundle (scripts/gpu/bundle.sh) into /tmp/site and
# measures the bf16 matmul peak of each GPU (once per machine), then runs the plan of
# benchmarks/axolotl_h200.py (`pipeline train` through axolotl's CLI), which builds the random
# real-geometry bases it needs (`pipeline dev real-base`, on the GPU; once per machine: a call right
# after another, on the still-warm machine, skips the 80 s 64-layer build and the tilelang compile).
# DEADLINE_S (default 480): no experiment starts later, and each is cut to what is left + 60 s.
# POLICY_RECORDS: records.jsonl files of an earlier call (plan h200-b takes h200-a's recompute policy).
set -uo pipefail
PLAN=${1:?plan}
DEADLINE=${2:-480}
: "${OUT:?OUT must name the results folder}"
cd "$(dirname "$0")/../.."
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled
SITE=/tmp/site
WORK=/tmp/w
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }

if [ ! -e $SITE/.ok ]; then
    mkdir -p $SITE && tar xJf bundle/py.tar.xz -C $SITE && tar xJf bundle/kern.tar.xz -C $SITE && touch $SITE/.ok
fi
cp -a scripts/gpu/stubs/. $SITE/  # stubs may be newer than the bundle
export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH
el "bundle ready"
mkdir -p $WORK/logs && cp -r data $WORK/
{
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.sm --format=csv
    df -h /tmp /dev/shm
    python3 -c "import sys, torch, transformers, peft, accelerate, axolotl, fla, liger_kernel, tilelang, triton; \
print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, \
'accelerate', accelerate.__version__, 'axolotl', axolotl.__version__, 'fla', fla.__version__, 'liger', \
liger_kernel.__version__ if hasattr(liger_kernel, '__version__') else '?', 'tilelang', tilelang.__version__, 'triton', triton.__version__)"
} >"$OUT/host.txt" 2>&1
el "$(tail -1 "$OUT/host.txt")"
[ -f $WORK/peaks.json ] || python3 benchmarks/axolotl_h200.py peaks --work $WORK >>"$OUT/host.txt" 2>&1
el "peaks $(cat $WORK/peaks.json)"

# shellcheck disable=SC2086
python3 benchmarks/axolotl_h200.py run "$PLAN" --work $WORK --out "$OUT" --deadline-s "$DEADLINE" \
    --policy-records ${POLICY_RECORDS:-}
el "plan $PLAN done"
python3 benchmarks/axolotl_h200.py summary "$OUT" --json "$OUT/summary.json" || true
if [ "$PLAN" = call2 ] || [ "$PLAN" = ddp2 ]; then  # adapter layout 1 vs 2 GPUs, `pipeline validate`
    timeout 60 python3 benchmarks/axolotl_h200.py adapters --work $WORK --out "$OUT/adapters.json" --plan "$PLAN" || true
    el "adapter checks done"
fi
tar czf "$OUT/logs-$PLAN.tgz" -C $WORK logs
du -sh $WORK/real* 2>/dev/null
df -h /tmp | tail -1
el "end"
