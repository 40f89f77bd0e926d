from calc import clamp


def test_clamp_above():
    assert clamp(15, 0, 10) == 10


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5
    assert clamp(10, 0, 10) == 10
