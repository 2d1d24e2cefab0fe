from .._unavailable import Unavailable


class AdamW(Unavailable):
    pass


class Lion(Unavailable):
    pass


class RMSprop(Unavailable):
    pass


class AdEMAMix(Unavailable):
    pass
