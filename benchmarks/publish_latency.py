"""Publish latency to a 2-instance vLLM CPU fleet, against the engine's own adapter-load time.

    .venv/bin/python benchmarks/publish_latency.py [--repeats 10] [--streams 1] [--bind split|auto] [--out DIR]

Starts two real vLLM CPU instances (tests/support/fleet_server.py) on the tiny Qwen3.5 base, registers
`--repeats` versions of one adapter in a sqlite MLflow, and publishes them one after another
while `--streams` client threads per instance send greedy requests to the adapter, each request
to the model id the pipeline's resolver names at that moment (`resolve_served_name`: `bench-vN`
under the `versioned` swap strategy, `bench` under `repoint`). Per publish:
- `serving`: from the `publish()` call until the resolver names the new version AND a 20 Hz poller
  of `GET /v1/models` sees that name at the new version's path on BOTH instances;
- `publish`: the whole `publish()` call (registry download + hash checks + preflight + rollout with
  verification and canaries + alias moves);
- baseline `engine load`: in the same run, a direct `POST /v1/load_lora_adapter` of a fresh name
  from the same directory on both instances concurrently (then unloaded): the engine's own cost.
`overhead` = serving - engine load, the pipeline's share.

Nothing here crashes on a failure: a failed publish, baseline load or request is counted, the run
goes on (a `fleet sync` after a failed publish), and the table is printed with the failures and
the tail of each instance's log. Exit status 1 when anything failed, else 0.

CPU fleet settings (docs/fleet.md "A CPU test fleet"): `--bind split` (default) gives each
instance its own core (`taskset` + `VLLM_CPU_OMP_THREADS_BIND=<core>`); `--bind auto` is vLLM's
default, which on a 2-core machine pins the worker of EVERY instance to core 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.fleet_server import VllmServer, cpu_fleet_env, start_all  # noqa: E402
from tests.support.helpers import peft_adapter, write_project_config  # noqa: E402


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


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


class Streams:
    """`n` client threads per instance; each request goes to the name the resolver gives now."""

    def __init__(self, cfg, servers: list[VllmServer], n: int, timeout_s: float):
        from pipeline.fleet.modes import resolve_served_name

        self.resolve = lambda: resolve_served_name(cfg, "bench")
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timeout_s = timeout_s
        self.threads = [
            threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers for _ in range(n)
        ]

    def _run(self, s: VllmServer) -> None:
        with httpx.Client(timeout=self.timeout_s) as c:
            while not self.stop.is_set():
                try:
                    model = self.resolve()
                    r = c.post(
                        f"{s.url}/v1/completions",
                        json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0},
                    )
                    r.raise_for_status()
                    with self.lock:
                        self.ok += 1
                except Exception as e:  # noqa: BLE001 - every failure counts
                    with self.lock:
                        self.failed.append(f"{s.name}: {first_line(e)}")
                    time.sleep(0.5)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="measured publishes")
    ap.add_argument("--streams", type=int, default=1, help="client threads per instance")
    ap.add_argument("--bind", choices=("split", "auto"), default="split", help="CPU placement (module doc)")
    ap.add_argument(
        "--swap", choices=("auto", "versioned", "repoint"), default="auto", help="fleet.swap_strategy"
    )
    ap.add_argument("--load-timeout", type=float, default=120.0, help="fleet.load_timeout_s")
    ap.add_argument(
        "--read-timeout", type=float, default=60.0, help="fleet.timeout_s and the clients' timeout"
    )
    ap.add_argument("--out", type=Path, default=None, help="work dir (default: a temp dir)")
    args = ap.parse_args()

    import pipeline.release.publish as publish_mod
    from pipeline.config import load_config
    from pipeline.dev.tinybase import build_tiny_base
    from pipeline.errors import PipelineError
    from pipeline.fleet.modes import resolve_served_name
    from pipeline.fleet.reconcile import sync

    # Instrument (not change) publish's fleet step: when publish() reaches it and how long it takes.
    marks: dict[str, float] = {}
    real_rollout = publish_mod.rollout

    def timed_rollout(*a, **kw):
        marks["start"] = time.monotonic()
        try:
            return real_rollout(*a, **kw)
        finally:
            marks["end"] = time.monotonic()

    publish_mod.rollout = timed_rollout

    root = (args.out or Path(tempfile.mkdtemp(prefix="publish-bench-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = build_tiny_base(root / "base")
    ncores = len(os.sched_getaffinity(0))
    servers = [
        VllmServer(base, root, name, **cpu_fleet_env(i if args.bind == "split" else None, ncores))
        for i, name in enumerate(("a", "b"))
    ]
    failures: list[str] = []
    serving, total, base_load, before_rollout, in_rollout = [], [], [], [], []
    streams = None
    try:
        start_all(servers)
        volume = (root / "volume").resolve()
        cfg = load_config(
            write_project_config(
                root,
                served={"model": str(base.resolve())},
                fleet={
                    "vllm_version": httpx.get(f"{servers[0].url}/version", timeout=30).json()["version"],
                    "instances": [{"name": s.name, "url": s.url} for s in servers],
                    "volume_mount": str(volume),
                    "timeout_s": args.read_timeout,
                    "load_timeout_s": args.load_timeout,
                    "swap_strategy": args.swap,
                },
            )
        )
        srcs = [peft_adapter(base, root / f"src{i}", seed=i) for i in range(2)]
        versions = [register(cfg, base, srcs[i % 2], "bench") for i in range(args.repeats + 1)]
        publish_mod.publish(cfg, "bench", versions[0])  # first publish: plain load, not measured

        def serving_at(version: int, t0: float, out: list, done: threading.Event) -> None:
            path = str(volume / f"bench-v{version}")
            with httpx.Client(timeout=args.read_timeout) as c:
                while not done.is_set():
                    try:
                        name = resolve_served_name(cfg, "bench")
                        roots = [
                            {m["id"]: m["root"] for m in c.get(f"{s.url}/v1/models").json()["data"]}.get(name)
                            for s in servers
                        ]
                        if name.endswith(f"-v{version}") or name == "bench":
                            if all(r == path for r in roots):
                                out.append(time.monotonic() - t0)
                                return
                    except Exception:  # noqa: BLE001 - the poller only observes
                        pass
                    time.sleep(0.05)

        def engine_load(src_path: str) -> float:
            def one(s: VllmServer) -> None:
                httpx.post(
                    f"{s.url}/v1/load_lora_adapter",
                    timeout=args.load_timeout,
                    json={"lora_name": "bench-baseline", "lora_path": src_path},
                ).raise_for_status()

            t0 = time.monotonic()
            try:
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(one, servers))
                return time.monotonic() - t0
            finally:
                for s in servers:
                    try:
                        httpx.post(
                            f"{s.url}/v1/unload_lora_adapter",
                            json={"lora_name": "bench-baseline"},
                            timeout=args.load_timeout,
                        )
                    except httpx.HTTPError:
                        pass

        streams = Streams(cfg, servers, args.streams, args.read_timeout).__enter__()
        for v in versions[1:]:
            try:
                bl = engine_load(str(srcs[v % 2].resolve()))
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                failures.append(f"v{v} baseline load: {first_line(e)}")
                continue
            out: list = []
            done = threading.Event()
            marks.clear()
            t0 = time.monotonic()
            poller = threading.Thread(target=serving_at, args=(v, t0, out, done), daemon=True)
            poller.start()
            try:
                publish_mod.publish(cfg, "bench", v)
            except PipelineError as e:
                done.set()
                failures.append(f"v{v} publish: {first_line(e)}")
                try:
                    sync(cfg)  # converge before the next publish
                except PipelineError as e2:
                    failures.append(f"v{v} sync after the failed publish: {first_line(e2)}")
                continue
            t_pub = time.monotonic() - t0
            poller.join(args.read_timeout)
            done.set()
            if not out:
                failures.append(f"v{v}: not seen serving on both instances within {args.read_timeout:g} s")
                continue
            base_load.append(bl)
            total.append(t_pub)
            serving.append(out[0])
            before_rollout.append(marks["start"] - t0)
            in_rollout.append(marks["end"] - marks["start"])
    except Exception as e:  # noqa: BLE001 - set-up failures are reported like the rest
        failures.append(f"run aborted: {first_line(e)}")
        traceback.print_exc()
    finally:
        if streams is not None:
            streams.__exit__(None, None, None)
        for s in servers:
            s.stop()

    print(
        f"\npublish latency, 2 vLLM CPU instances (bind {args.bind}, {args.streams} stream(s) per instance, "
        f"swap {args.swap}), {len(serving)} of {args.repeats} publishes measured (tiny Qwen3.5, r=8 LoRA)\n"
    )
    print(f"{'metric':<46}{'median s':>10}{'p95 s':>10}{'max s':>10}")
    rows = [
        ("baseline: engine adapter load (both, direct)", base_load),
        ("publish call -> both serve new version", serving),
        ("overhead (serving - engine load)", [s - b for s, b in zip(serving, base_load, strict=True)]),
        ("  of which: registry + volume before rollout", before_rollout),
        ("rollout: preflight, load, verify, canary, clean", in_rollout),
        ("whole publish() call", total),
    ]
    for label, xs in rows:
        if xs:
            print(f"{label:<46}{statistics.median(xs):>10.3f}{p95(xs):>10.3f}{max(xs):>10.3f}")
        else:
            print(f"{label:<46}{'-':>10}{'-':>10}{'-':>10}")
    ok, failed = (streams.ok, streams.failed) if streams else (0, [])
    print(f"\nrequests during the run: {ok} ok, {len(failed)} failed")
    for e in failed[:5]:
        print("  ", e)
    print(f"failed publishes / loads: {len(failures)}")
    for f in failures:
        print("  ", f)
    if failures or failed:
        for s in servers:
            print(f"\n--- tail of {s.log} ---\n{s.tail(15)}")
    print(f"\nresult: {'FAILED' if failures or failed else 'ok'} (work dir {root})")
    return 1 if failures or failed else 0


if __name__ == "__main__":
    sys.exit(main())
