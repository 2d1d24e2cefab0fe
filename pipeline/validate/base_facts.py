"""Facts of an adapter against the base and served checkpoints (headers, and a few sampled rows of the
base): the base's modules per layer, the served geometry, the expected weights size, the dtype the
fleet computes in, the adapter's effect relative to the base weights (`BaseFacts`, mixed into
`pipeline.validate.context.Context`; declared by `pipeline.validate.facts.AdapterFacts`).
"""

from __future__ import annotations

import math
import os
from functools import cached_property
from pathlib import Path

from pipeline.artifacts.checkpoint import GEOMETRY_KEYS, LAYER_RE
from pipeline.artifacts.peft_match import peft_targets
from pipeline.artifacts.safetensors import DTYPE_BYTES, TensorInfo, raw_header
from pipeline.serving.vllm import ALLOWED_DTYPES, QWEN35_MODULES
from pipeline.validate.weights_facts import ModuleEntry, floats

# Machine epsilon (gap between 1 and the next value) of the dtypes the engine computes in.
EFFECT_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}
BASE_SAMPLE_ROWS = 8


def sampled_frobenius(path: Path, info: TensorInfo, rows: int = BASE_SAMPLE_ROWS) -> float | None:
    """||W||_F of a 2-D bf16/fp16/fp32 tensor estimated from `rows` rows spread evenly over it (one `pread`
    each: a memory map of a 27B shard costs ~70 ms per module in page-fault read-ahead, measured)."""
    import numpy as np

    out_f, in_f = info.shape
    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    picks = sorted({int(i) for i in np.linspace(0, out_f - 1, min(rows, out_f))})
    sq = 0.0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for i in picks:
            raw = os.pread(fd, in_f * per, info.offset + i * in_f * per)
            if len(raw) != in_f * per:
                return None
            if info.dtype == "BF16":  # bf16 is the top half of an fp32
                v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                v = np.frombuffer(raw, dtype="<f2" if info.dtype == "F16" else "<f4").astype(np.float32)
            sq += float(np.dot(v, v))
    except OSError:
        return None
    finally:
        os.close(fd)
    if not picks or not math.isfinite(sq):  # a non-finite base weight: no norm to compare with
        return None
    return (sq / len(picks) * out_f) ** 0.5


def _row(data, info: TensorInfo, i: int):
    """Row `i` of a 2-D float tensor of the memory-mapped weights file, as float32."""
    import numpy as np

    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    n = info.shape[1] * per
    return floats(np.asarray(data[info.offset + i * n : info.offset + (i + 1) * n]).tobytes(), info.dtype)


def _pread_row(path: Path, info: TensorInfo, i: int):
    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    n = info.shape[1] * per
    try:
        with open(path, "rb") as f:
            raw = os.pread(f.fileno(), n, info.offset + i * n)
    except OSError:
        return None
    return floats(raw, info.dtype) if len(raw) == n else None


def _round_to(v, dtype: str):
    """float32 values rounded to `dtype` (round to nearest even), back in float32."""
    import numpy as np

    if v is None or dtype == "F32":
        return v
    if dtype == "F16":
        return v.astype(np.float16).astype(np.float32)
    u = v.view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


