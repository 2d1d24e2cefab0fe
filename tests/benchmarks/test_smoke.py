"""Every benchmark under benchmarks/ runs in its smoke mode in the suite (issue 26 item 5).

`benchmarks/publish_latency.py` patched `pipeline.release.publish.rollout`, which had moved, and its
recorded figures came from before the move: nothing ran it. Now each benchmark has a smoke mode
(tiny sizes, seconds) that a test below runs as the benchmark's own process (`python
benchmarks/X.py --smoke`, two at a time: `smokes`), so a refactor that breaks one fails here. Benchmarks that need running
instances or a training get theirs where those already are (`ELSEWHERE`).
`test_every_benchmark_has_a_smoke` fails when a benchmark is added without one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.support.helpers import REPO

BENCH = REPO / "benchmarks"

# Smoke modes that run inside another test module (their instances or training are there already).
ELSEWHERE = {
    "publish_latency": "tests/fleet/test_fleet_vllm.py::test_publish_latency_benchmark_measures_one_publish",
    "eval_noise": "tests/benchmarks/test_smoke.py::test_eval_noise_reads_the_sessions_training",
    "vllm_h200": "tests/fleet/test_fleet_vllm.py::test_vllm_h200_driver_smoke_on_the_cpu_fleet",
    "mtp_distill": "tests/benchmarks/test_vllm_h200.py",
    # its smoke (distill + one CPU vLLM with qwen3_5_mtp) takes ~85 s, too long for the suite: its
    # measure/table run on the fleet module's instances, the graft in test_mtp_distill.py
    "mtp_acceptance": "tests/fleet/test_fleet_vllm.py::test_mtp_acceptance_measure_on_instances_that_draft_nothing",
}


def smoke(name: str, *args: str, timeout: float = 300, mode: str = "--smoke") -> str:
    """Run `benchmarks/<name>.py --smoke ARGS` in a fresh process; its output (exit 0 asserted).

    `mode`: the smoke's flag, or its subcommand for a driver with subcommands (`axolotl_h200 smoke`)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PIPELINE_CONFIG", None)
    r = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), mode, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@pytest.fixture(scope="module")
def smokes(tmp_path_factory) -> dict[str, Future]:
    """Every smoke below started at once, two processes at a time, the longest first; name -> its Future
    (`.result()`: the output, or the AssertionError of a failed run). Each is one process that keeps
    about one core busy: one after another they took ~95 s of the suite (issue 26 item 6)."""
    work = tmp_path_factory.mktemp("smokes")
    for d in ("merge", "axolotl", "throughput"):
        (work / d).mkdir()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="smoke")
    runs = {
        "cli_latency": pool.submit(smoke, "cli_latency"),
        "train_throughput": pool.submit(
            smoke, "train_throughput", "--out", str(work / "throughput" / "tt.json")
        ),
        "axolotl_h200": pool.submit(smoke, "axolotl_h200", "--work", str(work / "axolotl"), mode="smoke"),
        "packing_check": pool.submit(smoke, "packing_check"),
        "recompute_sweep": pool.submit(smoke, "recompute_sweep"),
        "validate_static": pool.submit(smoke, "validate_static"),
        "merge": pool.submit(smoke, "merge", "--workdir", str(work / "merge")),
        "qwen36_27b": pool.submit(smoke, "qwen36_27b"),
        "trained_adapters": pool.submit(smoke, "trained_adapters"),
    }
    runs["work"] = work
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


def test_geometry_derives_the_published_shapes(smokes):
    out = smokes["qwen36_27b"].result()
    assert "equal the published table" in out


def test_validate_static_smoke(smokes):
    out = smokes["validate_static"].result()
    assert "verdict pass" in out and "| validate: + served NVFP4 headers |" in out


def test_merge_smoke(smokes):
    out = smokes["merge"].result()
    assert "merge --no-hash" in out and "peak RSS" in out
    assert not list((smokes["work"] / "merge").iterdir())  # the work directory is removed


def test_train_throughput_smoke(smokes):
    out = smokes["train_throughput"].result()
    assert "baseline" in out and "FAILED" not in out


# -- the GPU drivers, on CPU: their code paths on the tiny base, seconds -----------------------------------------
def test_axolotl_h200_smoke(smokes):
    """Every plan's `pipeline train` config through the pipeline's own check (known keys, axolotl's
    validation): a renamed key or a bad value in a plan fails here, not in a GPU call."""
    out = smokes["axolotl_h200"].result()
    assert "0 refused" in out and "train experiments" in out


def test_packing_check_smoke(smokes):
    """The packed path on CPU (torch kernels): exact, and the unpatched control's leak detectable."""
    out = smokes["packing_check"].result()
    assert '"ok": true' in out and '"leak_detectable": true' in out


def test_packing_check_counts_a_nan_as_the_worst_difference():
    """max() keeps a NaN only in first place: a packed path giving NaN for a later sample read ok: true."""
    import math

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from packing_check import _worst
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert _worst([1e-5, math.nan]) == math.inf and _worst([1e-5, 2e-5]) == 2e-5


