"""Publish latency to a 2-instance vLLM CPU fleet, against the engine's own adapter-load time.

    .venv/bin/python benchmarks/publish_latency.py [--repeats 10] [--out DIR]

Starts two real vLLM CPU instances (tests/support/fleet_server.py) on the tiny Qwen3.5 base, registers
`--repeats` versions of one adapter in a sqlite MLflow, and publishes them one after another
while a client thread per instance streams greedy requests to the stable name. Per publish:
- `serving`: from the `publish()` call until a 20 Hz poller of `GET /v1/models` sees the stable
  name's root at the new version on BOTH instances;
- `publish`: the whole `publish()` call (registry download + hash checks + rollout with
  verification and canaries + alias moves);
- baseline `engine load`: in the same run, a direct `POST /v1/load_lora_adapter` of a fresh name
  from the same directory on both instances concurrently (then unloaded): the engine's own cost.
`overhead` = serving - engine load, the pipeline's share. Target: < 2 s, 0 failed requests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.fleet_server import VllmServer, start_all  # noqa: E402
from tests.support.helpers import peft_adapter, write_project_config  # noqa: E402


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def register(cfg, base: Path, src: Path, name: str) -> int:
    from pipeline.artifacts.atomic import write_json_atomic
    from pipeline.artifacts.manifest import MANIFEST, file_hashes
    from pipeline.registry import register_adapter
    from pipeline.validate import FleetRules, validate_adapter

    if not (src / MANIFEST).exists():
        write_json_atomic(
            src / MANIFEST,
            {"schema": 1, "name": name, "files": file_hashes(src), "base_model": {"id": str(base)}},
        )
    return register_adapter(cfg, src, name, validate_adapter(src, base, FleetRules()).to_dict()).version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="work dir (default: a temp dir)")
    args = ap.parse_args()

    import pipeline.fleet.rollout as fleet_rollout
    from pipeline.config import load_config
    from pipeline.dev.tinybase import build_tiny_base
    from pipeline.release.publish import publish

    # Instrument (not change) the rollout: when publish() reaches it, and how long it takes.
    marks: dict[str, float] = {}
    real_rollout = fleet_rollout.rollout

    def timed_rollout(*a, **kw):
        marks["start"] = time.monotonic()
        try:
            return real_rollout(*a, **kw)
        finally:
            marks["end"] = time.monotonic()

    fleet_rollout.rollout = timed_rollout

    root = args.out or Path(tempfile.mkdtemp(prefix="publish-bench-"))
    base = build_tiny_base(root / "base")
    servers = start_all([VllmServer(base, root, "a"), VllmServer(base, root, "b")])
    try:
        volume = (root / "volume").resolve()
        cfg = load_config(
            write_project_config(
                root,
                served={"model": str(base.resolve())},
                fleet={
                    "instances": [{"name": s.name, "url": s.url} for s in servers],
                    "volume_mount": str(volume),
                },
            )
        )
        srcs = [peft_adapter(base, root / f"src{i}", seed=i) for i in range(2)]
        versions = [register(cfg, base, srcs[i % 2], "bench") for i in range(args.repeats + 1)]
        publish(cfg, "bench", versions[0])  # first publish: plain load, not measured

        stop = threading.Event()
        counts = {"ok": 0, "failed": 0}
        errors: list[str] = []

        def stream(s: VllmServer) -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    try:
                        r = c.post(
                            f"{s.url}/v1/completions",
                            json={"model": "bench", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
                        )
                        r.raise_for_status()
                        counts["ok"] += 1
                    except Exception as e:  # noqa: BLE001 - every failure counts
                        counts["failed"] += 1
                        errors.append(repr(e)[:200])

        def serving_at(path: str, t0: float, out: list) -> None:
            with httpx.Client(timeout=10) as c:
                while True:
                    roots = [
                        {m["id"]: m["root"] for m in c.get(f"{s.url}/v1/models").json()["data"]}.get("bench")
                        for s in servers
                    ]
                    if all(r == path for r in roots):
                        out.append(time.monotonic() - t0)
                        return
                    time.sleep(0.05)

        def engine_load(src_path: str) -> float:
            def one(s: VllmServer) -> None:
                httpx.post(
                    f"{s.url}/v1/load_lora_adapter",
                    timeout=60,
                    json={"lora_name": "bench-baseline", "lora_path": src_path},
                ).raise_for_status()

            t0 = time.monotonic()
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(one, servers))
            dt = time.monotonic() - t0
            for s in servers:
                httpx.post(
                    f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "bench-baseline"}, timeout=60
                )
            return dt

        threads = [threading.Thread(target=stream, args=(s,), daemon=True) for s in servers]
        for t in threads:
            t.start()
        serving, total, base_load, before_rollout, in_rollout = [], [], [], [], []
        for v in versions[1:]:
            base_load.append(engine_load(str(srcs[v % 2].resolve())))
            out: list = []
            t0 = time.monotonic()
            poller = threading.Thread(
                target=serving_at, args=(str(volume / f"bench-v{v}"), t0, out), daemon=True
            )
            poller.start()
            publish(cfg, "bench", v)
            total.append(time.monotonic() - t0)
            before_rollout.append(marks["start"] - t0)
            in_rollout.append(marks["end"] - marks["start"])
            poller.join(60)
            serving.append(out[0])
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        for s in servers:
            s.stop()

    overhead = [s - b for s, b in zip(serving, base_load, strict=True)]
    print(f"\npublish latency, 2 vLLM CPU instances, {len(serving)} publishes (tiny Qwen3.5, r=8 LoRA)\n")
    print(f"{'metric':<46}{'median s':>10}{'p95 s':>10}{'max s':>10}")
    rows = [
        ("baseline: engine adapter load (both, direct)", base_load),
        ("publish call -> both serve new version", serving),
        ("overhead (serving - engine load)", overhead),
        ("  of which: registry + volume before rollout", before_rollout),
        ("rollout: 2 loads, verify, canary, unload old", in_rollout),
        ("whole publish() call", total),
    ]
    for label, xs in rows:
        print(f"{label:<46}{statistics.median(xs):>10.3f}{p95(xs):>10.3f}{max(xs):>10.3f}")
    print(f"\nrequests to the stable name during the run: {counts['ok']} ok, {counts['failed']} failed")
    for e in errors[:5]:
        print("  ", e)
    target_ok = statistics.median(overhead) < 2.0 and counts["failed"] == 0
    print(f"target (median overhead < 2 s, 0 failed): {'met' if target_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
