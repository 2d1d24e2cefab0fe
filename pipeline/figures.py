"""Numbers for people: the one way a figure is printed in a message, a reason or a table.

A float's `repr` (`6.57420539855957`) is exact but unreadable; a fixed `.2f` can print two
different losses as the same number. `figure` prints 4 significant digits, and `figures` prints
several values with the fewest significant digits (at least 4) that keep different values
different, so a reason that compares two numbers never shows them equal. The exact values stay
where machines read them (tags, `--json`).
"""

from __future__ import annotations

import math

SIGNIFICANT = 4


def figure(value: float | int | None, digits: int = SIGNIFICANT) -> str:
    """`value` with `digits` significant digits (`6.574`, `0.05321`, `1.235e+06`); ints, None, NaN and inf as is."""
    if value is None:
        return "None"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return repr(value)
    return f"{value:.{digits}g}"


def figures(*values: float | int | None, digits: int = SIGNIFICANT) -> tuple[str, ...]:
    """Each of `values` as `figure` does, with as many more digits (up to 17) as it takes for values
    that differ to print differently: `figures(6.57420539, 6.57431)` is `('6.5742', '6.5743')`."""
    for d in range(digits, 18):
        out = tuple(figure(v, d) for v in values)
        distinct = {v for v in values if v is not None}
        if len({figure(v, d) for v in distinct}) == len(distinct):
            return out
    return tuple(figure(v, 17) for v in values)
