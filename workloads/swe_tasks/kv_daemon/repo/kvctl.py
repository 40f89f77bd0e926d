"""kvctl: send one request to the running kvd and print the answer.

    python3 kvctl.py SET greeting hello world
    python3 kvctl.py GET greeting

Waits up to 5 s for the server to come up (so it can follow a fresh "python3 kvd.py &").
"""

import socket
import sys
import time

from kvd import SOCKET


def request(line, path=SOCKET, wait_s=5.0):
    """Send one request line to kvd and return its answer."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(path)
                conn.sendall(line.encode())
                conn.shutdown(socket.SHUT_WR)
                data = b""
                while chunk := conn.recv(4096):
                    data += chunk
                return data.decode()
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


if __name__ == "__main__":
    print(request(" ".join(sys.argv[1:])))
