from text import slugify


def test_extra_spaces():
    assert slugify("  Hello   World ") == "hello-world"


def test_tabs():
    assert slugify("Belayer\tRopes") == "belayer-ropes"
