class Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "bitsandbytes is a stub on this host (scripts/gpu/bundle.sh): 8/4-bit loading and 8-bit "
            "optimizers are unavailable; carry the real bitsandbytes wheel for QLoRA"
        )


def unavailable(*args, **kwargs):
    Unavailable()
