#!/usr/bin/env bash
# Stage what one GPU call needs into a git-ignored folder of the checkout the device tool sends
# (the bundle from scripts/gpu/bundle.sh, the pipeline package, shipped configs, the benchmark
# drivers and the synthetic datasets): `carry` that folder and run
# `cd FOLDER && bash scripts/gpu/h200_call.sh PLAN` there.
#
#   scripts/gpu/stage.sh DEST BUNDLE_DIR DATA_DIR
#
# The device tool carries at most 64 MiB (tree + carried paths): the bundle is ~60 MB of it.
set -euo pipefail
DEST=${1:?dest}
BUNDLE=${2:?bundle dir (scripts/gpu/bundle.sh output)}
DATA=${3:?data dir (benchmarks/axolotl_h200.py data output)}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$DEST"
mkdir -p "$DEST/bundle" "$DEST/data" "$DEST/benchmarks" "$DEST/scripts"
cp -a "$SRC/pipeline" "$SRC/axolotl_configs" "$DEST/"
cp -a "$SRC/scripts/gpu" "$DEST/scripts/"
cp "$SRC"/benchmarks/{axolotl_h200.py,packing_check.py,recompute_sweep.py,validate_static.py,qwen36_27b.py} "$DEST/benchmarks/"
cp "$BUNDLE"/py.tar.xz "$BUNDLE"/kern.tar.xz "$DEST/bundle/"
cp "$DATA"/*.jsonl "$DATA"/lengths.json "$DEST/data/"
find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$DEST"
