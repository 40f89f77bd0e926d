"""What the chaos tests share: uninterrupted reference runs, the per-request checks (each
token once, in order, from one weight version, equal to the uninterrupted run), and launching
streams. A helper module, not a test module: test modules import only from here."""

from __future__ import annotations

import asyncio
import os
import random

from msgspec.structs import replace
from nats.aio.client import Client as NATS

from schemas.serving import GenerateRequest
from tests.integration.node_helpers import StreamRecord, stream_generate

SEED = int(os.environ.get("BELAYER_CHAOS_SEED", random.randrange(1 << 30)))
"""Kill points are random; rerun a failure with ``BELAYER_CHAOS_SEED=<seed>``."""


async def references(nc: NATS, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    """Uninterrupted runs of the same prompts and sampling (``ref-`` ids), 8 at a time."""
    out: dict[str, list[int]] = {}
    for i in range(0, len(reqs), 8):
        batch = reqs[i : i + 8]
        recs = await asyncio.gather(
            *(stream_generate(nc, replace(r, request_id=f"ref-{r.request_id}")) for r in batch)
        )
        for r, rec in zip(batch, recs, strict=True):
            out[r.request_id] = rec.tokens
    return out


def check(
    rec: StreamRecord, reference: list[int], *, exact: bool = True, resent_ok: bool = False
) -> None:
    """Each token delivered once, in order, from one weight version, and the result equals the
    stream. ``exact``: the tokens equal the uninterrupted run. Otherwise (a sampled request on
    a node *not* in deterministic mode, ``test_nondeterministic_mode.py``) the tokens the caller
    held when the failure hit (``rec.mark``) equal the uninterrupted run, and the count is
    right — sound only if both runs saw the same batches up to the failure."""
    assert rec.result is not None
    rid = rec.request_id
    if exact:
        assert rec.tokens == reference, f"{rid} differs from the uninterrupted run (seed {SEED})"
    else:
        held = rec.mark or 0
        assert rec.tokens[:held] == reference[:held], f"{rid}: tokens before the failure changed"
        assert len(rec.tokens) == len(reference), f"{rid}: lost or extra tokens"
    assert rec.result.token_ids == rec.tokens, f"{rid}: result differs from the streamed tokens"
    assert len(rec.result.logprobs) == len(rec.tokens)
    assert all(lp <= 0.0 for lp in rec.result.logprobs), f"{rid}: logprobs do not continue"
    assert len(set(rec.result.token_weight_versions)) == 1, f"{rid}: mixed weight versions"
    assert len(rec.result.token_weight_versions) == len(rec.tokens)
    if not resent_ok:
        assert rec.overlaps == [], f"{rid}: tokens sent twice {rec.overlaps}"


def check_all(
    recs: list[StreamRecord],
    reqs: list[GenerateRequest],
    ref: dict[str, list[int]],
    *,
    deterministic: bool = True,
    **kw: bool,
) -> None:
    """:func:`check` every request: all exactly on a deterministic node, else greedy ones."""
    for rec, q in zip(recs, reqs, strict=True):
        check(rec, ref[q.request_id], exact=deterministic or q.sampling.temperature == 0, **kw)


def mark(recs: list[StreamRecord]) -> None:
    """Record what each caller held at the moment a failure is injected."""
    for rec in recs:
        rec.mark = len(rec.tokens)


def launch(nc: NATS, reqs: list[GenerateRequest]) -> tuple[list[StreamRecord], list[asyncio.Task]]:
    recs = [StreamRecord(r.request_id) for r in reqs]
    tasks = [
        asyncio.create_task(stream_generate(nc, r, record=rec, timeout=120))
        for r, rec in zip(reqs, recs, strict=True)
    ]
    return recs, tasks


def prompt(i: int) -> str:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
    return " ".join(words[(i * 3 + j) % len(words)] for j in range(3 + i % 5))
