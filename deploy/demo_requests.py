"""Demo workload: a batch of generation requests on a running node while a rollout worker is
SIGKILLed mid-generation; prints each result and the recovery events."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

from common import subjects
from common.bus import connect, request
from common.node import resolve_nats_url
from schemas.base import decode
from schemas.events import Event
from schemas.serving import GenerateRequest, RouterStatus, SamplingParams, StatusRequest
from services.router.client import generate

PROMPTS = [
    "Once upon a time",
    "The answer to 12 + 30 is",
    "In a sandbox, the agent ran",
    "Checkpoint the container and",
    "The rollout worker died, but",
    "Shadow workers take over when",
    "Token-level recovery means",
    "Reinforcement learning from",
]


async def main(n: int, max_tokens: int, kill: bool) -> int:
    nc = await connect(resolve_nats_url(None), name="demo")
    js = nc.jetstream()
    t0 = time.time()
    seen = asyncio.Event()

    def on_delta(_d: object) -> None:
        seen.set()

    tasks = [
        asyncio.create_task(
            generate(
                nc,
                GenerateRequest(
                    request_id=f"demo-{int(t0)}-{i}",
                    prompt=PROMPTS[i % len(PROMPTS)],
                    sampling=SamplingParams(
                        temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True
                    ),
                ),
                on_delta=on_delta,
            )
        )
        for i in range(n)
    ]
    print(f"demo: submitted {n} requests ({max_tokens} tokens each)")
    if kill:
        await asyncio.wait_for(seen.wait(), 60)
        await asyncio.sleep(0.3)  # let generation get going before the failure
        st: RouterStatus = await request(
            nc, subjects.router_status(), StatusRequest(), RouterStatus
        )
        victim = max(st.engines, key=lambda e: e.running)
        print(
            f"demo: injecting failure: SIGKILL worker of {victim.id} (pid {victim.worker_pid}, {victim.running} requests running)"
        )
        os.kill(victim.worker_pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    wall = time.time() - t0
    total = 0
    for r in results:
        total += len(r.token_ids)
        print(
            f"  {r.request_id}: {len(r.token_ids)} tokens, engines {','.join(r.engine_ids)}, resumes {r.resumes}: {r.text[:60]!r}"
        )
    print(
        f"demo: {n} requests, {total} tokens in {wall:.1f}s ({total / wall:.0f} tok/s), all completed exactly once"
    )
    sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
    print("demo: recovery events:")
    while True:
        try:
            msg = await sub.next_msg(timeout=0.5)
        except TimeoutError:
            break
        ev = decode(msg.data, Event)
        if ev.ts >= t0 and ev.kind not in ("weights_updated",):
            extra = " ".join(f"{k}={v}" for k, v in ev.data.items() if k != "alert")
            print(f"  +{ev.ts - t0:6.2f}s {ev.kind:22} {ev.engine_id or '':3} {extra}")
    await nc.drain()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description="Belayer demo workload with an injected worker failure."
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--no-kill", action="store_true", help="do not inject a failure")
    a = p.parse_args()
    raise SystemExit(asyncio.run(main(a.requests, a.max_tokens, not a.no_kill)))
