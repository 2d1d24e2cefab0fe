"""Stand-in for bitsandbytes on a GPU host without it (scripts/gpu/bundle.sh).

axolotl and peft import bitsandbytes at module level; a bf16 LoRA run never uses it. The names
imported at module level exist as classes that raise on construction, so an 8-bit/4-bit base or an
8-bit optimizer fails loudly. No distribution metadata is shipped, so transformers'
`is_bitsandbytes_available()` reports False.
"""

from . import functional, nn, optim  # noqa: F401

__version__ = "0.0.0+stub"
__stub__ = True
