"""Word statistics."""


def count_words(text):
    """Number of words in text (separated by any whitespace)."""
    return len(text.split(" "))
