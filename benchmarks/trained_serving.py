"""The trained stand-in base on vLLM: MTP acceptance and NVFP4 fidelity, one engine on the GPU at a time.

Serves `pipeline dev trained-base`'s checkpoint (bf16) and its `pipeline dev served-base` build (ModelOpt
NVFP4, `mtp.*` in bf16) one after the other with `qwen3_5_mtp` x3, on the held-out prompts the builder
estimated its drafter on (the first 64 tokens of every 256 of the held-out corpus split, greedy, 128
new tokens, EOS ignored), and records per engine:
- MTP acceptance length and per-position acceptance from vLLM's /metrics (`pipeline.canary.prom`),
  beside the builder's offline estimate on the same prompts (`trained_base.json` `mtp_greedy`);
- the greedy tokens; for NVFP4, agreement with the bf16 engine's tokens (per position, and the share of
  each continuation before the first difference);
- decode tok/s at batch 1: a warm-up request, then `--repeats` timed requests, median and min-max.
  Engines run with `--enforce-eager` unless `--graphs`: start-up in about a minute; eager decode is not
  the fleet's speed (CUDA graphs), so these rows say `eager`.

    python benchmarks/trained_serving.py --bf16 /dev/shm/tb --nvfp4 /dev/shm/tb-nvfp4 --out result.json
    python benchmarks/trained_serving.py --smoke   # CPU: the prompt and agreement helpers only (no engine)

Environment: `VLLM_SITE` (the vLLM bundle, scripts/gpu/vllm_bundle.sh), `VLLM_CACHE_ROOT`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.canary import prom  # noqa: E402

SPEC_MTP = {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}
# GDN prefill through Triton/FLA and the PyTorch sampler: the carried engine has no FlashInfer
# (benchmarks/vllm_h200.py GPU_ONLY says where vLLM 0.25.1 would reach for it)
COMMON = ["--max-model-len", "4096", "--max-num-seqs", "8", "--seed", "0", "--gdn-prefill-backend", "triton",
          "--language-model-only", "--speculative-config", json.dumps(SPEC_MTP), "--gpu-memory-utilization", "0.5"]  # fmt: skip
FLEET = [
    "--quantization",
    "modelopt",
    "--kv-cache-dtype",
    "fp8",
    "--enable-prefix-caching",
    "--enable-chunked-prefill",
]
PROMPT_LEN, STRIDE, NEW_TOKENS = 64, 256, 128


def heldout_prompts(base: Path, n: int = 16) -> list[list[int]]:
    """The builder's greedy-estimate prompts: held-out corpus ids [i*256 : i*256+64] (pipeline.dev.trainedbase)."""
    from transformers import AutoTokenizer

    from pipeline.dev.corpus import collect
    from pipeline.dev.trainedbase import _token_stream

    rep = json.loads((base / "trained_base.json").read_text())
    corpus = collect(max_bytes=rep["corpus"]["bytes"])
    if corpus.sha256 != rep["corpus"]["sha256"]:
        raise SystemExit(f"corpus here {corpus.sha256[:12]} is not the base's {rep['corpus']['sha256'][:12]}")
    tok = AutoTokenizer.from_pretrained(str(base))
    ids = _token_stream(tok, corpus.heldout, tok.convert_tokens_to_ids("<|endoftext|>"))
    return [ids[i * STRIDE : i * STRIDE + PROMPT_LEN].tolist() for i in range(n)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token agreement of two sets of continuations: per position, and before the first difference."""
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=False))
    total = sum(min(len(s), len(t)) for s, t in zip(a, b, strict=True))
    prefix = []
    for s, t in zip(a, b, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(s, t, strict=False)) if x != y), min(len(s), len(t)))
        prefix.append(k / max(1, min(len(s), len(t))))
    return {"per_position": round(same / total, 4) if total else None,
            "before_first_difference": round(sum(prefix) / len(prefix), 4) if prefix else None}  # fmt: skip


def _post(url: str, body: dict) -> dict:
    import httpx

    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code >= 400:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:400]}")
    return r.json()


def _generate(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    toks = _post(url, body)["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":", 1)[1]) for t in toks]


def _scrape(url: str):
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return prom.counters(text), prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position")


def serve_and_measure(
    name: str, model: Path, args: list[str], prompts, logs: Path, repeats: int, port: int
) -> dict:
    """Start one engine, measure, stop it: the GPU holds no other engine meanwhile."""
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
               VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", "/tmp/vllm-cache"),
               PYTHONPATH=os.environ.get("VLLM_SITE", "/tmp/vsite"))  # fmt: skip
    cmd = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), *COMMON, *args]  # fmt: skip
    log = (logs / f"{name}.log").open("w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, rec = f"http://127.0.0.1:{port}", {"engine": name, "model": str(model), "flags": args}
    try:
        while True:
            if proc.poll() is not None:
                rec["error"] = f"engine exited {proc.returncode} (see {name}.log)"
                return rec
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 300:
                rec["error"] = "not ready in 300 s"
                return rec
            time.sleep(2)
        rec["ready_s"] = round(time.time() - t0, 1)
        _generate(url, name, prompts[0], 16)  # warm-up
        c0, p0 = _scrape(url)
        rec["tokens"] = [_generate(url, name, p, NEW_TOKENS) for p in prompts]
        c1, p1 = _scrape(url)
        d = prom.delta(c0, c1)
        drafts, acc = d.get(prom.SPEC_DRAFTS), d.get(prom.SPEC_ACCEPTED)
        rec["mtp"] = {
            "drafts": drafts, "accepted": acc,
            "acceptance_length": round(1 + acc / drafts, 4) if drafts else None,
            "acceptance_per_position": [round((p1[k] - p0.get(k, 0.0)) / drafts, 4) for k in sorted(p1, key=int)]
            if drafts else None,
        }  # fmt: skip
        times = []
        for _ in range(repeats):
            t = time.time()
            _generate(url, name, prompts[1], 256)
            times.append(256 / (time.time() - t))
        rec["decode_batch1_tok_s"] = {"median": round(statistics.median(times), 1), "min": round(min(times), 1),
                                      "max": round(max(times), 1), "repeats": repeats,
                                      "mode": "eager" if "--enforce-eager" in args else "cuda graphs"}  # fmt: skip
        return rec
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", type=Path)
    ap.add_argument("--nvfp4", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/ts-logs"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--graphs", action="store_true", help="CUDA graphs (torch.compile at start-up) instead of eager"
    )
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        agr = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
        print(json.dumps({"smoke": True, "agreement": agr}))
        return 0 if agr == {"per_position": 0.8333, "before_first_difference": 0.75} else 1
    a.logs.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(a.bf16)
    eager = [] if a.graphs else ["--enforce-eager"]
    est = json.loads((a.bf16 / "trained_base.json").read_text())["mtp_greedy"]
    res = {
        "prompts": len(prompts),
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "offline_estimate": est,
    }
    res["bf16"] = serve_and_measure(
        "tb-bf16", a.bf16, ["--dtype", "bfloat16", *eager], prompts, a.logs, a.repeats, 8121
    )
    a.out.write_text(json.dumps(res, indent=1))
    res["nvfp4"] = serve_and_measure("tb-nvfp4", a.nvfp4, [*FLEET, *eager], prompts, a.logs, a.repeats, 8122)
    if res["bf16"].get("tokens") and res["nvfp4"].get("tokens"):
        res["nvfp4_vs_bf16_agreement"] = agreement(res["nvfp4"]["tokens"], res["bf16"]["tokens"])
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("bf16", "nvfp4")}))
    for k in ("bf16", "nvfp4"):
        print(k, json.dumps({x: y for x, y in res[k].items() if x != "tokens"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
