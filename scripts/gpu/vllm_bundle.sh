#!/usr/bin/env bash
# Build the bundle that lets the lent H200 (no package index) run vLLM 0.25.1 with a ModelOpt NVFP4
# Qwen3.5 checkpoint, LoRA and MTP, and quantize with nvidia-modelopt: the fleet's own kind of engine.
#
# Target host: x86-64, CPython 3.12, torch 2.11.0+cu130, Triton 3.6, transformers 5.17, numpy, numba,
# aiohttp, httpx, uvloop, prometheus-client, opencv, pillow, sentencepiece, tiktoken ... already there
# (the device's KINDS.md lists the image). vLLM 0.22.0-0.25.1 pin torch==2.11.0 and the 0.25.1 wheel
# (cp38-abi3, manylinux_2_28) links libcudart.so.13: it matches the image (docs/vllm.md "GPU engine").
# Run this on any x86-64 machine where pip reaches PyPI (the wheels are chosen for cp312 by pip's
# --python-version, not by the interpreter running this script):
#
#   scripts/gpu/vllm_bundle.sh [OUT_DIR]          # default .whl/vllm (git-ignored)
#
# Writes OUT_DIR/vllm.tar.xz.NN (the engine, in parts of PART_MB, default 11 MB, so that parts fill what a
# device call carries next to the training bundle: 64 MiB with the checkout), OUT_DIR/modelopt.tar.xz (the
# quantizer, ~3 MB, unpacked on its own: it is needed before the engine's last part arrives) and
# OUT_DIR/SHA256SUMS. On the device, scripts/gpu/vllm_unpack.sh collects the parts a call carries outside
# the checkout, checks every sum and unpacks into /tmp/vsite once all parts are there; modelopt.tar.xz
# goes to /tmp/msite (vllm_call.sh's EXTRA_SITE).
#
# What is in it: scripts/gpu/vllm-requirements.txt and scripts/gpu/modelopt-requirements.txt (pinned,
# sha256-checked; their headers say how the lists were made and what is left out on purpose). What is cut from the wheels, each never loaded on this path:
#   vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so  (190 MB; imported in try/except, FA2 is the pre-Hopper
#                                             path: FA3's _vllm_fa3_C serves Hopper)
#   vllm/_moe_C_stable_libtorch.abi3.so       (46 MB; imported under contextlib.suppress(ImportError) in
#                                             platforms/cuda.py; only fused-MoE ops, Qwen3.6-27B is dense)
#   vllm/vllm-rs                              (38 MB; the Rust front end, only with VLLM_USE_RUST_FRONTEND)
#   vllm/_flashmla*_C.abi3.so                 (MLA attention, DeepSeek only)
#   vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so (one build per Python; 3.12's is kept)
#   xgrammar/lib/libxgrammar.a                (static library for C++ builds; the bindings .so is kept)
#   pulp/solverdir (in modelopt.tar.xz)       (CBC binaries; modelopt imports pulp for NAS search only)
#   mistral_common/data, pycountry/locales    (tokenizer files and translations no Qwen path reads)
# No stubs: every module the engine imports on this path is the real package.
#
# Check it before spending device time (imports what `vllm serve` and the quantizer import, against a
# Python 3.12 virtualenv that mirrors the image: torch 2.11.0 from PyPI is the same cu130 build):
#   scripts/gpu/vllm_bundle.sh --check OUT_DIR /path/to/py312-venv/bin/python
set -euo pipefail

PART_MB=${PART_MB:-11}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}

if [ "${1:-}" = "--check" ]; then
    OUT=${2:?bundle dir}
    SIMPY=${3:?python of a virtualenv that mirrors the image}
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    (cd "$OUT" && sha256sum -c --quiet SHA256SUMS)
    (cd "$OUT" && sha256sum -c --quiet SHA256SUMS.modelopt)
    cat "$OUT"/vllm.tar.xz.* | xz -dc | tar -C "$SITE" -xf -
    mkdir -p "$SITE/mo" && xz -dc "$OUT/modelopt.tar.xz" | tar -C "$SITE/mo" -xf -
    PYTHONPATH=$SITE:$SITE/mo "$SIMPY" "$HERE/vllm_import_check.py"
    exit $?
fi

OUT=${1:-.whl/vllm}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/wheels" "$OUT/stage" "$OUT"/vllm.tar.xz.* "$OUT"/modelopt.tar.xz && mkdir -p "$OUT/wheels"

PLATFORMS=()
for n in 39 38 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

echo "downloading wheels into $OUT/wheels (sha256-checked)" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --require-hashes -r "$HERE/vllm-requirements.txt" -d "$OUT/wheels/engine"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --require-hashes -r "$HERE/modelopt-requirements.txt" -d "$OUT/wheels/modelopt"

unpack() { # DEST WHEEL...: like `pip install --target` (dist-info kept: importlib.metadata works)
    local dst=$1 w d sub
    shift
    mkdir -p "$dst"
    for w in "$@"; do
        "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$dst"
    done
    for d in "$dst"/*.data; do
        [ -d "$d" ] || continue
        for sub in purelib platlib; do [ -d "$d/$sub" ] && cp -a "$d/$sub/." "$dst/"; done
        rm -rf "$d"
    done
    find "$dst" -name __pycache__ -prune -exec rm -rf {} +
}
# same wheels -> same bytes: fixed order, times and owners; xz's multi-threaded block layout is fixed by -T2
pack() { tar -C "$1" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | xz -T2 -6; }

STAGE=$OUT/stage
unpack "$STAGE/modelopt" "$OUT"/wheels/modelopt/*.whl
rm -rf "$STAGE"/modelopt/pulp/solverdir
pack "$STAGE/modelopt" >"$OUT/modelopt.tar.xz"

STAGE=$OUT/stage/engine
unpack "$STAGE" "$OUT"/wheels/engine/*.whl
chmod +x "$STAGE"/vllm/*.so 2>/dev/null || true

rm -f "$STAGE"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$STAGE"/vllm/_moe_C_stable_libtorch.abi3.so \
    "$STAGE"/vllm/vllm-rs "$STAGE"/vllm/_flashmla_C.abi3.so "$STAGE"/vllm/_flashmla_extension_C.abi3.so
for v in 310 311 313 314; do rm -f "$STAGE"/vllm/third_party/deep_gemm/_C.cpython-"$v"-*.so; done
rm -rf "$STAGE"/xgrammar/lib/libxgrammar.a "$STAGE"/mistral_common/data "$STAGE"/pycountry/locales

echo "compressing $(du -sh "$STAGE" | cut -f1)" >&2
pack "$STAGE" | split -b "${PART_MB}m" -d -a 2 - "$OUT/vllm.tar.xz."
(cd "$OUT" && sha256sum vllm.tar.xz.* >SHA256SUMS && sha256sum modelopt.tar.xz >SHA256SUMS.modelopt && cat SHA256SUMS* >&2)
rm -rf "$OUT/stage"
du -ch "$OUT"/vllm.tar.xz.* "$OUT"/modelopt.tar.xz >&2
