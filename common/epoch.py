"""Engine epochs: a counter per engine in the ``engine_epochs`` KV bucket, advanced only by
compare-and-set, so two workers can never both believe they own the engine."""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext

from common import subjects
from common.errors import Conflict


async def current_epoch(js: JetStreamContext, engine_id: str) -> tuple[int, int | None]:
    """(epoch, revision) of an engine; (0, None) when it never had a worker."""
    kv = await js.key_value(subjects.BUCKET_ENGINE_EPOCHS)
    try:
        entry = await kv.get(engine_id)
    except nats.js.errors.KeyNotFoundError:
        return 0, None
    return int(entry.value or b"0"), entry.revision


async def claim_epoch(js: JetStreamContext, engine_id: str, *, expected: int | None = None) -> int:
    """Advance the engine's epoch by one and return it. With ``expected``, fail with
    ``Conflict`` unless the current epoch is exactly that (a shadow taking over from the
    worker it watched must not overtake a newer one)."""
    kv = await js.key_value(subjects.BUCKET_ENGINE_EPOCHS)
    epoch, rev = await current_epoch(js, engine_id)
    if expected is not None and epoch != expected:
        raise Conflict("epoch moved on", engine_id=engine_id, epoch=epoch, expected=expected)
    new = epoch + 1
    try:
        if rev is None:
            await kv.create(engine_id, str(new).encode())
        else:
            await kv.update(engine_id, str(new).encode(), last=rev)
    except nats.js.errors.KeyWrongLastSequenceError:
        raise Conflict("lost the epoch compare-and-set", engine_id=engine_id, epoch=epoch) from None
    return new
