"""Checks the kvd the agent left running (its memory), not only the files."""

import socket

from kvd import SOCKET, parse


def ask(line):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(SOCKET)
        conn.sendall(line.encode())
        conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
        return data.decode()


def test_parse_keeps_spaces():
    assert parse("SET k a b  c") == ("SET", "k", "a b  c")


def test_server_holds_greeting():
    assert ask("GET greeting") == "hello world"


def test_server_keeps_spaces():
    assert ask("SET probe one two three") == "OK"
    assert ask("GET probe") == "one two three"
