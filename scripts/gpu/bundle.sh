#!/usr/bin/env bash
# Build the Python bundle that lets `pipeline train` (axolotl 0.19 + fla/tilelang + Liger + MLflow's
# client) run on a GPU host that reaches no package index.
#
# Target host: x86-64, CPython 3.12, with torch 2.11 (CUDA 13), Triton 3.6, torchvision, numpy,
# pyarrow, xxhash, safetensors, typer, rich, httpx, pyyaml, requests, jinja2, protobuf, pandas ...
# already installed (the lent H200 image: docs/training.md "GPU host without a package index").
# Run this on any x86-64 machine where pip reaches PyPI (Python >= 3.10; the wheels are chosen for
# cp312 by pip's --python-version, not by the interpreter running this script).
#
#   scripts/gpu/bundle.sh [OUT_DIR]      # default .whl/gpu (git-ignored)
#
# Writes OUT_DIR/py.tar.xz (axolotl and what `axolotl train` + `pipeline train` import that the
# image lacks, ~20 MB) and OUT_DIR/kern.tar.xz (flash-linear-attention + its tilelang backend and
# z3, ~40 MB), plus OUT_DIR/SHA256SUMS. On the GPU host
# then (as scripts/gpu/h200_call.sh does) `tar xJf` both into SITE_DIR and
# `export PYTHONPATH=SITE_DIR PATH=SITE_DIR/bin:$PATH`.
#
# Versions: what pip resolved for axolotl==0.19.0 in the project's CPU virtualenv (the CI stack),
# except transformers/peft/accelerate/tokenizers/huggingface_hub, which come from the image
# (transformers 5.17, peft 0.21, accelerate 1.15: the pins of axolotl 0.20; a `pipeline train` of
# the tiny base with exactly this bundle on CPython 3.12 + torch 2.11 + those versions passed).
# fla 0.6.0 instead of axolotl's pin 0.5.2: the version measured on the H200
# (benchmarks/RESULTS.md); both dispatch the Hopper backward to tilelang.
# Left out although a wheel of the virtualenv: GitPython, uvicorn, greenlet (MLflow server/git
# features; a sqlite client run does not import them).
#
# Stubs instead of wheels (imported by `axolotl train` but unused by a bf16 LoRA run):
#   wandb        (20 MB; axolotl's callbacks import it at top level; a run with use_wandb fails
#                 loudly on first use, never silently)
#   bitsandbytes (43 MB of CUDA libraries; needed only for 8/4-bit bases and 8-bit optimizers:
#                 the stub's classes raise on construction, so a QLoRA/8-bit config fails loudly)
# Telemetry: posthog is carried as the real package (138 kB); `pipeline train` sets
# AXOLOTL_DO_NOT_TRACK=1, and the host reaches nothing anyway.
set -euo pipefail

OUT=${1:-.whl/gpu}
rm -rf "$OUT/wheels" && mkdir -p "$OUT/wheels"  # fresh: a stale wheel would end up in the bundle
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}

PLATFORMS=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

# axolotl train (+ the Liger integration) on top of the image
TRAIN=(
    axolotl==0.19.0
    datasets==4.8.4 trl==1.9.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2025.10.0
    pydantic==2.12.5 pydantic_core==2.41.5 pydantic-extra-types==2.11.1 annotated-types==0.8.0
    typing-inspection==0.4.5 addict==2.4.0 fire==0.7.1 termcolor==3.3.0 backoff==2.2.1
    torchao==0.17.0 kernels==0.16.2 kernels-data==0.16.2 evaluate==0.4.1 fastcore==2.2.41
    mistral_common==1.11.5 pycountry==26.2.16 python-dotenv==1.0.1 platformdirs==4.14.9
    distro==1.9.0 defusedxml==0.7.1 chardet==6.0.0.post1 brotli==1.2.1 zstandard==0.22.0
    pytz==2026.6 sniffio==1.3.1 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 posthog==6.7.11
    liger_kernel==0.8.1 tomlkit==0.13.3
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
# published as source only (pure Python): built into wheels here
SDIST_ONLY=(axolotl-contribs-lgpl==0.0.7 axolotl-contribs-mit==0.0.6)
# pipeline itself (config, MLflow client with a sqlite store: run, params, metrics, artifacts)
PIPELINE=(
    pydantic-settings==2.12.0 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 SQLAlchemy==2.1.9
    alembic==1.20.1 Mako==1.4.3 sqlparse==0.6.1 cachetools==7.3.3
    databricks-sdk==0.162.0 importlib_metadata==9.1.0 fastapi==0.163.2 starlette==0.52.1
    annotated-doc==0.0.7 cryptography==50.0.2 cffi==2.1.1 pycparser==2.23
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2
)
# Gated-DeltaNet kernels; tilelang is fla's Hopper backend while Triton < 3.7.1
KERNELS=(
    fla-core==0.6.0 flash-linear-attention==0.6.0 tilelang==0.1.15 z3-solver==4.15.4.0
    apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5
)

download() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$OUT/wheels/$1" "${@:2}"
}
echo "downloading wheels into $OUT/wheels" >&2
download py "${TRAIN[@]}" "${PIPELINE[@]}"
download kern "${KERNELS[@]}"
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels/py" "${SDIST_ONLY[@]}"

