from words import count_words


def test_simple():
    assert count_words("a b c") == 3
