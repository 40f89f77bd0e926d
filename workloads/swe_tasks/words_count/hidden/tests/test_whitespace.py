from words import count_words


def test_empty():
    assert count_words("") == 0


def test_newlines():
    assert count_words("one\ntwo three") == 3
