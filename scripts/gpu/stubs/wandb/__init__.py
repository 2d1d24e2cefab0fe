"""Stand-in for wandb on a GPU host without it (scripts/gpu/bundle.sh).

axolotl imports wandb at module level; a LoRA run without `use_wandb` never calls it. Any real
use raises, so a config that asks for Weights & Biases fails loudly instead of logging nowhere.
"""

__version__ = "0.0.0+stub"
__stub__ = True
run = None


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("wandb is a stub on this host (scripts/gpu/bundle.sh): set use_wandb: false")


def _unavailable(*args, **kwargs):
    raise RuntimeError("wandb is a stub on this host (scripts/gpu/bundle.sh): set use_wandb: false")


init = login = log = finish = define_metric = watch = save = _unavailable
Table = Artifact = Image = Histogram = Settings = _Unavailable
