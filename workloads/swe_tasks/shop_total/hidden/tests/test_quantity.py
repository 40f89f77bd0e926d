from shop import total


def test_quantities():
    assert total([("pen", 3, 2), ("ink", 5, 1)]) == 11
