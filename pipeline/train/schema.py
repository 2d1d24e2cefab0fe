"""axolotl's own config schema, applied before anything is written: unknown keys and invalid values.

axolotl validates its YAML with a pydantic model (`axolotl.utils.schemas.config.AxolotlInputConfig`,
merged with the input models of the config's `plugins` by `axolotl.integrations.config.merge_input_args`)
whose `extra` setting is pydantic's default, *ignore*: a misspelt key (`learning_rat: 0.001`) is
dropped without a word and the run trains at the config's rate. The pipeline walks the same
models (nested ones too: each `datasets` entry against axolotl's dataset models, `fsdp_config`,
...) and refuses every key none of them declares, naming where it came from (the config file,
an overlay, or `--set`) and the closest known key (difflib). Then axolotl's `validate_config`
checks the values.

Importing axolotl costs 10-20 s, so the keys its models accept are kept as data (`KeyTree`: each
model's keys and the models a key's value is checked against) in a cache file keyed by what
decides them (axolotl's, pydantic's and each plugin's distribution version; the pipeline plugin's
source): the first check with a new key computes it, every later one refuses a typo in well under
a second without importing axolotl or torch (benchmarks/cli_latency.py, `train` option typo).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.atomic import write_json_atomic
from pipeline.errors import CheckFailed
from pipeline.train.config import TrainingConfig, load_training_config

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class KeyTree:
    """The keys pydantic models accept, as data: `models` {model id: {"extra": allows any key,
    "keys": {key: [ids of the models the key's value is checked against]}}}, `root` the top-level
    models' ids. Built once from the models (`of`), then read without importing them."""

    models: dict[str, dict]
    root: list[str]

    @classmethod
    def of(cls, models: list[type]) -> KeyTree:
        ids: dict[type, str] = {}
        out: dict[str, dict] = {}
        stack = list(models)
        while stack:
            m = stack.pop()
            if m in ids:
                continue
            ids[m] = str(len(ids))
            stack.extend(s for ann in _names(m).values() for s in _models_in(ann))
        for m, i in ids.items():
            keys = {k: [ids[s] for s in _models_in(ann)] for k, ann in _names(m).items()}
            out[i] = {"extra": m.model_config.get("extra") == "allow", "keys": keys}
        return cls(out, [ids[m] for m in models])

    def top_keys(self) -> set[str]:
        return {k for i in self.root for k in self.models[i]["keys"]}


def unknown_keys(data: dict, schema: KeyTree | list[type], prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted path, closest known key) for every key of `data` that none of the models declares.

    `schema`: the models, or their `KeyTree`. Nested mappings (and lists of mappings) are checked
    against the models their field admits; a field whose annotation admits no model (a plain
    dict, `Any`) is not looked into.
    """
    tree = schema if isinstance(schema, KeyTree) else KeyTree.of(schema)
    return _unknown(data, tree, tree.root, prefix)


def _unknown(data: dict, tree: KeyTree, ids: list[str], prefix: str) -> list[tuple[str, str | None]]:
    if any(tree.models[i]["extra"] for i in ids):
        return []
    known: dict[str, list[str]] = {}
    for i in ids:
        for k, subs in tree.models[i]["keys"].items():
            known.setdefault(k, []).extend(subs)
    out: list[tuple[str, str | None]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            out.append((path, close[0] if close else None))
            continue
        sub = list(dict.fromkeys(known[key]))
        if not sub:
            continue
        if isinstance(value, dict):
            out += _unknown(value, tree, sub, f"{path}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out += _unknown(item, tree, sub, f"{path}[{i}].")
    return out


# The sources of the pipeline plugin's input model (`PLUGIN.get_input_args`): part of the cache key.
PLUGIN_SOURCES = ("axolotl_plugin.py", "recompute.py")
KEY_TREE_FORMAT = 1


def _plugins(data: dict) -> list[str]:
    return list(dict.fromkeys([*(data.get("plugins") or []), PLUGIN]))  # `pipeline train` adds its own


def _cache_key(plugins: list[str]) -> str | None:
    """What decides the keys axolotl accepts with `plugins`, hashed; None when a plugin's code cannot be
    named without importing it (a plugin outside a distribution named as its top-level package): then
    nothing is cached."""
    from importlib import metadata

    try:  # (not `packages_distributions()`: it reads every installed distribution's RECORD, ~2 s)
        parts: dict = {
            "format": KEY_TREE_FORMAT,
            "axolotl": metadata.version("axolotl"),
            "pydantic": metadata.version("pydantic"),
            "plugins": plugins,
        }
        for p in plugins:
            top = p.split(".")[0]
            if p == PLUGIN:
                here = Path(__file__).parent
                parts[p] = [hashlib.sha256((here / f).read_bytes()).hexdigest() for f in PLUGIN_SOURCES]
            elif top != "axolotl":  # axolotl's own plugins: its version says it
                parts[p] = metadata.version(top)  # a distribution named as its package, else not cached
    except (metadata.PackageNotFoundError, OSError):
        return None
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_dir() -> Path | None:
    """`$PIPELINE_CACHE_DIR`, else `$XDG_CACHE_HOME/lora-pipeline`, else `~/.cache/lora-pipeline`; None for a
    user without a home directory (a service account): nothing is cached then."""
    if d := os.environ.get("PIPELINE_CACHE_DIR"):
        return Path(d)
    if d := os.environ.get("XDG_CACHE_HOME"):
        return Path(d) / "lora-pipeline"
    home = os.path.expanduser("~")
    return Path(home) / ".cache" / "lora-pipeline" if os.path.isabs(home) else None


def key_tree(data: dict, cached_only: bool = False) -> KeyTree | None:
    """axolotl's config keys with the config's plugins and the pipeline's (`axolotl_models`) as a `KeyTree`,
    read from the cache (`cache_dir()/axolotl-keys-<key>.json`) when it holds them, else computed
    (importing axolotl: 10-20 s) and cached; a cache that cannot be read or written is passed by.

    `cached_only`: None instead of computing it. Raises CheckFailed when a plugin cannot be loaded (axolotl
    would fail the same way).
    """
    plugins = _plugins(data)
    key = _cache_key(plugins)
    where = cache_dir()
    path = where / f"axolotl-keys-{key}.json" if key and where else None
    if path is not None:
        try:
            raw = json.loads(path.read_text())
            return KeyTree(raw["models"], raw["root"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if cached_only:
        return None
    tree = KeyTree.of(axolotl_models(data))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"plugins": plugins, "models": tree.models, "root": tree.root})
        except OSError as e:
            log.debug("axolotl's config keys not cached (%s): %s", path, e)
    return tree


def axolotl_models(data: dict) -> list[type]:
    """axolotl's input config model, merged with the input models of the config's plugins and the pipeline's."""
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    plugins = _plugins(data)
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


def check_known_keys(tc: TrainingConfig, cached_only: bool = False) -> None:
    """Raise CheckFailed listing every key axolotl does not know, where it came from, and the closest one.

    `cached_only`: check only when axolotl's keys are cached (`key_tree`), else return (a later check does it).
    """
    data = {k: v for k, v in tc.data.items() if k not in PIPELINE_KEYS}
    tree = key_tree(tc.data, cached_only)
    if tree is None:
        return
    found = [UnknownKey(p, _origin(tc, p), s) for p, s in unknown_keys(data, tree)]
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
    check_known_keys(tc)  # first: from the cached keys, without importing axolotl

    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

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


def refuse_unknown_keys(
    config: Path, overrides: list[str] = (), overlays: list[Path] = (), cached_only: bool = False
) -> None:
    """`pipeline train`'s and `pipeline run`'s first check, before the trainer's heavy imports: CONFIG read with
    its overlays and `--set` overrides, and every key axolotl does not know refused (`check_known_keys`), in
    well under a second once axolotl's keys are cached (benchmarks/cli_latency.py). The full checks
    (`pipeline.train.launch.check_inputs`) still run after it.

    Raises UsageError (a missing or unreadable file, a malformed override) or CheckFailed (unknown keys).
    """
    check_known_keys(load_training_config(Path(config), list(overrides), list(overlays)), cached_only)