unpack() { # unpack wheels like `pip install --target` (dist-info kept: importlib.metadata works)
    local dst=$1
    shift
    rm -rf "$dst" && mkdir -p "$dst"
    for w in "$@"; do
        "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$dst"
    done
    # *.data/purelib|platlib -> top level (pip's layout); scripts and headers are not needed
    for d in "$dst"/*.data; do
        [ -d "$d" ] || continue
        for sub in purelib platlib; do
            [ -d "$d/$sub" ] && cp -a "$d/$sub/." "$dst/"
        done
        rm -rf "$d"
    done
    find "$dst" -name __pycache__ -prune -exec rm -rf {} +
}

STAGE=$OUT/stage
unpack "$STAGE/py" "$OUT"/wheels/py/*.whl
unpack "$STAGE/kern" "$OUT"/wheels/kern/*.whl
# z3: drop the CLI binary and the duplicate library (keep libz3.so as a link to the versioned one)
if [ -e "$STAGE/kern/z3/lib/libz3.so" ] && ls "$STAGE"/kern/z3/lib/libz3.so.* >/dev/null 2>&1; then
    rm -f "$STAGE/kern/z3/lib/libz3.so"
    (cd "$STAGE/kern/z3/lib" && ln -s "$(basename "$(ls libz3.so.* | head -1)")" libz3.so)
fi
rm -rf "$STAGE"/kern/bin "$STAGE"/kern/z3/bin

# Data a LoRA run never reads (each an import-time no-op; ~90 MB unpacked):
#   mistral_common/data (Mistral tokenizer files), pycountry/locales (translations),
#   torchao's compiled extensions (cp310 build that cannot load on 3.12; mxfp8/cutlass only),
#   zstandard's cffi backend (the C backend is the default)
rm -rf "$STAGE"/py/mistral_common/data "$STAGE"/py/pycountry/locales "$STAGE"/py/torchao/_C*.so \
    "$STAGE"/py/zstandard/_cffi.*.so

# -- stubs ------------------------------------------------------------------------------------
STUBS=$(dirname "$0")/stubs
cp -a "$STUBS/." "$STAGE/py/"

# console scripts `axolotl train --launcher accelerate|torchrun` runs by name
mkdir -p "$STAGE/py/bin"
cat >"$STAGE/py/bin/accelerate" <<'EOF'
#!/usr/bin/env python3
import sys
from accelerate.commands.accelerate_cli import main
sys.exit(main())
EOF
cat >"$STAGE/py/bin/axolotl" <<'EOF'
#!/usr/bin/env python3
import sys
from axolotl.cli.main import main
sys.exit(main())
EOF
chmod +x "$STAGE"/py/bin/*

echo "compressing" >&2
tar -C "$STAGE/py" -cf - . | xz -T0 -6 >"$OUT/py.tar.xz"
tar -C "$STAGE/kern" -cf - . | xz -T0 -6 >"$OUT/kern.tar.xz"
(cd "$OUT" && sha256sum py.tar.xz kern.tar.xz >SHA256SUMS)
du -h "$OUT/py.tar.xz" "$OUT/kern.tar.xz" >&2
