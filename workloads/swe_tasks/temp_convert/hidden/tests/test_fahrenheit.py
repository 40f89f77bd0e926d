from temp import to_fahrenheit


def test_boiling():
    assert to_fahrenheit(100) == 212


def test_freezing_point():
    assert to_fahrenheit(0) == 32
