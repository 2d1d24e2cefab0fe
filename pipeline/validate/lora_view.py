"""One view of "the LoRA settings" for the shared config rules: from adapter_config.json or an axolotl config.

The rules in `pipeline.validate.config_checks` read a `LoraView`; `pipeline validate` builds it from
the adapter's `adapter_config.json` (PEFT names), `pipeline train` from the axolotl config before
axolotl starts (axolotl names, mapped as axolotl's own `loaders/adapter.py` `_build_peft_lora_config`
maps them onto peft's `LoraConfig`). `names` gives each field's name in the source for messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# PEFT LoraConfig field -> axolotl config key (axolotl/loaders/adapter.py, axolotl/utils/schemas/peft.py)
AXOLOTL_NAMES = {
    "r": "lora_r",
    "lora_alpha": "lora_alpha",
    "target_modules": "lora_target_modules",
    "target_parameters": "lora_target_parameters",
    "exclude_modules": "lora_exclude_modules",
    "layers_to_transform": "peft_layers_to_transform",
    "layers_pattern": "peft_layers_pattern",
    "rank_pattern": "lora_rank_pattern",
    "alpha_pattern": "lora_alpha_pattern",
    "use_dora": "peft_use_dora",
    "use_rslora": "peft_use_rslora",
    "modules_to_save": "lora_modules_to_save",
    "init_lora_weights": "peft_init_lora_weights",
    "layer_replication": "peft_layer_replication",
}
FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "target_parameters",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "use_rslora",
    "lora_bias",
    "bias",
    "modules_to_save",
    "init_lora_weights",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)


@dataclass
class LoraView:
    """LoRA settings by PEFT field name, the file they came from, and each field's name there."""

    source: str
    values: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)
    kind: str = "adapter"  # "adapter" (adapter_config.json) or "train" (axolotl config)

    def get(self, key: str, default=None):
        v = self.values.get(key)
        return default if v is None else v

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    @property
    def targets(self) -> list[str]:
        t = self.get("target_modules") or []
        return [t] if isinstance(t, str) else list(t)

    def as_peft(self) -> dict:
        """The settings as an adapter_config.json-like dict (for `pipeline.artifacts.peft_match`)."""
        return {k: v for k, v in self.values.items() if v is not None}

    @classmethod
    def from_adapter_config(cls, cfg) -> LoraView:
        return cls(str(cfg.path), {k: cfg.raw.get(k) for k in FIELDS}, {}, "adapter")

    @classmethod
    def from_axolotl(cls, data: dict, source: str) -> LoraView:
        values = {peft: data.get(ax) for peft, ax in AXOLOTL_NAMES.items()}
        values["peft_type"] = "LORA" if data.get("adapter") in ("lora", "qlora") else data.get("adapter")
        values["bias"] = "none"  # axolotl always builds LoraConfig(bias="none")
        if data.get("lora_target_linear"):
            values["target_modules"] = (
                "all-linear" if not values["target_modules"] else values["target_modules"]
            )
        return cls(source, values, dict(AXOLOTL_NAMES), "train")
