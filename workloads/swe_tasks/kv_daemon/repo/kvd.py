"""kvd: a tiny in-memory key-value server on a Unix socket, one request per connection.

Requests: "SET <key> <value>" answers "OK"; "GET <key>" answers the value or "MISSING".
Run it in the background: python3 kvd.py &
"""

import os
import socket

SOCKET = "/tmp/kvd.sock"


def parse(line):
    """Split a request into (command, key, value)."""
    parts = line.split()
    command = parts[0] if parts else ""
    key = parts[1] if len(parts) > 1 else ""
    value = parts[2] if len(parts) > 2 else ""
    return command, key, value


def handle(store, line):
    """Apply one request to store and return the answer."""
    command, key, value = parse(line)
    if command == "SET":
        store[key] = value
        return "OK"
    if command == "GET":
        return store.get(key, "MISSING")
    return "ERROR unknown command"


def read_all(conn):
    """Everything the peer sends until it shuts its side down."""
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    return data.decode()


def serve(path=SOCKET):
    """Answer requests forever; the data lives only in this process's memory."""
    store = {}
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.sendall(handle(store, read_all(conn).strip()).encode())


if __name__ == "__main__":
    serve()
