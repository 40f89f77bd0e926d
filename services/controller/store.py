"""The controller's durable state in JetStream KV: ``rollouts`` (key: rollout id →
``RolloutState``) and ``trajectory_prefix`` (key: trajectory id → ``TrajectoryState``, the
association (trajectory, k, C_k, L_k)). One controller runs per node, so plain puts suffice;
values are MessagePack, decoded with the schemas (anything else is ignored and logged).

A bucket's keys are listed from the stream's subjects (``STREAM.INFO`` with a subjects filter,
page by page), not with nats-py's ``kv.keys()``: its watcher can end the replay early or never
(nats-py #842, #995), and a restarted controller that misses a running rollout never adopts it."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from common import subjects
from common.codec import decode, encode
from common.errors import BelayerError, BusUnavailable
from common.logging import get_logger
from schemas.rollout import RolloutState, TrajectoryState

log = get_logger(component="controller-store")

T = TypeVar("T")


class StateStore:
    """Typed reads and writes of the two buckets."""

    def __init__(self, nc: NATS, js: JetStreamContext, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.js = js
        self.timeout = timeout
        self._rollouts: KeyValue | None = None
        self._trajectories: KeyValue | None = None

    async def _bucket(self, name: str) -> KeyValue:
        if name == subjects.BUCKET_ROLLOUTS:
            if self._rollouts is None:
                self._rollouts = await self.js.key_value(name)
            return self._rollouts
        if self._trajectories is None:
            self._trajectories = await self.js.key_value(name)
        return self._trajectories

    async def _put(self, bucket: str, key: str, value: bytes) -> None:
        kv = await self._bucket(bucket)
        try:
            await kv.put(key, value)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusUnavailable(f"cannot write {bucket}/{key}: {exc!r}") from None

    async def _get(self, bucket: str, key: str) -> bytes | None:
        kv = await self._bucket(bucket)
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusUnavailable(f"cannot read {bucket}/{key}: {exc!r}") from None
        return entry.value or None

    async def _keys(self, bucket: str) -> list[str]:
        """Every key of ``bucket`` (deleted ones included: their reads answer None)."""
        prefix = f"$KV.{bucket}."
        keys: list[str] = []
        while True:
            resp = await self._stream_info(
                bucket, {"subjects_filter": f"{prefix}>", "offset": len(keys)}
            )
            page = (resp.get("state") or {}).get("subjects") or {}
            keys.extend(subject[len(prefix) :] for subject in page)
            if not page or len(keys) >= int(resp.get("total") or 0):
                return keys

    async def _stream_info(self, bucket: str, request: dict[str, Any]) -> dict[str, Any]:
        try:
            msg = await self.nc.request(
                f"$JS.API.STREAM.INFO.KV_{bucket}",
                json.dumps(request).encode(),
                timeout=self.timeout,
            )
            resp = json.loads(msg.data)
        except (TimeoutError, nats.errors.Error, ValueError) as exc:
            raise BusUnavailable(f"cannot list {bucket}: {exc!r}") from None
        if not isinstance(resp, dict) or "error" in resp:
            error = resp.get("error") if isinstance(resp, dict) else resp
            raise BusUnavailable(f"cannot list {bucket}: {error}")
        return resp

    # --- rollouts -----------------------------------------------------------------------
    async def put_rollout(self, rollout_id: str, state: RolloutState) -> None:
        await self._put(subjects.BUCKET_ROLLOUTS, rollout_id, encode(state))

    async def get_rollout(self, rollout_id: str) -> RolloutState | None:
        data = await self._get(subjects.BUCKET_ROLLOUTS, rollout_id)
        return self._decode(data, RolloutState, rollout_id)

    async def rollout_ids(self) -> list[str]:
        return await self._keys(subjects.BUCKET_ROLLOUTS)

    # --- trajectories -------------------------------------------------------------------
    async def put_trajectory(self, state: TrajectoryState) -> None:
        await self._put(subjects.BUCKET_TRAJECTORY_PREFIX, state.trajectory_id, encode(state))

    async def get_trajectory(self, trajectory_id: str) -> TrajectoryState | None:
        data = await self._get(subjects.BUCKET_TRAJECTORY_PREFIX, trajectory_id)
        return self._decode(data, TrajectoryState, trajectory_id)

    @staticmethod
    def _decode(data: bytes | None, typ: type[T], key: str) -> T | None:
        if data is None:
            return None
        try:
            return decode(data, typ)
        except BelayerError as exc:  # anyone on the bus can write a bucket: not ours to trust
            log.warning("bad_state_entry", key=key, error=str(exc))
            return None
