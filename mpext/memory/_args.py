"""Argument checks shared by mpext.memory's modules."""
import math
import numbers


def check_count(name: str, value, minimum: int = 1) -> int:
    """An integer count >= minimum (an integral float such as 7e9 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s: must be an integer, got %r" % (name, value))
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("%s: must be a whole number, got %r" % (name, value))
    value = int(value)
    if value < minimum:
        raise ValueError("%s: must be >= %d, got %d" % (name, minimum, value))
    return value
