"""axolotl's own config schema, applied before anything is written: unknown keys and invalid values.

axolotl validates its YAML with a pydantic model (`axolotl.utils.schemas.config.AxolotlInputConfig`,
merged with the input models of the config's `plugins` by `axolotl.integrations.config.merge_input_args`)
whose `extra` setting is pydantic's default, *ignore*: a misspelt key (`learning_rat: 0.001`) is
dropped without a word and the run trains at the config's rate. The pipeline walks the same
models (nested ones too: each `datasets` entry against axolotl's dataset models, `fsdp_config`,
...) and refuses every key none of them declares, naming where it came from (the config file,
an overlay, or `--set`) and the closest known key (difflib). Then axolotl's `validate_config`
checks the values.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from dataclasses import dataclass

from pipeline.errors import CheckFailed
from pipeline.train.config import TrainingConfig

# Keys the pipeline itself reads from an axolotl config (axolotl's models do not declare them).
# `base_model_revision`: the base's pinned commit; `pipeline train` passes it to axolotl as
# `revision_of_model` (axolotl's name, alias `model_revision`), which is what its loaders read.
PIPELINE_KEYS = frozenset({"base_model_revision"})
# The pipeline's own axolotl plugin: `pipeline train` adds it to every run (its keys: pipeline.train.recompute).
PLUGIN = "pipeline.train.axolotl_plugin.PipelinePlugin"


@dataclass
class UnknownKey:
    path: str  # dotted, e.g. "learning_rat" or "datasets[0].feld_messages"
    origin: str  # where the key came from: "--set", an overlay file, the config file
    suggestion: str | None

    def __str__(self) -> str:
        hint = f"; did you mean `{self.suggestion}`?" if self.suggestion else ""
        return f"{self.origin}: `{self.path}` is not an axolotl setting{hint}"


def _models_in(annotation) -> list[type]:
    """The pydantic model classes an annotation admits (through Optional, Union, list, Annotated)."""
    from pydantic import BaseModel

    out: list[type] = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append(a)
            continue
        origin = typing.get_origin(a)
        if origin is typing.Annotated:
            stack.append(typing.get_args(a)[0])
        elif origin in (typing.Union, types.UnionType, list, tuple, set, frozenset):
            stack.extend(typing.get_args(a))
    return out


def _names(model: type) -> dict[str, object]:
    """{accepted key: field annotation} of a pydantic model (field names and their aliases)."""
    out: dict[str, object] = {}
    for name, f in model.model_fields.items():
        out[name] = f.annotation
        for alias in (f.alias, f.validation_alias):
            if isinstance(alias, str):
                out[alias] = f.annotation
    return out


def model_keys(models: list[type]) -> set[str]:
    """Every top-level key (field names and aliases) the models accept."""
    return {k for m in models for k in _names(m)}


def _allows_extra(models: list[type]) -> bool:
    return any(m.model_config.get("extra") == "allow" for m in models)


def unknown_keys(data: dict, models: list[type], prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted path, closest known key) for every key of `data` that none of `models` declares.

    Nested mappings (and lists of mappings) are checked against the models their field admits;
    a field whose annotation admits no model (a plain dict, `Any`) is not looked into.
    """
    if _allows_extra(models):
        return []
    known: dict[str, list] = {}
    for m in models:
        for k, ann in _names(m).items():
            known.setdefault(k, []).append(ann)
    out: list[tuple[str, str | None]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            out.append((path, close[0] if close else None))
            continue
        sub = [m for ann in known[key] for m in _models_in(ann)]
        if not sub:
            continue
        if isinstance(value, dict):
            out += unknown_keys(value, sub, f"{path}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out += unknown_keys(item, sub, f"{path}[{i}].")
    return out


def axolotl_models(data: dict) -> list[type]:
    """axolotl's input config model, merged with the input models of the config's plugins and the pipeline's."""
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    plugins = list(dict.fromkeys([*(data.get("plugins") or []), PLUGIN]))  # `pipeline train` adds its own
    if plugins:
        try:
            prepare_plugins(DictDefault({"plugins": plugins}))
        except Exception as e:  # a plugin that cannot be imported: axolotl would fail the same way
            raise CheckFailed(f"axolotl plugins {plugins}: cannot load ({e})") from None
    _, model = merge_input_args()
    return [model]


def _origin(tc: TrainingConfig, path: str) -> str:
    top = path.split(".")[0].split("[")[0]
    return tc.origins.get(path) or tc.origins.get(top) or str(tc.path)


def check_known_keys(tc: TrainingConfig) -> None:
    """Raise CheckFailed listing every key axolotl does not know, where it came from, and the closest one."""
    data = {k: v for k, v in tc.data.items() if k not in PIPELINE_KEYS}
    found = [UnknownKey(p, _origin(tc, p), s) for p, s in unknown_keys(data, axolotl_models(tc.data))]
    if found:
        raise CheckFailed(
            f"{tc.path}: {len(found)} setting(s) axolotl does not know (it would ignore them silently):\n  "
            + "\n  ".join(map(str, found))
        )


def check_axolotl_schema(tc: TrainingConfig) -> None:
    """axolotl's own config validation, in this process, before any run directory or MLflow run
    exists: first unknown keys (`check_known_keys`), then axolotl's `validate_config` on the
    values (otherwise a typo like `micro_batch_size: abc` fails inside the trainer).

    Raises CheckFailed with one line per key or field axolotl rejects.
    """
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

    check_known_keys(tc)
    try:
        data = json.loads(json.dumps(tc.data))
        data["plugins"] = list(
            dict.fromkeys([*(data.get("plugins") or []), PLUGIN])
        )  # as `pipeline train` runs it
        validate_config(DictDefault(data))
    except ValidationError as e:
        lines = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise CheckFailed(f"{tc.path}: axolotl refuses the config:\n  " + "\n  ".join(lines)) from None
    except ValueError as e:
        raise CheckFailed(f"{tc.path}: axolotl refuses the config: {e}") from None
