"""Which modules a PEFT LoRA config targets, decided exactly as PEFT decides it (without importing peft).

Source: peft/tuners/tuners_utils.py `check_target_module_exists` (peft 0.20), which
`tests/artifacts/test_peft_match.py` checks this module against on generated configs:
1. `exclude_modules` (a regex fullmatch, or exact names / dotted suffixes) excludes;
2. a module inside `modules_to_save` is excluded;
3. `target_modules` None with `target_parameters` set targets no module;
4. `target_modules` a string: regex fullmatch against the module name (`layers_to_transform` not applied);
5. a list: the exact name (then `layers_to_transform` is not applied either), or a dotted suffix, then
   `layers_to_transform` keeps only layers whose index (the first `.<layers_pattern>.<N>.` or, without a
   pattern, the first `.<any>.<N>.` of the name) is listed.
Importing peft would import torch (seconds); validation without `--behaviour` stays torch-free.
"""

from __future__ import annotations

import re

ALL_LINEAR = "all-linear"  # peft INCLUDE_LINEAR_LAYERS_SHORTHAND, expanded at get_peft_model time


def layer_index(raw: dict, module: str) -> int | None:
    """The layer index PEFT reads from `module` for `layers_to_transform`, or None."""
    pattern = raw.get("layers_pattern")
    if pattern is None or len(pattern) == 0:
        m = re.match(r".*?\.[^.]*\.(\d+)\.", module)
    else:
        m = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            m = re.match(rf".*?\.{p}\.(\d+)\.", module)
            if m is not None:
                break
    return int(m.group(1)) if m else None


def peft_targets(raw: dict, module: str) -> bool:
    """Whether PEFT puts a LoRA on `module` (its name in the PEFT model, e.g. `model.layers.3.mlp.up_proj`).

    `raw` is adapter_config.json; call it only on a config that passed the typed schema
    (regexes compile). `"all-linear"` (only in a config written before get_peft_model expanded it)
    targets every module but `lm_head`.
    """
    exclude = raw.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, module):
                return False
        elif module in exclude or any(module.endswith(f".{e}") for e in exclude):
            return False
    for m in raw.get("modules_to_save") or []:
        if re.match(rf"(^|.*\.){m}($|\..*)", module):
            return False
    targets = raw.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return not module.endswith("lm_head")
        return re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not any(module.endswith(f".{t}") for t in targets):
        return False
    indexes = raw.get("layers_to_transform")
    using = indexes is not None and (len(indexes) != 0 if isinstance(indexes, list) else True)
    if not using:
        return True
    idx = layer_index(raw, module)
    if idx is None:
        return False
    return idx == indexes if isinstance(indexes, int) else idx in indexes


def matching_entries(raw: dict, modules: list[str]) -> dict[str, list[str]]:
    """{target_modules entry: the modules whose name it matches (suffix or exact)} for a list config;
    for a regex config, {regex: matches}. Entries matching nothing show what is absent from the base."""
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return {targets: list(modules)}
        return {targets: [m for m in modules if re.fullmatch(targets, m)]}
    return {t: [m for m in modules if m == t or m.endswith(f".{t}")] for t in targets or []}
