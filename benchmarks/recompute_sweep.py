"""Activation-recompute policies measured in phases of one `pipeline train` run (benchmark only).

Loading the 64-layer base costs ~85 s per run, so `benchmarks/axolotl_h200.py` measures several
recompute policies in one run of the shipped config: this axolotl plugin's callback switches the
policy every few optimizer steps, with the mechanisms a config would use:
- `every_n_layers` / `offload`: transformers' own `gradient_checkpointing_enable(every_n_layers=k,
  offload=...)` (what `gradient_checkpointing_kwargs: {every_n_layers: k, offload: true}` makes the
  Trainer call; `offload` needs transformers >= 5.17); 0 = no recompute at all;
- `types`: pipeline.train.recompute.apply_layer_types (`pipeline_recompute_layer_types`);
- `fla_gdn`: pipeline.train.packing.route_all_rows (`pipeline_fla_gdn`).
The driver takes tokens/s and peak memory from the run's metrics.jsonl over the phase's steps after
the first (axolotl logs `memory/max_allocated` per step and resets the CUDA peak counter each log).

    RECOMPUTE_SWEEP='[{"name": "full", "every_n_layers": 1, "steps": 3}, ...]'
    RECOMPUTE_SWEEP_OUT=phases.jsonl  (one JSON line per phase: name, first/last step, layers)
    plugins: [..., benchmarks.recompute_sweep.SweepPlugin]

    python benchmarks/recompute_sweep.py --smoke   # CPU, seconds: the callback's phases on the tiny base
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from pipeline.train import packing
from pipeline.train.recompute import apply_layer_types, recompute_summary


def _inner(model):
    """The transformers model under PEFT / accelerate wrappers."""
    m = getattr(model, "module", model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m


class SweepCallback(TrainerCallback):
    def __init__(self, phases: list[dict], out: str):
        self.phases, self.out = phases, out
        self.starts = []
        step = 1
        for p in phases:
            self.starts.append(step)
            step += int(p["steps"])
        self.current = None
        self.done: dict[str, dict] = {}  # finished phases by name

    def _mean_step_s(self, name: str) -> float | None:
        t = (self.done.get(name) or {}).get("step_end_times") or []
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def _fla_gdn(self, p: dict) -> bool:
        """`fla_gdn: "best"`: whichever of the phases `full` and `full+fla_gdn` ran faster."""
        v = p.get("fla_gdn")
        if v != "best":
            return bool(v)
        a, b = self._mean_step_s("full"), self._mean_step_s("full+fla_gdn")
        return a is not None and b is not None and b < a

    def _apply(self, p: dict, model, args) -> dict:
        inner = _inner(model)
        n = int(p.get("every_n_layers", 1))
        if n <= 0:
            inner.gradient_checkpointing_disable()
        else:
            gc = {
                k: v
                for k, v in (args.gradient_checkpointing_kwargs or {}).items()
                if k not in ("every_n_layers", "offload")
            }
            extra = {"offload": True} if p.get("offload") else {}
            inner.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=gc or None, every_n_layers=n, **extra
            )
            if p.get("types"):
                apply_layer_types(inner, p["types"])
        packing.route_all_rows(self._fla_gdn(p))
        return recompute_summary(inner)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1  # the step about to run
        if step in self.starts:
            i = self.starts.index(step)
            p = self.phases[i]
            layers = self._apply(p, model, args)
            self.current = {
                **{k: v for k, v in p.items() if k != "steps"},
                "first_step": step,
                "last_step": step + int(p["steps"]) - 1,
                "layers": layers,
                "fla_gdn": packing.FLA_FOR_ALL_ROWS,
                "step_end_times": [],
            }
            print(f"sweep: phase {p['name']} from step {step}: {layers}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.current:
            return
        self.current["step_end_times"].append(time.time())
        if state.global_step == self.current["last_step"]:
            with open(self.out, "a") as f:
                f.write(json.dumps(self.current) + "\n")
            self.done[self.current["name"]] = self.current
            self.current = None


class SweepPlugin(BasePlugin):
    def pre_model_load(self, cfg):
        # the packing forward in place (unpacked rows run transformers' own until a phase sets fla_gdn)
        if cfg.model_config_type in packing.FAMILIES:
            packing.apply(cfg.model_config_type)

    def add_callbacks_pre_trainer(self, cfg, model):
        phases = json.loads(os.environ.get("RECOMPUTE_SWEEP", "[]"))
        return [SweepCallback(phases, os.environ["RECOMPUTE_SWEEP_OUT"])] if phases else []


def smoke() -> int:
    """The callback through benchmarks/axolotl_h200.py's CPU sweep, on the tiny base (no trainer, no
    training): each phase applied at its first step and recorded at its last. Exit 1 on a mismatch."""
    import tempfile
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from axolotl_h200 import SMOKE_SWEEP

    from pipeline.dev.tinybase import build_tiny_base

    tmp = Path(tempfile.mkdtemp(prefix="sweep-smoke-"))
    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_base(tmp / "base")))
    model.train()
    cb = SweepCallback(SMOKE_SWEEP, str(tmp / "phases.jsonl"))
    args = SimpleNamespace(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = SimpleNamespace(global_step=0)
    for _ in range(sum(p["steps"] for p in SMOKE_SWEEP)):
        cb.on_step_begin(args, state, None, model=model)
        state.global_step += 1
        cb.on_step_end(args, state, None)
    got = [json.loads(x) for x in (tmp / "phases.jsonl").read_text().splitlines()]
    ok = [g["name"] for g in got] == [p["name"] for p in SMOKE_SWEEP]
    for g in got:
        print(f"{g['name']:24s} steps {g['first_step']}-{g['last_step']}: {g['layers']}")
    print("phases: " + ("as planned" if ok else "DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] != ["--smoke"]:
        raise SystemExit(__doc__)
    sys.exit(smoke())
