from ._unavailable import Unavailable, unavailable


class QuantState(Unavailable):
    pass


get_ptr = dequantize_4bit = quantize_4bit = dequantize_blockwise = unavailable


class _Lib:
    """The C library handle (`bitsandbytes.functional.lib`): every symbol raises when called."""

    def __getattr__(self, name):
        return unavailable


lib = _Lib()
