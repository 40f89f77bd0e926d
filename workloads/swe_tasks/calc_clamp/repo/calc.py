"""Small numeric helpers."""


def add(a, b):
    """The sum of a and b."""
    return a + b


def clamp(x, lo, hi):
    """x limited to the closed range [lo, hi]."""
    return max(lo, min(x, lo))
