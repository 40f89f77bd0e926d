from temp import is_freezing


def test_is_freezing():
    assert is_freezing(-1)
    assert not is_freezing(4)
