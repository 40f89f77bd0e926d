"""Shopping cart arithmetic."""


def line_price(item):
    """Price of one (name, unit_price, quantity) item."""
    return item[1]


def total(items):
    """Total price of (name, unit_price, quantity) items."""
    return sum(line_price(item) for item in items)
