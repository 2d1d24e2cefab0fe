"""What PEFT itself declares about a LoRA config's fields, read from the installed peft's source with `ast`.

Importing peft would import torch (seconds); static validation stays torch-free, so the facts are read
from peft's files (`importlib.util.find_spec`, never executed), each parsed once:
- `lora_config_fields()`: the fields `LoraConfig` and its bases declare (peft/tuners/lora/config.py,
  peft/config.py). A field in adapter_config.json that the pipeline's peft does not declare (e.g.
  `kasa_config` from another PEFT release) is dropped by vLLM's PEFTHelper and by this peft: whatever
  it does is not served;
- `variant_fields()`: fields whose metadata says `is_lora_variant` (`LoraLayer.resolve_lora_variant`
  picks a `LoraVariant` for them: DoRA, aLoRA, QALoRA, VeLoRA, MonteCLoRA, BD-LoRA, Arrow...): a variant
  replaces LoRA's forward, which vLLM does not run;
- `base_mutating_inits()`: the `init_lora_weights` values whose init method (dispatched in
  `LoraLayer.update_layer`, peft/tuners/lora/layer.py) writes the base layer's weight (PiSSA, OLoRA,
  CorDA, LoftQ, LoRA-GA: `self.get_base_layer().weight.data = ...`): the trained adapter is relative to
  a modified base, and vLLM serves it on the unmodified one;
- `known_init()`: whether a string `init_lora_weights` is one peft dispatches at all (every test on the value in
  `LoraLayer`, `update_layer` and `reset_lora_parameters`); any other string makes peft raise `ValueError:
  Unknown initialization` when it creates or loads the adapter, and vLLM 0.32+ refuses it
  (lora/peft_helper.py `_init_is_supported`).
Source: peft 0.20 (`peft_version()`); `tests/validate/test_peft_features.py` pins what it derives.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

# Fields every PeftConfig carries besides LoraConfig's (peft/config.py PeftConfigMixin/PeftConfig), as a
# fallback when that file cannot be read.
_BASE_FIELDS = {
    "peft_type",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
}


def _peft_root() -> Path | None:
    spec = importlib.util.find_spec("peft")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


@cache
def _tree(rel: str) -> ast.Module | None:
    root = _peft_root()
    if root is None or not (root / rel).is_file():
        return None
    return ast.parse((root / rel).read_text())


def _class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for n in ast.walk(tree) if tree else ():
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n
    return None


@cache
def peft_version() -> str | None:
    root = _peft_root()
    init = root / "__init__.py" if root else None
    m = re.search(r'__version__\s*=\s*"([^"]+)"', init.read_text()) if init and init.is_file() else None
    return m.group(1) if m else None


def _metadata(value: ast.expr | None) -> dict:
    """The literal keys/values of `field(..., metadata={...})` (non-literal values as None)."""
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field"):
        return {}
    for kw in value.keywords:
        if kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
            out = {}
            for k, v in zip(kw.value.keys, kw.value.values, strict=True):
                if isinstance(k, ast.Constant):
                    try:
                        out[k.value] = ast.literal_eval(v)
                    except ValueError:
                        out[k.value] = None
            return out
    return {}


@cache
def _lora_config() -> dict[str, dict]:
    cls = _class(_tree("tuners/lora/config.py"), "LoraConfig")
    if cls is None:
        return {}
    return {
        n.target.id: _metadata(n.value)
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


@cache
def lora_config_fields() -> frozenset[str]:
    """Every field name an adapter_config.json written by this peft can hold (empty: peft not found)."""
    fields = set(_lora_config())
    if not fields:
        return frozenset()
    base = _tree("config.py")
    for name in ("PeftConfigMixin", "PeftConfig"):
        cls = _class(base, name)
        for n in cls.body if cls else ():
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                fields.add(n.target.id)
    return frozenset(fields | _BASE_FIELDS)


@cache
def variant_fields() -> frozenset[str]:
    """LoraConfig fields tagged `is_lora_variant` (a LoraVariant replaces LoRA's forward for them)."""
    return frozenset(k for k, meta in _lora_config().items() if meta.get("is_lora_variant"))


def _init_condition(test: ast.expr) -> tuple[str, str] | None:
    """(value, "eq" | "prefix") of a test on `init_lora_weights` (== "x", .lower() == "x", .startswith("x"))."""
    src = ast.unparse(test)
    if "init_lora_weights" not in src:
        return None
    m = re.search(r"init_lora_weights(?:\.lower\(\))?\s*==\s*['\"]([^'\"]+)['\"]", src)
    if m:
        return m.group(1), "eq"
    m = re.search(r"init_lora_weights\.startswith\(['\"]([^'\"]+)['\"]\)", src)
    return (m.group(1), "prefix") if m else None


def _writes_base_weight(fn: ast.FunctionDef) -> bool:
    """The method assigns `<base layer>.weight` or `.weight.data`, the base layer being
    `self.get_base_layer()` or a name bound to it."""
    bound = {"self.get_base_layer()"}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and ast.unparse(n.value) in bound:
            bound |= {ast.unparse(t) for t in n.targets}
    for n in ast.walk(fn):
        if not isinstance(n, ast.Assign):
            continue
        for t in n.targets:
            text = ast.unparse(t)
            for b in bound:
                if text in (f"{b}.weight", f"{b}.weight.data"):
                    return True
    return False


@cache
def init_values() -> frozenset[tuple[str, str]]:
    """Every (value, "eq" | "prefix") `LoraLayer` tests `init_lora_weights` against (empty: peft not found)."""
    cls = _class(_tree("tuners/lora/layer.py"), "LoraLayer")
    if cls is None:
        return frozenset()
    return frozenset(c for n in ast.walk(cls) if isinstance(n, ast.If) and (c := _init_condition(n.test)))


def known_init(init) -> bool:
    """Whether peft dispatches this `init_lora_weights` (a bool always; a string only if some test of
    `LoraLayer` names it, compared case-insensitively so that no value peft accepts is called unknown).
    True when peft's source cannot be read (nothing to compare with)."""
    if not isinstance(init, str):
        return True
    values = init_values()
    low = init.lower()
    return not values or any(
        (how == "eq" and low == v.lower()) or (how == "prefix" and low.startswith(v.lower()))
        for v, how in values
    )


def known_init_names() -> list[str]:
    """The string inits peft knows, for messages: `'eva'`, `'pissa...'` (a prefix)."""
    prefixes = {v for v, how in init_values() if how == "prefix"}
    eq = {v for v, how in init_values() if how == "eq"} - prefixes
    return sorted([f"'{v}'" for v in eq] + [f"'{v}...'" for v in prefixes])


@cache
def base_mutating_inits() -> dict[tuple[str, str], str]:
    """{(init value, "eq" | "prefix"): init method} for the inits whose method writes the base weight."""
    cls = _class(_tree("tuners/lora/layer.py"), "LoraLayer")
    if cls is None:
        return {}
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    out = {}
    for n in ast.walk(cls):
        if not isinstance(n, ast.If) or (cond := _init_condition(n.test)) is None:
            continue
        for call in ast.walk(ast.Module(body=n.body, type_ignores=[])):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and ast.unparse(call.func.value) == "self"
                and call.func.attr.endswith("_init")
                and call.func.attr in methods
            ):
                if _writes_base_weight(methods[call.func.attr]):
                    out[cond] = call.func.attr
                break
    return out


def mutates_base(init) -> str | None:
    """The peft init method that writes the base weight for this `init_lora_weights` value, or None."""
    if not isinstance(init, str):
        return None
    for (value, how), method in base_mutating_inits().items():
        low = init.lower()
        if (how == "eq" and low == value.lower()) or (how == "prefix" and low.startswith(value.lower())):
            return method
    return None
