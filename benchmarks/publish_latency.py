"""Publish latency to a 2-instance vLLM CPU fleet, against the engine's own adapter-load time.

    .venv/bin/python benchmarks/publish_latency.py [--repeats 10] [--streams 1] [--bind split|auto] [--out DIR]
    .venv/bin/python benchmarks/publish_latency.py --smoke   # 1 measured publish: the harness works

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

The phases come from the release transaction's own checkpoints (`pipeline.release.transaction.observe`:
`after-volume` ends registry + volume, `after-fleet` ends the rollout), nothing is patched. `measure`
runs on instances someone else started: the suite's smoke (tests/fleet/test_fleet_vllm.py) measures
one publish on the fleet module's two instances, so a refactor that breaks this file fails there.

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
from dataclasses import dataclass, field
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
    from pipeline.artifacts.manifest import (
        MANIFEST,
        AdapterManifest,
        BaseModelRef,
        file_hashes,
        write_manifest,
    )
    from pipeline.registry import register_adapter
    from pipeline.validate import FleetRules, validate_adapter

    if not (src / MANIFEST).exists():
        write_manifest(
            src, AdapterManifest(name=name, files=file_hashes(src), base_model=BaseModelRef(id=str(base)))
        )
    return register_adapter(cfg, src, name, validate_adapter(src, base, FleetRules()).to_dict()).version


class Streams:
    """`n` client threads per instance; each request goes to the name the resolver gives now."""

    def __init__(self, cfg, servers: list, n: int, timeout_s: float, name: str = "bench"):
        from pipeline.fleet.modes import resolve_served_name

        self.resolve = lambda: resolve_served_name(cfg, name)
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timeout_s = timeout_s
        self.threads = [
            threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers for _ in range(n)
        ]

    def _run(self, s) -> None:
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


@dataclass
class Result:
    """Seconds per measured publish (one list per row of the table), failures, client requests."""

    serving: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    base_load: list[float] = field(default_factory=list)
    before_rollout: list[float] = field(default_factory=list)
    in_rollout: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    requests_ok: int = 0
    requests_failed: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, list[float]]]:
        return [
            ("baseline: engine adapter load (both, direct)", self.base_load),
            ("publish call -> both serve new version", self.serving),
            (
                "overhead (serving - engine load)",
                [s - b for s, b in zip(self.serving, self.base_load, strict=True)],
            ),
            ("  of which: preflight, registry, volume copy", self.before_rollout),
            ("rollout: preflight, load, verify, canary, clean", self.in_rollout),
            ("whole publish() call", self.total),
        ]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.requests_failed


class Phases:
    """When this process's publish reaches `after-volume` and `after-fleet` (transaction checkpoints)."""

    def __init__(self):
        self.at: dict[str, float] = {}

    def __call__(self, point: str) -> None:
        if point in ("after-volume", "after-fleet"):
            self.at[point] = time.monotonic()


