"""Identity seed files: make an nkey seed, derive its public key, read a seed file safely,
write a file only its owner reads. ``common.auth`` builds identities and permissions on these.

Nothing here logs or formats a seed: errors name the file, never its content.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from common.errors import Unauthorized

SEED_SUFFIX = ".nk"


def new_seed() -> bytes:
    """A fresh user nkey seed (``SU…``)."""
    import nkeys

    return bytes(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))


def public_key_of(seed: bytes) -> str:
    """The public key (``U…``) of a seed; ``Unauthorized`` if it is not one."""
    import nkeys

    try:
        kp = nkeys.from_seed(bytearray(seed.strip()))
    except Exception:  # nkeys raises assorted errors for a bad seed: never echo the content
        raise Unauthorized("the credentials file does not hold an nkey seed") from None
    try:
        return str(kp.public_key.decode())
    finally:
        kp.wipe()


def read_seed(path: str | Path) -> bytes:
    """The seed in ``path``; ``Unauthorized`` naming the file (never its content) if it is
    missing, unreadable, too open to others or not a seed."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise Unauthorized(f"credentials file {p} does not exist") from None
    except OSError as exc:
        raise Unauthorized(f"cannot read credentials file {p}: {exc.strerror}") from None
    if len(data) > 4096:
        raise Unauthorized(f"credentials file {p} is not an nkey seed file")
    try:
        public_key_of(data)
    except Unauthorized:
        raise Unauthorized(f"credentials file {p} does not hold an nkey seed") from None
    return data.strip()


def seed_file(auth_dir: Path, name: str) -> Path:
    return auth_dir / f"{name}{SEED_SUFFIX}"


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by its owner only (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
