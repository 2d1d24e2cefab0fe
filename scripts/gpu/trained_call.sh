#!/usr/bin/env bash
# Device calls on a lent H200 (`nvidia-h200`) for the trained stand-in base (issues 36, 38, 39), in this order on
# one warm machine (a call that finds the machine given back starts over with `base`):
#
#   OUT=... bash scripts/gpu/trained_call.sh base [MINUTES]   # call 1: carries .whl/gpu/{py,kern}.tar.xz,
#        .whl/vllm/modelopt.tar.xz + SHA256SUMS.modelopt. `pipeline dev trained-base` into /dev/shm/tb, its NVFP4
#        build (`pipeline dev served-base`) into /tmp/vw/tb-nvfp4 (where plan trained looks, with its marker),
#        then, in the background (setsid: they outlive the call), benchmarks/trained_adapters.py (two task
#        adapters by `pipeline train`, their PEFT references, acceptance estimates and drafters, into /tmp/ta)
#        and the float32 packing check on the trained base (into /tmp/pc).
#   OUT=... bash scripts/gpu/trained_call.sh wait [SECONDS]   # calls 2-3: report the background jobs (waiting up
#        to SECONDS for them), copy their results to OUT. Carry the vLLM bundle's parts meanwhile and stash
#        them with scripts/gpu/vllm_unpack.sh .whl/vllm.
#   then: BASE=/dev/shm/tb TASK_ADAPTERS=/tmp/ta/adapters.json EXTRA_SITE=/tmp/msite OUT=... \
#         bash scripts/gpu/vllm_call.sh trained DEADLINE      # one engine at a time; reuses what an earlier
#         call measured, so a second call continues where the first stopped
#
# $OUT returns 8 files at most: each step writes fewer.
set -uo pipefail
STEP=${1:-base}
: "${OUT:?OUT must name the results folder}"
cd "$(dirname "$0")/../.."
ROOT=$PWD
SITE=/tmp/site
TB=/dev/shm/tb
NV=/tmp/vw/tb-nvfp4
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled
export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH

if [ "$STEP" = base ]; then
    MIN=${2:-3.0}
    if [ ! -e $SITE/.ok ]; then
        mkdir -p $SITE && tar xJf .whl/gpu/py.tar.xz -C $SITE && tar xJf .whl/gpu/kern.tar.xz -C $SITE && touch $SITE/.ok
    fi
    cp -a scripts/gpu/stubs/. $SITE/
    [ -e .whl/vllm/modelopt.tar.xz ] && bash scripts/gpu/vllm_unpack.sh .whl/vllm >/dev/null 2>&1
    el "bundle ready; $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
    lscpu | grep -E 'Model name' >"$OUT/host.txt"
    python3 -c "import sys, torch, transformers, fla; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" >>"$OUT/host.txt" 2>&1
    if [ ! -e $TB/trained_base.json ]; then
        timeout -k 10 420 python3 -m pipeline dev trained-base $TB --layers 8 --hidden 1024 --minutes "$MIN" \
            --device cuda --json >"$OUT/trained_summary.json" 2>"$OUT/trained.log"
        el "trained-base exit $?"
    fi
    cp $TB/trained_base.json "$OUT/" 2>/dev/null
    tail -3 "$OUT/trained.log"
    if [ -e $TB/trained_base.json ] && [ -e /tmp/msite/.ok ] && [ ! -e $NV/hf_quant_config.json ]; then
        mkdir -p /tmp/vw
        PYTHONPATH=$SITE:$ROOT:/tmp/msite timeout -k 10 200 python3 -m pipeline dev served-base $TB $NV \
            --device cuda >"$OUT/served.log" 2>&1
        el "served-base exit $?: $(ls $NV 2>/dev/null | tr '\n' ' ')"
        # the marker plan trained checks (benchmarks/vllm_h200/stages.py nvfp4_current / mark_built)
        python3 - <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from vllm_h200.context import Ctx
from vllm_h200.stages import mark_built
c = Ctx("trained", Path("/tmp/vw"), Path("/tmp"), 1.0, True)
c.base_given = Path("/dev/shm/tb")
mark_built(c)
EOF
    fi
    if [ -e $TB/trained_base.json ]; then
        # background jobs: the torch Gated-DeltaNet path for the short adapter jobs (no fla: its kernels'
        # first-use compile would be most of their time), fla for the packing check (it checks fla's varlen path)
        mkdir -p /tmp/ta/nofla/fla /tmp/pc
        echo 'raise ImportError("fla disabled for the short adapter jobs (scripts/gpu/trained_call.sh)")' >/tmp/ta/nofla/fla/__init__.py
        [ -e $NV/hf_quant_config.json ] && SERVED="--served $NV" || SERVED=""
        PYTHONPATH=/tmp/ta/nofla:$SITE:$ROOT setsid nohup python3 benchmarks/trained_adapters.py $TB /tmp/ta $SERVED \
            --device cuda >/tmp/ta/run.log 2>&1 </dev/null &
        setsid nohup timeout -k 10 900 python3 benchmarks/packing_check.py --base $TB --out /tmp/pc/packing_check.json \
            --no-grads --samples 24 --row 4096 >/tmp/pc/packing.log 2>&1 </dev/null &
        sleep 20
        el "background: adapters $(tail -c 300 /tmp/ta/run.log | tr '\n' ' ') | packing $(tail -c 200 /tmp/pc/packing.log | tr '\n' ' ')"
    fi
    el "end"
    exit 0
fi

if [ "$STEP" = wait ]; then
    LIMIT=${2:-0}
    while [ $(($(date +%s) - T0)) -lt "$LIMIT" ] && { [ ! -e /tmp/ta/adapters.json.done ] || [ ! -e /tmp/pc/packing_check.json ]; }; do
        sleep 5
    done
    el "adapters: $([ -e /tmp/ta/adapters.json.done ] && echo done || echo running); packing check: $([ -e /tmp/pc/packing_check.json ] && echo done || echo running)"
    tail -5 /tmp/ta/run.log
    tail -3 /tmp/pc/packing.log
    cp /tmp/ta/run.log "$OUT/adapters_run.log" 2>/dev/null
    cp /tmp/pc/packing.log /tmp/pc/packing_check.json "$OUT/" 2>/dev/null
    [ -e /tmp/ta/adapters.json ] && cp /tmp/ta/adapters.json "$OUT/"
    (cd /tmp/ta && tar czf "$OUT/adapter_logs.tgz" train-*.log drafter-*/drafter.json 2>/dev/null)
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    el "end"
    exit 0
fi
echo "unknown step $STEP: base | wait" >&2
exit 2