def measure(
    cfg, servers: list, base: Path, work: Path, repeats: int, streams_n: int = 1, name: str = "bench"
) -> Result:
    """Publish `repeats` + 1 versions of adapter `name` to the running `servers` (the first unmeasured).

    `cfg`: a project whose fleet is `servers` (objects with `name`, `url`) and whose volume the
    instances see; `base`: the served tiny base; `work`: where adapters are written. Never raises
    for a failed publish, load or request: they are counted in the result.
    """
    from pipeline.errors import PipelineError
    from pipeline.fleet.modes import resolve_served_name
    from pipeline.fleet.reconcile import sync
    from pipeline.release.publish import publish
    from pipeline.release.transaction import observe

    res = Result()
    read_s, load_s = cfg.fleet.timeout_s, cfg.fleet.load_timeout_s
    volume = Path(cfg.volume.path)
    srcs = [peft_adapter(base, work / f"{name}-src{i}", seed=i) for i in range(2)]
    versions = [register(cfg, base, srcs[i % 2], name) for i in range(repeats + 1)]
    publish(cfg, name, versions[0])  # first publish: plain load, not measured

    def serving_at(version: int, t0: float, out: list, done: threading.Event) -> None:
        path = str(volume / f"{name}-v{version}")
        with httpx.Client(timeout=read_s) as c:
            while not done.is_set():
                try:
                    served = resolve_served_name(cfg, name)
                    roots = [
                        {m["id"]: m["root"] for m in c.get(f"{s.url}/v1/models").json()["data"]}.get(served)
                        for s in servers
                    ]
                    if served in (f"{name}-v{version}", name) and all(r == path for r in roots):
                        out.append(time.monotonic() - t0)
                        return
                except Exception:  # noqa: BLE001 - the poller only observes
                    pass
                time.sleep(0.05)

    def engine_load(src_path: str) -> float:
        def one(s) -> None:
            httpx.post(
                f"{s.url}/v1/load_lora_adapter",
                timeout=load_s,
                json={"lora_name": f"{name}-baseline", "lora_path": src_path},
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
                        json={"lora_name": f"{name}-baseline"},
                        timeout=load_s,
                    )
                except httpx.HTTPError:
                    pass

    streams = Streams(cfg, servers, streams_n, read_s, name)
    with streams, observe(phases := Phases()):
        for v in versions[1:]:
            try:
                bl = engine_load(str(srcs[v % 2].resolve()))
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                res.failures.append(f"v{v} baseline load: {first_line(e)}")
                continue
            out: list = []
            done = threading.Event()
            phases.at.clear()
            t0 = time.monotonic()
            poller = threading.Thread(target=serving_at, args=(v, t0, out, done), daemon=True)
            poller.start()
            try:
                publish(cfg, name, v)
            except PipelineError as e:
                done.set()
                res.failures.append(f"v{v} publish: {first_line(e)}")
                try:
                    sync(cfg)  # converge before the next publish
                except PipelineError as e2:
                    res.failures.append(f"v{v} sync after the failed publish: {first_line(e2)}")
                continue
            t_pub = time.monotonic() - t0
            poller.join(read_s)
            done.set()
            if not out:
                res.failures.append(f"v{v}: not seen serving on both instances within {read_s:g} s")
                continue
            if set(phases.at) != {"after-volume", "after-fleet"}:
                res.failures.append(
                    f"v{v}: publish passed no after-volume/after-fleet checkpoint: {sorted(phases.at)}"
                )
                continue
            res.base_load.append(bl)
            res.total.append(t_pub)
            res.serving.append(out[0])
            res.before_rollout.append(phases.at["after-volume"] - t0)
            res.in_rollout.append(phases.at["after-fleet"] - phases.at["after-volume"])
    res.requests_ok, res.requests_failed = streams.ok, streams.failed
    return res


def table(res: Result, title: str) -> str:
    lines = [title, "", f"{'metric':<46}{'median s':>10}{'p95 s':>10}{'max s':>10}"]
    for label, xs in res.rows():
        if xs:
            lines.append(f"{label:<46}{statistics.median(xs):>10.3f}{p95(xs):>10.3f}{max(xs):>10.3f}")
        else:
            lines.append(f"{label:<46}{'-':>10}{'-':>10}{'-':>10}")
    lines.append(f"\nrequests during the run: {res.requests_ok} ok, {len(res.requests_failed)} failed")
    lines += [f"   {e}" for e in res.requests_failed[:5]]
    lines.append(f"failed publishes / loads: {len(res.failures)}")
    lines += [f"   {f}" for f in res.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="measured publishes")
    ap.add_argument("--smoke", action="store_true", help="one measured publish (the harness works)")
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
    args = ap.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats

    from pipeline.config import load_config
    from pipeline.dev.tinybase import build_tiny_base

    root = (args.out or Path(tempfile.mkdtemp(prefix="publish-bench-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = build_tiny_base(root / "base")
    ncores = len(os.sched_getaffinity(0))
    servers = [
        VllmServer(base, root, name, **cpu_fleet_env(i if args.bind == "split" else None, ncores))
        for i, name in enumerate(("a", "b"))
    ]
    res = Result()
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
        res = measure(cfg, servers, base, root, repeats, args.streams)
    except Exception as e:  # noqa: BLE001 - set-up failures are reported like the rest
        res.failures.append(f"run aborted: {first_line(e)}")
        traceback.print_exc()
    finally:
        for s in servers:
            s.stop()

    print(
        "\n"
        + table(
            res,
            f"publish latency, 2 vLLM CPU instances (bind {args.bind}, {args.streams} stream(s) per instance, "
            f"swap {args.swap}), {len(res.serving)} of {repeats} publishes measured (tiny Qwen3.5, r=8 LoRA)",
        )
    )
    if not res.ok:
        for s in servers:
            print(f"\n--- tail of {s.log} ---\n{s.tail(15)}")
    print(f"\nresult: {'ok' if res.ok else 'FAILED'} (work dir {root})")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
