"""The controller's state store on a real JetStream: a restarted controller adopts every
running rollout it can list, so the listing must be complete — every key of the bucket, a
deleted key's read answers None, a bucket that is not there is ``BusUnavailable``."""

from __future__ import annotations

import pytest

from common import subjects
from common.errors import BusUnavailable
from services.controller.store import StateStore


async def test_rollout_ids_lists_every_key(nc, js) -> None:
    kv = await js.key_value(subjects.BUCKET_ROLLOUTS)
    ids = [f"r-{i:04d}" for i in range(300)]
    for rid in ids:
        await kv.put(rid, b"\x80")  # listing does not decode; reads would ignore it
    await kv.put(ids[0], b"\x81")  # a second revision of one key: still one id
    await kv.delete(ids[1])
    store = StateStore(nc, js)
    listed = await store.rollout_ids()
    assert sorted(listed) == ids
    assert await store.get_rollout(ids[1]) is None  # deleted
    assert await store.get_rollout(ids[2]) is None  # not a RolloutState: logged, ignored


async def test_empty_bucket_lists_nothing(nc, js) -> None:
    assert await StateStore(nc, js).rollout_ids() == []


async def test_missing_bucket_is_bus_unavailable(nc) -> None:
    store = StateStore(nc, nc.jetstream())  # no streams declared
    with pytest.raises(BusUnavailable, match="cannot list rollouts"):
        await store.rollout_ids()
