"""The one grammar for adapter names: registered model, served LoRA name and volume directory at once.

An adapter name is used verbatim as
  - the MLflow registered model name (MLflow refuses `/` and `:` and names that are not a unique
    path: `mlflow/utils/validation.py::_validate_model_name`) and the name of the LoggedModel that
    holds the artifact (which also refuses `.`, `%` and quotes: `_validate_logged_model_name`);
  - the stable LoRA name vLLM serves (`lora_name` of `/v1/load_lora_adapter`; vLLM itself accepts
    any string) and, with the version suffix, the model id that vLLM's filesystem resolver joins
    onto its cache directory (`os.path.join(VLLM_LORA_RESOLVER_CACHE_DIR, lora_name)`, no check:
    `vllm/plugins/lora_resolvers/filesystem_resolver.py`, so `../x` or `a/b` would leave it);
  - a directory name on the adapter volume (`<volume>/<NAME>-v<N>`, one path component, at most
    255 bytes on ext4/xfs, case-insensitive on some filesystems);
  - part of the scheduler objects `pipeline schedule emit` names (`lora-retrain-<NAME>`:
    Kubernetes DNS-1123 names, systemd units, Slurm job names).

The grammar is the strictest of them: `NAME_RE` (lower-case letters, digits and `-`; starts and
ends with a letter or digit; at most `MAX_LEN` characters, a DNS label), and no `-v<digits>`
ending, because `<NAME>-v<N>` is the name of version N (adapter `foo-v1` would otherwise be
version 1 of `foo`: same directory, same served name). Checked before any work at every entry
point (`pipeline train --name`, `register`, `publish`, `promote`, `rollback`, `run`, `canary`,
`fleet prune`, `schedule emit`...): `check_name` raises `UsageError` (exit 2) with the grammar.
A name defaulted from a config file's stem is made to fit (`default_name`).

The same check, given the names the fleet serves the base model under (`served`: vLLM's
`--served-model-name`, else the `vllm serve` model string; `ProjectConfig.served_base_names`),
also refuses a name that collides with them (`served_collision`): equal, equal but for case
(clients, gateways and people that fold case), or a name whose version N is served under
the base's name (`NAME-vN`). Writers check it before any work; readers (`status NAME`) check
the grammar only, so an entry registered before this rule can still be looked at.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeline.errors import UsageError

MAX_LEN = 63
# `\Z`, not `$`: `$` also matches before a trailing newline, and `abc\n` would become the directory `abc\n-v1`
NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\Z")
VERSION_SUFFIX_RE = re.compile(r"-v\d+\Z")
GRAMMAR = (
    f"lower-case letters, digits and '-'; starting and ending with a letter or digit; "
    f"at most {MAX_LEN} characters; not ending in '-v<digits>' (that is how version N is named)"
)


def name_problem(name: str) -> str | None:
    """Why `name` is not a valid adapter name, or None when it is."""
    if not isinstance(name, str) or not name:
        return "is empty"
    if len(name) > MAX_LEN:
        return f"is {len(name)} characters long (at most {MAX_LEN})"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "is a path, not a name (it would leave the volume directory)"
    if not NAME_RE.match(name):
        bad = sorted({c for c in name if not re.match(r"[a-z0-9-]", c)})
        if bad:
            return f"contains {', '.join(repr(c) for c in bad)}"
        return "must start and end with a lower-case letter or digit"
    if VERSION_SUFFIX_RE.search(name):
        base, _, n = name.rpartition("-v")
        return f"ends in '-v{n}': it would be the name of version {n} of adapter {base!r}"
    return None


def served_collision(name: str, served: Iterable[str]) -> str | None:
    """How adapter `name` collides with a name the fleet serves the base model under, or None.

    Compared: the name itself (clients asking for one would get the other), case-folded (a gateway
    or a person that folds case), and `NAME-vN`, the name version N of the adapter is served under.
    """
    for s in served:
        if not s:
            continue
        if name == s:
            return f"is the name the fleet serves the base model under ({s!r})"
        if name.casefold() == s.casefold():
            return f"differs only in case from {s!r}, the name the fleet serves the base model under"
        m = re.fullmatch(r"(?P<name>.+)-v(?P<version>\d+)", s, flags=re.IGNORECASE)
        if m and m["name"].casefold() == name.casefold():
            return (
                f"would serve its version {int(m['version'])} as {s!r}, the name the fleet serves the "
                "base model under"
            )
    return None


def default_name(stem: str) -> str:
    """An adapter name made from a file stem: lower-cased, other characters as `-` (`qwen3.6-27b-lora` ->
    `qwen3-6-27b-lora`). The result is still checked (`check_name`)."""
    out = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:MAX_LEN].strip("-")
    return out or stem


def check_name(name: str, what: str = "adapter name", served: Iterable[str] = ()) -> str:
    """Return `name` if it follows the grammar and collides with none of the `served` base names.

    `served`: the names the fleet serves the base model under (`ProjectConfig.served_base_names`);
    empty: the grammar only. Raises UsageError (exit 2) showing the grammar, or naming the
    served name and the settings it comes from.
    """
    why = name_problem(name)
    if why is not None:
        shown = name if len(str(name)) <= 80 else f"{str(name)[:40]}...{str(name)[-20:]}"
        raise UsageError(f"{what} {shown!r} {why}. Adapter names use: {GRAMMAR}")
    why = served_collision(name, served)
    if why is not None:
        raise UsageError(
            f"{what} {name!r} {why} (served.served_model_name, else served.model, in pipeline.yaml or "
            "$PIPELINE_SERVED__SERVED_MODEL_NAME / $PIPELINE_SERVED__MODEL): requests for it would be "
            "ambiguous; choose another adapter name"
        )
    return name
