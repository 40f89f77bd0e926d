"""``full_restore`` of one sandbox, apart from the rest of the manager. Invariants:

* the last good state is never destroyed: each candidate is restored into a *fresh* container
  and checked running before the sandbox's current container is given up (removed); when every
  candidate fails, the current container stays the sandbox's (still running if it was);
* a candidate that fails for any reason of its own (invalid, refused by CRIU, not running after
  restore, past the deadline) is quarantined: moved to ``.quarantine-<id>`` with the reason, no
  longer counted toward ``keep_checkpoints``, listed, or tried again; a failure that is not the
  checkpoint's (dockerd unreachable, no fresh container) stops the restore and quarantines
  nothing;
* the answer names what happened to every candidate (``RestoreAttempt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from common.errors import BelayerError, CheckpointInvalid, Conflict, NotFound, Timeout
from common.logging import get_logger
from schemas.env import ReadyPointer, RestoreAttempt
from services.environment import core, snapshot
from services.environment import criu_ops as ops
from services.environment.core import Manifest, SandboxRecord, SandboxState
from services.environment.ports import RestoreHost

log = get_logger(component="env.restore")
REASON_FILE = "quarantine-reason.txt"


@dataclass(frozen=True)
class Restored:
    """The outcome of a successful ``full_restore``."""

    record: SandboxRecord
    manifest: Manifest
    """The checkpoint now running."""
    seconds: float
    method: str
    """``runtime`` or ``docker`` (``snapshot.restore_method``), or ``layer`` (a layer-only
    checkpoint: a fresh container with the layer installed)."""
    attempts: list[RestoreAttempt]
    """Every candidate, in order, with its outcome."""

    @property
    def fallback_from(self) -> str:
        return ",".join(a.checkpoint_id for a in self.attempts if a.outcome != "restored")


async def full_restore(host: RestoreHost, rec: SandboxRecord, checkpoint_id: str) -> Restored:
    """Restore ``rec`` (its lock held by the caller) from ``checkpoint_id`` or, by default, the
    ready checkpoint then older ones."""
    start = time.monotonic()
    base = host.sandbox_dir(rec.id)
    if checkpoint_id and (base / f"{core.QUARANTINE_PREFIX}{checkpoint_id}").is_dir():
        raise CheckpointInvalid(
            "checkpoint is quarantined: it failed to restore before",
            checkpoint_id=checkpoint_id,
            reason=quarantine_reason(base, checkpoint_id),
        )
    method = await host.restore_method()
    ptr, rev = await host.store.get(rec.id)
    candidates, attempts = _plan(host, rec, ptr, checkpoint_id)
    recorded = ptr.manifests if ptr is not None and ptr.manifests else None
    if recorded is None:
        log.warning("restore_unverified", sandbox_id=rec.id, why="no recorded manifest digests")
    previous = rec.status
    rec.move(SandboxState.RESTORING)
    errors: list[BelayerError] = []
    try:
        for m in candidates:
            cid = await _restore_candidate(host, rec, base / m.checkpoint_id, m, method, recorded)
            if isinstance(cid, BelayerError):
                quarantine(host, rec, m, cid)
                attempts.append(
                    RestoreAttempt(
                        checkpoint_id=m.checkpoint_id,
                        prefix=m.prefix,
                        outcome="quarantined",
                        error=str(cid),
                    )
                )
                errors.append(cid)
                if checkpoint_id:
                    break
                continue
            attempts.append(
                RestoreAttempt(checkpoint_id=m.checkpoint_id, prefix=m.prefix, outcome="restored")
            )
            await _take_over(host, rec, cid, m, ptr, rev)
            return _restored(rec, m, time.monotonic() - start, method, attempts)
    finally:
        if rec.status is SandboxState.RESTORING:  # no candidate restored (or an abort)
            alive = previous is SandboxState.RUNNING and await snapshot.container_alive(
                host.docker, rec.container_id
            )
            rec.state = (SandboxState.RUNNING if alive else SandboxState.FAILED).value
            host.save(rec)
    raise _no_usable_checkpoint(rec, attempts, errors)


def _plan(
    host: RestoreHost, rec: SandboxRecord, ptr: ReadyPointer | None, checkpoint_id: str
) -> tuple[list[Manifest], list[RestoreAttempt]]:
    """The candidates to try, in order, and the attempts already decided: a quarantined ready
    checkpoint is ``skipped`` (when none was asked for). No candidate at all is ``NotFound``."""
    base = host.sandbox_dir(rec.id)
    attempts: list[RestoreAttempt] = []
    candidates = core.restore_candidates(
        host.manifests(rec.id),
        ready_checkpoint_id=ptr.checkpoint_id if ptr else None,
        requested=checkpoint_id or None,
        ready_prefix=ptr.prefix if ptr else None,
    )
    if ptr is not None and not checkpoint_id:
        if (base / f"{core.QUARANTINE_PREFIX}{ptr.checkpoint_id}").is_dir():
            attempts.append(
                RestoreAttempt(
                    checkpoint_id=ptr.checkpoint_id,
                    prefix=ptr.prefix,
                    outcome="skipped",
                    error=quarantine_reason(base, ptr.checkpoint_id),
                )
            )
    if not candidates:
        raise NotFound(
            "no ready checkpoint to restore",
            sandbox_id=rec.id,
            checkpoint_id=checkpoint_id or None,
            candidates=_candidates(attempts),
        )
    return candidates, attempts


async def _restore_candidate(
    host: RestoreHost,
    rec: SandboxRecord,
    directory: Path,
    m: Manifest,
    method: str,
    recorded: dict[str, str] | None,
) -> str | BelayerError:
    """One candidate into a fresh container under the restore deadline: the container's id, or
    the candidate's own failure (to quarantine it). A failure that is not the checkpoint's
    (``snapshot.NotTheCheckpoint``) is raised: it stops the restore."""
    try:
        return await asyncio.wait_for(
            snapshot.restore_one(host.docker, host.config, rec, directory, m, method, recorded),
            host.config.restore_timeout_s,
        )
    except snapshot.NotTheCheckpoint as exc:
        log.warning("restore_aborted", sandbox_id=rec.id, error=str(exc.error))
        raise exc.error from None
    except BelayerError as exc:
        return exc
    except TimeoutError:
        return Timeout("restore ran past its deadline", timeout_s=host.config.restore_timeout_s)


def _restored(
    rec: SandboxRecord, m: Manifest, seconds: float, method: str, attempts: list[RestoreAttempt]
) -> Restored:
    how = snapshot.LAYER if m.method == snapshot.LAYER else method
    log.info(
        "sandbox_restored",
        sandbox_id=rec.id,
        checkpoint_id=m.checkpoint_id,
        prefix=m.prefix,
        method=how,
        seconds=round(seconds, 4),
        passed_over=len(attempts) - 1,
    )
    return Restored(rec, m, seconds, how, attempts)


def _no_usable_checkpoint(
    rec: SandboxRecord, attempts: list[RestoreAttempt], errors: list[BelayerError]
) -> BelayerError:
    """The error of a restore whose every candidate failed: the candidate's own error when
    there was one (and it was not about the checkpoint being invalid), else ``CheckpointInvalid``
    naming them all."""
    data = _candidates(attempts)
    if len(errors) == 1 and not isinstance(errors[0], CheckpointInvalid):
        first = errors[0]
        first.data.setdefault("candidates", data)
        return first
    return CheckpointInvalid(
        "no usable checkpoint: " + "; ".join(str(e) for e in errors),
        sandbox_id=rec.id,
        rejected=",".join(a.checkpoint_id for a in attempts),
        candidates=data,
    )


def _candidates(attempts: list[RestoreAttempt]) -> str:
    """``<checkpoint id>:<outcome>,…`` (error data carries scalars only; the errors themselves
    are in the message)."""
    return ",".join(f"{a.checkpoint_id}:{a.outcome}" for a in attempts)


async def _take_over(
    host: RestoreHost,
    rec: SandboxRecord,
    cid: str,
    m: Manifest,
    ptr: ReadyPointer | None,
    rev: int,
) -> None:
    """The verified container becomes the sandbox's; only now is the old one given up."""
    old = rec.container_id
    rec.container_id = cid
    rec.move(SandboxState.RUNNING)
    rec.restores += 1
    verified = rec.verified_checkpoint_id
    if verified is None or not (host.sandbox_dir(rec.id) / verified).is_dir():
        rec.verified_checkpoint_id = m.checkpoint_id
    else:
        with contextlib.suppress(CheckpointInvalid):
            if core.read_manifest(host.sandbox_dir(rec.id) / verified).prefix <= m.prefix:
                rec.verified_checkpoint_id = m.checkpoint_id
    if ptr is None or m.checkpoint_id != ptr.checkpoint_id:
        kept = {c.checkpoint_id for c in host.manifests(rec.id)}
        digest = core.manifest_digest(host.sandbox_dir(rec.id) / m.checkpoint_id)
        pointer = ReadyPointer(
            sandbox_id=rec.id,
            prefix=m.prefix,
            checkpoint_id=m.checkpoint_id,
            trajectory_id=m.trajectory_id,
            ts=time.time(),
            manifests=core.carry_manifests(
                ptr.manifests if ptr else {}, kept, m.checkpoint_id, digest
            ),
        )
        if ptr is None or m.prefix <= ptr.prefix:
            with contextlib.suppress(Conflict):
                await host.store.advance(pointer, rev)
    rec.ready_prefix, rec.checkpoint_id = m.prefix, m.checkpoint_id
    host.save(rec)
    if old and old != cid:
        host.retire(old)


