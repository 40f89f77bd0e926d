from kvd import handle, parse


def test_parse_get():
    assert parse("GET greeting") == ("GET", "greeting", "")


def test_handle_missing():
    assert handle({}, "GET nothing") == "MISSING"
