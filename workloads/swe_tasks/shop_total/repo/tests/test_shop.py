from shop import total


def test_empty():
    assert total([]) == 0


def test_single_unit():
    assert total([("pen", 3, 1)]) == 3
