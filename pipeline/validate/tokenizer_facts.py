"""Facts of the tokenizer files shipped with an adapter, against the served tokenizer: what they add
(`added_tokens`, with transformers' own rules for the side files) and what could not be compared
(`TokenizerFacts`, mixed into `pipeline.validate.context.Context` next to
`pipeline.validate.template.TemplateFacts`, which reads `_training_side` and `_added_tokens` from it).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pipeline.artifacts.bounded import load_json_file
from pipeline.artifacts.hashing import DirectoryScan
from pipeline.validate import template
from pipeline.validate.chat import SPECIAL_KEYS, ChatTokenizer, TokenizerError, has_tokenizer
from pipeline.validate.facts import Fact
from pipeline.validate.template import AddedTokens


def config_tokens(d: Path, regular=None) -> dict[str, list[str]]:
    """{file: token strings} that transformers adds to a tokenizer from the files next to tokenizer.json:
    `added_tokens.json` {token: id}, `special_tokens_map.json` values (additional_special_tokens included),
    tokenizer_config.json's special tokens (`eos_token`, `pad_token`...), `extra_special_tokens` and
    `added_tokens_decoder` (transformers 5 adds each one missing from the vocabulary: tokenization_utils_base.py
    `from_pretrained`). `regular(path)` says which files may be read (default: regular files, no links)."""

    regular = regular or (lambda p: p.is_file() and not p.is_symlink())
    out: dict[str, list[str]] = {}
    for name in ("added_tokens.json", "special_tokens_map.json", "tokenizer_config.json"):
        p = Path(d) / name
        if not regular(p):
            continue
        try:  # within size, depth and number bounds (a BoundsError is a ValueError)
            data = load_json_file(p, 16 << 20)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "added_tokens.json":
            values = list(data)
        elif name == "special_tokens_map.json":
            values = list(data.values())
        else:
            extra, decoder = data.get("extra_special_tokens"), data.get("added_tokens_decoder")
            values = [data.get(k) for k in SPECIAL_KEYS]
            values += list(extra.values()) if isinstance(extra, dict) else [extra]
            values += list(decoder.values()) if isinstance(decoder, dict) else []
        tokens: list[str] = []
        for v in values:
            for x in v if isinstance(v, list) else [v]:
                text = x.get("content") if isinstance(x, dict) else x
                if isinstance(text, str):
                    tokens.append(text)
        out[name] = tokens
    return out


class TokenizerFacts:
    """The adapter's tokenizer files. Needs `adapter_dir`, `base_dir`, `options` (`training_config`), `scan`
    and TemplateFacts' `served_tokenizer` / `training` on the class it is mixed into."""

    adapter_dir: Path
    base_dir: Path | None
    scan: DirectoryScan

    @cached_property
    def adapter_tokenizer(self) -> Fact[ChatTokenizer]:
        """The tokenizer files shipped with the adapter (an empty fact when there are none)."""
        if (
            not has_tokenizer(self.adapter_dir)
            or (self.adapter_dir / "tokenizer.json") not in self.scan.files
        ):
            return Fact()
        return Fact.of(lambda: ChatTokenizer.load(self.adapter_dir), TokenizerError, OSError)

    @property
    def training_where(self) -> str:
        return str(self.options.training_config or self.adapter_dir)

    def _training_side(self):
        return template.training_side(self.adapter_dir, self.options.training_config, self.base_dir)

    def _added_tokens(self) -> AddedTokens:
        """Tokens the adapter's tokenizer files add that the served tokenizer lacks: tokenizer.json's
        added_tokens, and what transformers also adds when it loads the tokenizer: `added_tokens.json` {token: id},
        `special_tokens_map.json` values and additional_special_tokens, tokenizer_config.json's special tokens
        (`eos_token`, `pad_token`...), `extra_special_tokens` and `added_tokens_decoder` (transformers 5 adds each
        one missing from the vocabulary: tokenization_utils_base.py `from_pretrained`)."""
        atok, served = self.adapter_tokenizer.value, self.served_tokenizer.value
        if served is None:
            return AddedTokens([], "")
        s_added, s_vocab = served.added(), served.vocab()
        # what transformers adds to the served tokenizer from the same kind of files (vLLM loads it with transformers)
        s_vocab = set(s_vocab) | {t for ts in config_tokens(served.path).values() for t in ts}
        added, where = [], ""
        if atok is not None:
            added = sorted((t, i) for t, i in atok.added().items() if t not in s_added)
            where = str(self.adapter_dir / "tokenizer.json") if added else ""
        for name, tokens in self._slow_tokenizer_tokens().items():
            new = sorted({t for t in tokens if t not in s_vocab and t not in {a for a, _ in added}})
            if new:
                added += [(t, None) for t in new]
                where = where or str(self.adapter_dir / name)
        return AddedTokens(added, where)

    def _slow_tokenizer_tokens(self) -> dict[str, list[str]]:
        """{file: token strings} transformers adds from the adapter's tokenizer files besides tokenizer.json
        (`config_tokens`; regular files only: an unreadable one is tokenizer.unreadable's finding when
        tokenizer.json loads it)."""
        return config_tokens(self.adapter_dir, lambda p: p in self.scan.files)

    @property
    def template_unchecked(self) -> str | None:
        if self.training.value is None and self.training.missing is None:
            return (
                "no training template found (no resolved axolotl config, no chat template or tokenizer files with "
                "the adapter): tokenizer and chat template not compared; pass --training-config"
            )
        if self.served_tokenizer.value is None and self.served_tokenizer.missing is None:
            return "no served or base tokenizer available: tokenizer and chat template not compared"
        return None
