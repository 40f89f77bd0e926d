"""Temperature helpers."""


def to_fahrenheit(celsius):
    """Degrees Celsius in degrees Fahrenheit."""
    return celsius * 9 / 5 - 32


def is_freezing(celsius):
    """Whether water freezes at this temperature (Celsius)."""
    return celsius <= 0