def test_gpu_benchmark_summaries_do_not_drop_a_nan(tmp_path):
    """axolotl_h200: a run exiting 0 with a NaN loss read ok, and max() dropped a NaN loss difference;
    train_throughput's per-step comparison dropped it the same way."""
    import json
    import math

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import axolotl_h200
        import train_throughput
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    steps = [{"loss": 2.0, "grad_norm": 1.0}, {"loss": math.nan, "grad_norm": 1.0}]
    recs = [
        {
            "name": n,
            "layers": 64,
            "seq": 4096,
            "gpus": g,
            "packing": False,
            "rc": 0,
            "sets": [],
            "steps": st,
            "summary": {"tokens_per_s": 100.0},
        }
        for n, g, st in (("l64-s4096-1gpu-ga2", 1, steps[:1] * 2), ("two", 2, steps))
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = axolotl_h200.summary([tmp_path])
    assert [r["ok"] for r in rows] == [True, False]
    (sc,) = axolotl_h200.scaling(rows)
    assert sc["max_rel_loss_diff_vs_1gpu"] == math.inf
    assert train_throughput._worst([0.1, math.nan]) == math.inf and train_throughput._worst([]) is None


def test_recompute_sweep_smoke(smokes):
    out = smokes["recompute_sweep"].result()
    assert "phases: as planned" in out


def test_trained_adapters_smoke(smokes):
    """The GPU driver of the task adapters, on CPU: reference answers in bf16 and fp32, the estimate, a drafter
    distilled on the *bf16* target (on CPU its fp32 MTP layer met bf16 embeddings: a dtype error, now autocast)
    and the drafter's served checkpoint."""
    out = smokes["trained_adapters"].result()
    assert "smoke: toolcall reference 2 answers" in out and "drafter checked True, checkpoint True" in out


def test_cli_latency_smoke(smokes):
    out = smokes["cli_latency"].result()
    assert "| status " in out and "| rollback (no fleet)" in out and "wrote" not in out  # writes no figures


@pytest.mark.slow
def test_eval_noise_reads_the_sessions_training(trained):
    """eval_noise's --smoke trains twice; here its reading of a run and its table run on the one
    training of the session, and its call of `train` binds to the product's signature."""
    import inspect

    sys.path.insert(0, str(BENCH))
    import eval_noise

    from pipeline.train.launch import train

    cfg, res = trained
    r = eval_noise.row(res, 2.0)
    assert r == {
        "eval_loss": res.manifest.metrics.eval_loss,
        "train_loss": res.manifest.metrics.train_loss,
        "s": 2.0,
    }
    assert r["eval_loss"] > 0
    s = eval_noise.summary([r["eval_loss"], r["eval_loss"] + 0.004])
    assert s["n"] == 2 and s["range"] == pytest.approx(0.004) and s["margin_at_least"] == 0.01
    inspect.signature(train).bind(cfg, eval_noise.TINY, overrides=[], show_progress=False)


def _smoke_tests() -> set[str]:
    """Benchmarks run by a `submit(smoke, "<name>", ...)` call in this file whose result a test reads
    (`smokes["<name>"].result()`)."""
    tree = ast.parse(open(__file__).read())
    started = {
        n.args[1].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "submit" and len(n.args) > 1
        if getattr(n.args[0], "id", "") == "smoke" and isinstance(n.args[1], ast.Constant)
    }
    read = {
        n.value.slice.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "result" and isinstance(n.value, ast.Subscript)
        if isinstance(n.value.slice, ast.Constant)
    }
    return started & read


def test_every_benchmark_has_a_smoke():
    benchmarks = {p.stem for p in BENCH.glob("*.py")}
    assert benchmarks - _smoke_tests() - set(ELSEWHERE) == set(), "add a --smoke mode and a test here"
    for where in ELSEWHERE.values():
        path, _, test = where.partition("::")
        text = (REPO / path).read_text()
        assert not test or f"def {test}(" in text, where


# every benchmark's source: the scripts, and the modules of a benchmark package (benchmarks/vllm_h200/)
SOURCES = sorted(
    str(p.relative_to(BENCH))[: -len(".py")]
    for p in [*BENCH.glob("*.py"), *BENCH.glob("*/*.py")]
    if p.parent == BENCH or (p.parent / "__init__.py").exists()
)


@pytest.mark.parametrize("name", SOURCES)
def test_benchmarks_monkeypatch_nothing(name):
    """Benchmarks call the product's functions; they never assign a module attribute of the pipeline
    (`publish_mod.rollout = timed_rollout` is how publish_latency rotted)."""
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    aliases = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name.startswith("pipeline")
    } | {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipeline")
        for a in n.names
    }
    assigned = [
        f"{name}.py:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AugAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in aliases
    ]
    patched = [  # setattr(publish_mod, "rollout", ...) / monkeypatch.setattr(publish_mod, ...)
        f"{name}.py:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and "setattr" in (getattr(n.func, "id", ""), getattr(n.func, "attr", ""))
        and n.args
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id in aliases
    ]
    assert assigned + patched == []
