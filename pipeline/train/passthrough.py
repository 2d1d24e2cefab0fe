"""What `pipeline train CONFIG ... -- ARGS` may hand on, checked before anything runs.

Only arguments after an explicit `--` leave the pipeline's own options (an unknown option before
it, `--lerning-rate 0.001`, is a usage error: before, it reached axolotl and the run trained at the
config's rate). Each option after `--` is classified with the libraries' own parsers:
- an option of the launcher (`accelerate launch`: `accelerate.commands.launch.launch_command_parser`;
  `torchrun`: `torch.distributed.run.get_args_parser`), with its value, goes to the launcher;
- an axolotl config key (`--learning-rate 0.001` / `--learning_rate=0.001`, what `axolotl train`
  accepts as an override) becomes a `--set key=value` override, so the pipeline's checks of
  axolotl's schema apply to it like to any other;
- anything else is refused with the closest launcher option or config key.
axolotl's `python` launcher ignores launcher arguments (axolotl 0.19 `cli/utils/train.py`
`_launch_python_training` receives none), so launcher options with it are refused too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from pipeline.errors import UsageError
from pipeline.train.schema import key_tree


@dataclass
class Passthrough:
    launcher_args: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # key=value, as --set takes them


def _launcher_actions(launcher: str) -> dict[str, bool]:
    """{option string: takes a value} of the launcher's own argument parser."""
    if launcher == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
    elif launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    else:
        return {}
    return {s: a.nargs != 0 for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def config_keys() -> set[str]:
    """Top-level keys of axolotl's config model (with the pipeline plugin's and the shipped plugins'), from
    the cache of `pipeline.train.schema.key_tree` (no axolotl import once cached)."""
    tree = key_tree({"plugins": ["axolotl.integrations.liger.LigerPlugin"]})
    return tree.top_keys() if tree else set()


def split_passthrough(args: list[str], launcher: str) -> Passthrough:
    """Classify the arguments after `--` (see the module docstring).

    Raises UsageError naming the argument, what it is taken for, and the fix.
    """
    out = Passthrough()
    if not args:
        return out
    actions = _launcher_actions(launcher)
    keys = config_keys()
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if not name.startswith("-") or name in ("-", "--"):
            raise UsageError(
                f"`-- {a}`: only options go after `--` (launcher options, or axolotl config keys as --key value)"
            )
        key = name.lstrip("-").replace("-", "_")
        if name in actions:
            takes = actions[name] and not eq
            if takes and i + 1 >= len(args):
                raise UsageError(f"`-- {name}`: the {launcher} option needs a value")
            out.launcher_args += [a, args[i + 1]] if takes else [a]
            i += 2 if takes else 1
            continue
        if key in keys:
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise UsageError(
                        f"`-- {name}`: axolotl config key {key} needs a value (`--set {key}=VALUE`)"
                    )
                value = args[i + 1]
                i += 1
            out.overrides.append(f"{key}={value}")
            i += 1
            continue
        near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
        near_opt = difflib.get_close_matches(name, sorted(actions), n=1, cutoff=0.75)
        hint = (
            f"; did you mean the axolotl key `{near[0]}` (--set {near[0]}=...)?"
            if near
            else f"; did you mean the {launcher} option `{near_opt[0]}`?"
            if near_opt
            else ""
        )
        what = (
            f"an option of the {launcher} launcher"
            if actions
            else "a launcher option (the python launcher takes none)"
        )
        raise UsageError(f"`-- {name}` is neither {what} nor an axolotl config key{hint}")
    return out
