"""Facts of an adapter's weights file (`adapter_model.safetensors`): its state, header, tensors by
module and their values, read once through one memory map (`WeightsFacts`, mixed into
`pipeline.validate.context.Context`; declared by `pipeline.validate.facts.AdapterFacts`).

A property raises `Unavailable` when the file cannot give its fact (missing, a pickle, an unreadable
header): the check that needed it is skipped and `weights.*` reports why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.artifacts.adapter import PICKLE_WEIGHTS, WEIGHTS_FILE, AdapterConfig, lora_key_form, parse_key
from pipeline.artifacts.checkpoint import LAYER_RE
from pipeline.artifacts.hashing import DirectoryScan, sha256_file
from pipeline.artifacts.safetensors import HeaderError, TensorInfo, file_metadata, read_safetensors_header
from pipeline.serving.vllm import ALLOWED_DTYPES, BASE_EMBEDDING_SUFFIXES
from pipeline.validate.facts import Unavailable


@dataclass
class ModuleEntry:
    """One adapted module: its A/B (and bias) tensors as stored."""

    module: str  # canonical, layout-free (layers.3.self_attn.q_proj, lm_head, visual...)
    peft_module: str  # as PEFT names it (model.layers.3.self_attn.q_proj)
    layout: str | None
    a: TensorInfo | None = None
    b: TensorInfo | None = None

    @property
    def layer(self) -> int | None:
        m = LAYER_RE.match(self.module)
        return int(m.group(1)) if m else None

    @property
    def sub(self) -> str | None:
        m = LAYER_RE.match(self.module)
        return m.group(2) if m else None

    @property
    def head(self) -> str:
        return self.module.split(".")[0]

    @property
    def rank(self) -> int | None:
        return self.a.shape[0] if self.a is not None and len(self.a.shape) == 2 else None


PEAK_EXACT_ABOVE = 1024.0  # below every dtype's largest value (fp16: 65504): a bound under it is exact enough


def floats(raw: bytes, dtype: str):
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4").astype(np.float32)


@dataclass(frozen=True)
class WeightsState:
    """The weights file: state ok | missing | pickle | ambiguous | not_file | unreadable | header | empty."""

    state: str
    detail: str = ""


class WeightsFacts:
    """The weights file's facts. Needs `adapter_dir`, `scan` (the directory's regular files), `typed_cfg`
    and `rejected` (modules a keys check refused) on the class it is mixed into."""

    adapter_dir: Path
    rejected: set[str]
    scan: DirectoryScan
    typed_cfg: AdapterConfig

    @property
    def wfile(self) -> Path:
        return self.adapter_dir / WEIGHTS_FILE

    # -- the weights file --------------------------------------------------------------------------------------------
    @cached_property
    def _header_fact(self) -> tuple[WeightsState, dict[str, TensorInfo] | None]:
        w = self.wfile
        pickles = [p for p in PICKLE_WEIGHTS if (self.adapter_dir / p).exists()]
        if (w.exists() or w.is_symlink()) and w not in self.scan.files:
            kind = "a directory" if w.is_dir() and not w.is_symlink() else "a symlink or special file"
            return WeightsState("not_file", kind), None
        if pickles and w.exists():
            return WeightsState("ambiguous", pickles[0]), None
        if pickles:
            return WeightsState("pickle", pickles[0]), None
        if not w.exists():
            return WeightsState("missing"), None
        try:
            header = read_safetensors_header(w)
        except HeaderError as e:
            return WeightsState("header", str(e)), None
        except OSError as e:
            return WeightsState("unreadable", f"{w}: cannot be read ({e})"), None
        if not header:
            return WeightsState("empty"), None
        return WeightsState("ok"), header

    @property
    def weights_state(self) -> WeightsState:
        return self._header_fact[0]

    @property
    def header(self) -> dict[str, TensorInfo]:
        header = self._header_fact[1]
        if header is None:
            raise Unavailable
        return header

    @cached_property
    def weights_sha256(self) -> str:
        _ = self.header
        return sha256_file(self.wfile)

    @cached_property
    def metadata(self) -> dict | None:
        _ = self.header
        return file_metadata(self.wfile)

    # -- tensors by module -------------------------------------------------------------------------------------------
    @cached_property
    def unknown_tensors(self) -> list[str]:
        """Tensors that are no LoRA factor at all (nor a base embedding copy vLLM skips: `base_copies`)."""
        return [
            n
            for n in self.header
            if parse_key(n) is None and lora_key_form(n) is None and n not in self.base_copies
        ]

    @cached_property
    def base_copies(self) -> dict[str, TensorInfo]:
        """peft's copies of the base embed_tokens / lm_head weight (`...embed_tokens.base_layer.weight`), which vLLM
        skips at load (vllm/lora/utils.py is_base_embedding_weights): {tensor: info}."""
        return {n: i for n, i in self.header.items() if n.endswith(BASE_EMBEDDING_SUFFIXES)}

    @cached_property
    def malformed_tensors(self) -> dict[str, str]:
        """LoRA-looking tensors in a form vLLM refuses: {tensor: why}."""
        return {n: why for n in self.header if (why := lora_key_form(n)) is not None}

    @cached_property
    def modules(self) -> list[ModuleEntry]:
        """Every module with at least one A/B tensor in an accepted key form, sorted."""
        out: dict[tuple[str, str], ModuleEntry] = {}
        for name, info in self.header.items():
            k = parse_key(name)
            if k is None:
                continue
            e = out.setdefault((k.module, k.peft_module), ModuleEntry(k.module, k.peft_module, k.layout))
            setattr(e, k.kind.lower(), info)
        return sorted(out.values(), key=lambda e: (e.module, e.peft_module))

    def live(self) -> list[ModuleEntry]:
        """Modules no keys check has refused yet."""
        return [m for m in self.modules if m.peft_module not in self.rejected]

    def reject(self, m: ModuleEntry) -> None:
        self.rejected.add(m.peft_module)

    # -- tensor values ----------------------------------------------------------------------------------------------
    @cached_property
    def data(self):
        import numpy as np

        _ = self.header
        return np.memmap(self.wfile, dtype=np.uint8, mode="r")

    def values(self, info: TensorInfo):
        """A tensor's values as float32 numpy [shape] (bf16 widened exactly)."""
        import numpy as np

        raw = self.data[info.offset : info.offset + info.nbytes]
        if info.dtype == "BF16":  # bf16 is the top half of an fp32: shift it there, zero the low half
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif info.dtype == "F16":
            out = raw.view(np.float16).astype(np.float32)
        else:
            out = np.asarray(raw.view(np.float32))
        return out.reshape(info.shape)

    @cached_property
    def nonfinite(self) -> dict[str, int]:
        """{tensor: NaN/Inf count} over float tensors of an allowed dtype (raw bits: exponent all ones)."""
        import numpy as np

        out = {}
        for name, info in self.header.items():
            if info.dtype not in ALLOWED_DTYPES:
                continue
            raw = self.data[info.offset : info.offset + info.nbytes]
            if info.dtype == "F32":
                n = int(raw.view(np.float32).size - np.isfinite(raw.view(np.float32)).sum())
            else:
                u = raw.view(np.uint16)
                exp = 0x7F80 if info.dtype == "BF16" else 0x7C00
                n = int(np.count_nonzero((u & exp) == exp))
            if n:
                out[name] = n
        return out

    def configured_rank(self, m: ModuleEntry) -> int | None:
        """`r` (or its rank_pattern entry) for `m`, or None when the config cannot say."""
        try:
            return self.typed_cfg.rank_for(m.peft_module)
        except (Unavailable, TypeError, ValueError):
            return None

    def scale(self, m: ModuleEntry) -> float:
        """The scale PEFT trained `m` with (rank_pattern/alpha_pattern honoured)."""
        try:
            return self.typed_cfg.scale_for(m.peft_module)
        except Unavailable:
            return 1.0

    @cached_property
    def module_values(self) -> tuple[dict[str, float], dict[str, float]]:
        """({peft module: ||scale * B @ A||_F}, {peft module: the largest magnitude vLLM stores for it, max |A| and
        max |B| x |scale| (lora/lora_weights.py optimize() folds the scale into B): exact from PEAK_EXACT_ABOVE up,
        below it an upper bound from the Grams' diagonals}) for complete, finite, 2-D pairs; the norm from two
        r x r Grams. One read of each tensor."""
        norms, peaks = {}, {}
        for m in self.live():
            if m.a is None or m.b is None or len(m.a.shape) != 2 or len(m.b.shape) != 2:
                continue
            if m.a.name in self.nonfinite or m.b.name in self.nonfinite:
                continue
            if (r := self.configured_rank(m)) is not None and r < 1:
                continue  # `r` <= 0: config.rank says so once; the scale (0) would call every module dead
            if (
                m.a.dtype not in ALLOWED_DTYPES
                or m.b.dtype not in ALLOWED_DTYPES
                or m.b.shape[1] != m.a.shape[0]
            ):
                continue
            a, b = self.values(m.a), self.values(m.b)  # float32: the Grams are r x r
            scale = abs(self.scale(m))
            ga, gb = a @ a.T, b.T @ b
            sq = float((gb * ga).sum())
            if not math.isfinite(sq):  # float32 overflow on huge (finite) values: redo in float64
                a, b = a.astype("float64"), b.astype("float64")
                ga, gb = a @ a.T, b.T @ b
                sq = float((gb * ga).sum())
            norms[m.peft_module] = scale * math.sqrt(max(sq, 0.0))
            if a.size and b.size:
                # a row norm of A (a column norm of B) bounds its largest element: read the Grams' diagonals,
                # and the elements themselves only when the bound comes near a dtype's range
                peaks[m.peft_module] = bound = max(
                    math.sqrt(max(float(ga.diagonal().max()), 0.0)),
                    math.sqrt(max(float(gb.diagonal().max()), 0.0)) * scale,
                )
                if not bound < PEAK_EXACT_ABOVE:
                    peaks[m.peft_module] = max(
                        float(a.max()), -float(a.min()), max(float(b.max()), -float(b.min())) * scale
                    )
        return norms, peaks

    @property
    def update_norms(self) -> dict[str, float]:
        """{peft module: ||scale * B @ A||_F} (`module_values`)."""
        return self.module_values[0]

    @property
    def value_peaks(self) -> dict[str, float]:
        """{peft module: max |A| and max |scale x B| (an upper bound when below PEAK_EXACT_ABOVE): `module_values`."""
        return self.module_values[1]
