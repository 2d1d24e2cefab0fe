#!/usr/bin/env bash
# One device call on a lent H200 (`nvidia-h200`): the trained stand-in base (issue 36) and what is
# measured on it without vLLM: `pipeline dev trained-base`, the packing check on it (issue 39), and
# its served NVFP4 + MTP build (`pipeline dev served-base`, made before the packing check and kept in
# /dev/shm for the vLLM call that follows on the same warm machine: `BASE=/dev/shm/tb bash scripts/gpu/vllm_call.sh trained`).
#
#   OUT=... bash scripts/gpu/trained_call.sh [MINUTES]          # run from the checkout the device tool sends
#
# Carried (device `carry`): .whl/gpu/py.tar.xz, .whl/gpu/kern.tar.xz (scripts/gpu/bundle.sh) and
# .whl/vllm/modelopt.tar.xz + .whl/vllm/SHA256SUMS.modelopt (scripts/gpu/vllm_bundle.sh). Writes
# $OUT/trained_base.json, $OUT/packing_check.json, the logs ($OUT returns 8 files at most).
set -uo pipefail
MIN=${1:-3.5}
: "${OUT:?OUT must name the results folder}"
cd "$(dirname "$0")/../.."
ROOT=$PWD
SITE=/tmp/site
TB=/dev/shm/tb
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled
if [ ! -e $SITE/.ok ]; then
    mkdir -p $SITE && tar xJf .whl/gpu/py.tar.xz -C $SITE && tar xJf .whl/gpu/kern.tar.xz -C $SITE && touch $SITE/.ok
fi
cp -a scripts/gpu/stubs/. $SITE/
[ -e .whl/vllm/modelopt.tar.xz ] && bash scripts/gpu/vllm_unpack.sh .whl/vllm >/dev/null 2>&1
export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH
el "bundle ready; $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
lscpu | grep -E 'Model name' >"$OUT/host.txt"
python3 -c "import sys, torch, transformers, fla; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" >>"$OUT/host.txt" 2>&1
python3 -c "import sysconfig; print('corpus root', sysconfig.get_paths()['purelib'])" >>"$OUT/host.txt"
el "$(tail -2 "$OUT/host.txt" | tr '\n' ' ')"

if [ ! -e $TB/trained_base.json ]; then
    timeout -k 10 420 python3 -m pipeline dev trained-base $TB --layers 8 --hidden 1024 --minutes "$MIN" \
        --device cuda --json >"$OUT/trained_summary.json" 2>"$OUT/trained.log"
    el "trained-base exit $?"
fi
cp $TB/trained_base.json $TB/config.json "$OUT/" 2>/dev/null  # $OUT returns 8 files at most
cat "$OUT/trained_summary.json" 2>/dev/null
tail -5 "$OUT/trained.log"

if [ -e $TB/trained_base.json ] && [ -e /tmp/msite/.ok ] && [ ! -e /dev/shm/tb-nvfp4/hf_quant_config.json ]; then
    PYTHONPATH=$SITE:$ROOT:/tmp/msite timeout -k 10 200 python3 -m pipeline dev served-base $TB /dev/shm/tb-nvfp4 \
        --device cuda >"$OUT/served.log" 2>&1
    el "served-base exit $?: $(ls /dev/shm/tb-nvfp4 2>/dev/null | tr '\n' ' ')"
    tail -3 "$OUT/served.log"
fi
if [ -e $TB/trained_base.json ] && [ ! -e "$OUT/packing_check.json" ]; then
    timeout -k 10 400 python3 benchmarks/packing_check.py --base $TB --out "$OUT/packing_check.json" --no-grads \
        --samples 24 --row 4096 >"$OUT/packing.log" 2>&1
    el "packing check exit $?: $(tail -1 "$OUT/packing.log" | cut -c1-600)"
fi
el "end"
