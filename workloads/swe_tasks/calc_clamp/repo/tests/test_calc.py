from calc import add, clamp


def test_add():
    assert add(2, 3) == 5


def test_clamp_below():
    assert clamp(-3, 0, 10) == 0
