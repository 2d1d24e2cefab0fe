from .._unavailable import Unavailable


class Params4bit(Unavailable):
    pass


class Int8Params(Unavailable):
    pass


class Linear4bit(Unavailable):
    pass


class Linear8bitLt(Unavailable):
    pass
