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
from common.codec import decode
from common.errors import BelayerError
from common.events import fields
from common.node import resolve_nats_url
from schemas.events import AnyEvent, HandoverComplete
from schemas.serving import (
    GenerateRequest,
    RouterStatus,
    SamplingParams,
    StatusRequest,
    TokenDelta,
)
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
    kill_at: list[float] = []
    delta_times: dict[str, list[float]] = {}

    def on_delta(d: TokenDelta) -> None:
        seen.set()
        delta_times.setdefault(d.request_id, []).append(time.time())

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
        kill_at.append(time.time())
        os.kill(victim.worker_pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    wall = time.time() - t0
    total = 0
    for r in results:
        total += len(r.token_ids)
        print(
            f"  {r.request_id}: {len(r.token_ids)} tokens, engines {','.join(r.engine_ids)}, resumes {r.resumes}: {r.text[:60]!r}"
        )
    # Checked, not claimed: one result per request, every token once (the client rejects gaps
    # and drops nothing silently), the full length, one weight version.
    complete = len({r.request_id for r in results}) == n and all(
        len(r.token_ids) == max_tokens == len(r.logprobs) and len(set(r.token_weight_versions)) == 1
        for r in results
    )
    verdict = "all completed exactly once" if complete else "SOME REQUESTS ARE INCOMPLETE"
    print(
        f"demo: {n} requests, {total} tokens in {wall:.1f}s ({total / wall:.0f} tok/s), {verdict}"
    )
    sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
    events: list[AnyEvent] = []
    while True:
        try:
            msg = await sub.next_msg(timeout=0.5)
        except TimeoutError:
            break
        try:
            ev = decode(msg.data, AnyEvent)
        except BelayerError:  # an event type this demo does not know
            continue
        if ev.ts >= t0:
            events.append(ev)
    print("demo: recovery events:")
    for ev in events:
        shown = {k: v for k, v in fields(ev).items() if not k.startswith("t_") and k != "alert"}
        extra = " ".join(f"{k}={v}" for k, v in shown.items())
        engine = getattr(ev, "engine_id", None) or ""
        print(f"  +{ev.ts - t0:6.2f}s {ev.kind:22} {engine:3} {extra}")
    done = [e for e in events if isinstance(e, HandoverComplete)]
    if kill_at and done:
        d, k = done[0], kill_at[0]
        regenerated = sum(r.regenerated for r in results)
        # The first token a resumed request received from its new worker.
        resumed = [
            t
            for r in results
            if r.resumes
            for t in delta_times.get(r.request_id, [])
            if t >= d.t_registered
        ]
        print(
            "demo: recovery: SIGKILL → detected {:.0f} ms → shadow ready {:.0f} ms → registered "
            "{:.0f} ms → first resumed token {:.0f} ms; {} tokens regenerated".format(
                (d.t_detect - k) * 1000,
                (d.t_ready - k) * 1000,
                (d.t_registered - k) * 1000,
                ((min(resumed) if resumed else float("nan")) - k) * 1000,
                regenerated,
            )
        )
    await nc.drain()
    return 0 if complete else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description="Belayer demo workload with an injected worker failure."
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--no-kill", action="store_true", help="do not inject a failure")
    a = p.parse_args()
    raise SystemExit(asyncio.run(main(a.requests, a.max_tokens, not a.no_kill)))