class BaseFacts:
    """The adapter against the base and served checkpoints. Needs the weights facts (`header`, `data`,
    `modules`, `live`, `update_norms`, `typed_cfg`, `wfile`: `WeightsFacts`) and the checkpoints (`base`,
    `served`, `base_fact`, `served_fact`: `pipeline.validate.facts.CheckpointFacts`) on the class it is
    mixed into."""

    def base_copy_difference(self, name: str) -> str | None:
        """How a base copy differs from the base's own weight (shape, or values in sampled rows compared in the
        coarser of the two dtypes), or None when it is the base's weight. Unavailable without a base."""
        import numpy as np

        info = self.header[name]
        module = "embed_tokens" if name.endswith(".embed_tokens.base_layer.weight") else "lm_head"
        base = self.base
        w = base.modules.get(module) or (base.modules.get("embed_tokens") if module == "lm_head" else None)
        if w is None:
            return f"the base has no {module} weight"
        if list(info.shape) != list(w.shape):
            return f"shape {list(info.shape)} vs the base's {module} {list(w.shape)}"
        if info.dtype not in ALLOWED_DTYPES or w.dtype not in ALLOWED_DTYPES or len(w.shape) != 2:
            return None if info.dtype == w.dtype else f"dtype {info.dtype} vs the base's {w.dtype}"
        rows, cols = w.shape
        picks = sorted({int(i) for i in np.linspace(0, rows - 1, min(BASE_SAMPLE_ROWS * 4, rows))})
        coarse = min((info.dtype, w.dtype), key=lambda d: {"BF16": 0, "F16": 1, "F32": 2}[d])
        for i in picks:
            mine = _round_to(_row(self.data, info, i), coarse)
            theirs = _round_to(_pread_row(base.path / w.file, w, i), coarse)
            if theirs is None:
                return None  # the base cannot be read here: base.unreadable says so
            if not np.array_equal(mine, theirs, equal_nan=True):
                return f"row {i} differs from the base's {module} (first of the sampled rows that do)"
        return None

    # -- base and served checkpoints (CheckpointFacts) ---------------------------------------------------------------
    @property
    def modules_or_none(self) -> list[ModuleEntry] | None:
        return self.modules

    @cached_property
    def served_geometry_diffs(self) -> list[str]:
        """Text geometry keys (hidden size, layers, heads...) in which the served checkpoint differs from the base."""
        base, served = self.base, self.served
        return [
            f"{k}: base {base.text_config.get(k)!r} vs served {served.text_config.get(k)!r}"
            for k in GEOMETRY_KEYS
            if k in base.text_config
            and k in served.text_config
            and base.text_config[k] != served.text_config[k]
        ]

    @cached_property
    def base_layer_modules(self) -> list[set[str]]:
        """Module paths within each decoder layer of the base (`Checkpoint.layer_modules` for every layer, in one
        pass over its modules)."""
        base = self.base
        out: list[set[str]] = [set() for _ in range(base.num_layers)]
        for name in base.modules:
            mm = LAYER_RE.match(name)
            if mm and int(mm.group(1)) < base.num_layers:
                out[int(mm.group(1))].add(mm.group(2))
        return out

    def allowed_modules(self, layer: int) -> set[str]:
        """Modules vLLM can patch on `layer` of the base (by layer type)."""
        types = self.base.layer_types
        lt = types[layer] if layer < len(types) else "full_attention"
        return QWEN35_MODULES.get(lt, set()) | QWEN35_MODULES["any"]

    @cached_property
    def expected_weights(self) -> tuple[int | None, int]:
        """(bytes the weights file should hold, LoRA parameters) from r (+rank_pattern), PEFT's matching of
        target_modules and the base's shapes, in the file's dominant dtype; (None, 0) when `r` says nothing."""
        cfg, base, header = self.typed_cfg, self.base, self.header
        if not cfg.r or cfg.r < 1:  # config.rank reports it; no size follows from it
            return None, 0
        dtypes = [t.dtype for t in header.values()]
        per = DTYPE_BYTES.get(max(set(dtypes), key=dtypes.count), 2) if dtypes else 2
        layouts = {m.layout for m in self.modules if m.layout}
        prefix = "model.language_model." if layouts == {"vl"} else "model."
        params = 0
        for i in range(base.num_layers):
            for sub in self.base_layer_modules[i] & self.allowed_modules(i):
                name = f"{prefix}layers.{i}.{sub}"
                if peft_targets(cfg.raw, name) and (shape := base.linear_shape(f"layers.{i}.{sub}")):
                    params += cfg.rank_for(name) * (shape[0] + shape[1])
        return params * per + raw_header(self.wfile)[0], params

    @property
    def expected_weights_bytes(self) -> int | None:
        expected, params = self.expected_weights
        return expected if params else None

    @cached_property
    def serving_dtype(self) -> str:
        """The dtype the engine computes module outputs in: the served (else base) checkpoint's `torch_dtype`
        / `dtype` (vLLM --dtype auto; NVFP4 checkpoints compute in bf16), bfloat16 when neither says."""
        for ck in (self.served_fact.value, self.base_fact.value):
            if ck is not None:
                d = (
                    ck.config.get("torch_dtype")
                    or ck.config.get("dtype")
                    or ck.text_config.get("torch_dtype")
                )
                if isinstance(d, str) and d in EFFECT_EPS:
                    return d
        return "bfloat16"

    @cached_property
    def relative_effect(self) -> dict[str, float]:
        """{peft module: ||scale * B @ A||_F / ||W||_F} against the bf16 base weight W of the module.

        ||W||_F is estimated from `BASE_SAMPLE_ROWS` rows spread over W ([out, in], row RMS x sqrt(out)):
        a few hundred KB per module instead of the whole base. Modules whose base weight is not a readable
        float matrix, or is all zero, are left out."""
        out = {}
        base = self.base
        for m in self.live():
            n = self.update_norms.get(m.peft_module)
            info = base.modules.get(m.module)
            if n is None or info is None or len(info.shape) != 2 or info.dtype not in ALLOWED_DTYPES:
                continue
            w = sampled_frobenius(base.path / info.file, info)
            if w:
                out[m.peft_module] = n / w
        return out