def quarantine(host: RestoreHost, rec: SandboxRecord, m: Manifest, err: BelayerError) -> None:
    """Set a checkpoint that failed to restore aside (with the reason); keep at most
    ``quarantine_keep`` of them per sandbox."""
    base = host.sandbox_dir(rec.id)
    src, dst = base / m.checkpoint_id, base / f"{core.QUARANTINE_PREFIX}{m.checkpoint_id}"
    log.warning(
        "checkpoint_quarantined", sandbox_id=rec.id, checkpoint_id=m.checkpoint_id, error=str(err)
    )
    try:
        src.rename(dst)
        (dst / REASON_FILE).write_text(f"{type(err).__name__}: {err}\n")
    except OSError as exc:
        log.warning("quarantine_failed", checkpoint_id=m.checkpoint_id, error=str(exc))
        ops.remove_tree(src)
    if rec.verified_checkpoint_id == m.checkpoint_id:
        rec.verified_checkpoint_id = None
    held = sorted(quarantined(base), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in held[max(0, host.config.quarantine_keep) :]:
        ops.remove_tree(old)


def quarantined(base: Path) -> list[Path]:
    """The quarantine directories of one sandbox."""
    if not base.is_dir():
        return []
    return [p for p in base.iterdir() if p.name.startswith(core.QUARANTINE_PREFIX) and p.is_dir()]


def quarantine_reason(base: Path, checkpoint_id: str) -> str:
    path = base / f"{core.QUARANTINE_PREFIX}{checkpoint_id}" / REASON_FILE
    try:
        return path.read_text().strip()[:500]
    except OSError:
        return "quarantined"
