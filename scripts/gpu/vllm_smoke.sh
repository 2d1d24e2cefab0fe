#!/usr/bin/env bash
# A first look at the fleet's kind of engine on a lent H200, before the full run (scripts/gpu/vllm_call.sh):
# does the carried vLLM 0.25.1 bundle import there, does nvidia-modelopt build the NVFP4 + MTP served
# checkpoint of an 8-layer real-geometry base, and do two engines start with the fleet's flags, hot-load
# a LoRA adapter through the runtime API and answer with it? Results under $OUT (smoke.json + logs).
#
#   bash scripts/gpu/vllm_smoke.sh [CARRIED_DIR]      # default .whl/vllm; one part per call (vllm_unpack.sh)
#   (carry .whl/extra too: pydantic-settings 2.12.0 and python-dotenv 1.0.1 wheels for the dev builders)
#
# A call that only carries a part stores it and exits 0 ("missing ..."). Needs nothing but the image and
# the bundle: the pipeline's own dev builders run with the bundle's pydantic (no training bundle).
set -uo pipefail
: "${OUT:?OUT must name the results folder}"
cd "$(dirname "$0")/../.."
ROOT=$PWD
CARRIED=${1:-.whl/vllm}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
VS=${VLLM_SITE:-/tmp/vsite}
W=${WORK:-/tmp/w}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }

bash scripts/gpu/vllm_unpack.sh "$CARRIED"
rc=$?
[ $rc -eq 3 ] && exit 0
[ $rc -ne 0 ] && exit $rc
mkdir -p "$W" "$OUT"
# the pipeline's dev builders need pydantic-settings + python-dotenv besides the image and the bundle
# (carried as wheels in .whl/extra; the full run uses the training bundle instead)
PS=/tmp/psite
mkdir -p $PS
for w in .whl/extra/*.whl; do
    [ -e "$w" ] && python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" $PS
done
export PYTHONPATH=$VS:$PS:$ROOT
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >"$OUT/host.txt" 2>&1
python3 scripts/gpu/vllm_import_check.py >"$OUT/import.json" 2>"$OUT/import.err"
el "import check rc=$? $(cat "$OUT/import.json")"

# 8 layers: 6 Gated-DeltaNet + 2 full attention, plus the MTP layer
[ -f $W/real8/config.json ] || python3 -m pipeline dev real-base $W/real8 --layers 8 --device cuda >"$OUT/real8.log" 2>&1
el "real8: $(du -sh $W/real8 | cut -f1)"

serve() { # name model port gpu_util extra...
    local name=$1 model=$2 port=$3 util=$4
    shift 4
    setsid python3 -m vllm.entrypoints.cli.main serve "$model" --host 127.0.0.1 --port "$port" \
        --served-model-name "$name" --gpu-memory-utilization "$util" --max-model-len 4096 --max-num-seqs 8 \
        --enable-lora --max-lora-rank 16 --max-loras 2 --enable-prefix-caching --enable-chunked-prefill \
        --speculative-config '{"method":"qwen3_5_mtp","num_speculative_tokens":3}' "$@" \
        >"$OUT/$name.log" 2>&1 &
    echo $! >"$W/$name.pid"
}
serve bf16 $W/real8 8002 0.3 --language-model-only
el "bf16 engine starting"

python3 -m pipeline dev served-base $W/real8 $W/nvfp4-8 --device cuda >"$OUT/nvfp4.log" 2>&1
el "nvfp4 rc=$? $(du -sh $W/nvfp4-8 2>/dev/null | cut -f1) $(tail -1 "$OUT/nvfp4.log")"
serve nvfp4 $W/nvfp4-8 8001 0.3 --quantization modelopt --language-model-only --kv-cache-dtype fp8
el "nvfp4 engine starting"

python3 - "$W" "$OUT" <<'EOF'
"""A random r=16 adapter on every text linear (PEFT layout of the VL class), hot-loaded on both engines."""
import json, sys, time, pathlib, httpx, torch
from safetensors.torch import save_file

W, OUT = map(pathlib.Path, sys.argv[1:3])
cfg = json.loads((W / "real8/config.json").read_text())["text_config"]
h, r = cfg["hidden_size"], 16
qh, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
lk, lv, lkd, lvd = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
shapes = {"mlp.gate_proj": (cfg["intermediate_size"], h), "mlp.up_proj": (cfg["intermediate_size"], h),
          "mlp.down_proj": (h, cfg["intermediate_size"])}
full = {"self_attn.q_proj": (2 * qh * hd, h), "self_attn.k_proj": (kvh * hd, h), "self_attn.v_proj": (kvh * hd, h),
        "self_attn.o_proj": (h, qh * hd)}
lin = {"linear_attn.in_proj_qkv": (2 * lk * lkd + lv * lvd, h), "linear_attn.in_proj_z": (lv * lvd, h),
       "linear_attn.out_proj": (h, lv * lvd)}
g = torch.Generator().manual_seed(0)
t = {}
for i, kind in enumerate(cfg["layer_types"]):
    for mod, (o, n) in {**shapes, **(full if kind == "full_attention" else lin)}.items():
        p = f"base_model.model.model.language_model.layers.{i}.{mod}"
        t[f"{p}.lora_A.weight"] = (torch.randn(r, n, generator=g) / n**0.5).bfloat16()
        t[f"{p}.lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.02).bfloat16()
a = W / "loras/smoke-a"
a.mkdir(parents=True, exist_ok=True)
save_file(t, str(a / "adapter_model.safetensors"))
targets = sorted({k.split(".")[-1] for k in {**shapes, **full, **lin}})
(a / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 32,
    "target_modules": targets, "bias": "none", "base_model_name_or_path": str(W / "real8"), "task_type": "CAUSAL_LM"}))

def wait(port, deadline):
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False

res = {}
prompt = "The history of the city of Kyoto begins " * 20
for name, port in (("bf16", 8002), ("nvfp4", 8001)):
    t0 = time.time()
    up = wait(port, t0 + 300)
    rec = {"up": up, "waited_s": round(time.time() - t0, 1)}
    if up:
        base = f"http://127.0.0.1:{port}"
        rec["version"] = httpx.get(f"{base}/version").json()
        r1 = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "smoke-a", "lora_path": str(a)}, timeout=60)
        rec["load"] = [r1.status_code, r1.text[:300]]
        for model in (name, "smoke-a"):
            t1 = time.time()
            c = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 128,
                           "temperature": 0, "ignore_eos": True}, timeout=120)
            dt = time.time() - t1
            body = c.json() if c.status_code == 200 else {"error": c.text[:500]}
            rec[model] = {"status": c.status_code, "s": round(dt, 3),
                          "text": (body.get("choices") or [{}])[0].get("text", "")[:80], "usage": body.get("usage"),
                          "error": body.get("error")}
        m = httpx.get(f"{base}/metrics").text
        rec["spec_metrics"] = [l for l in m.splitlines() if "spec_decode" in l and not l.startswith("#")][:12]
    res[name] = rec
    print(name, json.dumps(rec)[:600], flush=True)
(OUT / "smoke.json").write_text(json.dumps(res, indent=1))
EOF
el "smoke done"
for f in $W/*.pid; do kill -- -"$(cat "$f")" 2>/dev/null; done
grep -hE "Error|error|Traceback|took|Loading weights|compile|CUDA graph|KV cache" "$OUT"/bf16.log "$OUT"/nvfp4.log | tail -40
el "end"
