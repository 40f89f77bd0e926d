"""Text helpers."""


def slugify(title):
    """Lower-case words joined by single dashes: "Hello World" -> "hello-world"."""
    words = title.split(" ")
    return "-".join(word.lower() for word in words)
