"""The GPU check of Belayer's handover (run by ``deploy/device/check.sh`` on a machine with CUDA).

One call, about five minutes: write a Qwen3 model directory of at least 0.6B parameters, start
a one-engine node with its engines on ``cuda`` (``belayer up --device cuda``), stream a greedy
request, SIGKILL the main worker mid-generation, and record what the shadow's takeover cost:
time to detect, time to ready, time from the kill to the first resumed token, tokens held
(kept) and tokens regenerated, and whether the output equals an uninterrupted greedy run of
the same request. With ``--sglang`` (and the ``sglang`` package installed), the sglang engine
backend is also checked on its own: a greedy run, then a resume from the middle of it.

The weights are random (seeded): no pretrained model of 0.6B parameters or more can be
installed from PyPI, the only package index a Belayer machine reaches; the geometry is
Qwen3-0.6B's layer shape with a 32k vocabulary, so the GPU does the same work per token.
Everything measured is written, as JSON, to ``--out``; nothing is written that did not run.

``--rehearse-on-cpu`` runs the same steps on the CPU with the tiny model (the report says
``"rehearsal": true``): a check of this script, not of the GPU path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ENGINE = "e0"
GEOMETRY = {
    "hidden_size": 1024,
    "num_layers": 36,
    "num_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 32768,
}
"""Qwen3-0.6B's layer shape (hidden 1024, 16/8 heads of 128, MLP 3072), 36 layers, untied
32k-token embedding and output layer: about 0.63B parameters."""
STREAM_TOKENS = 256
KILL_AFTER = 64


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def belayer(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT,
    )  # fmt: skip


LOGIT_STD = 5.0
"""The output layer is scaled so the logits spread about this much, as a trained model's do: a
random model's logits all lie within rounding of each other, so greedy decoding meets near-ties
that any change of kernel (prefill against decode) flips."""


def write_model(out: Path, dtype: str, geometry: dict[str, int]) -> dict[str, Any]:
    """The model directory (random weights, stored as ``dtype``) and its size."""
    import torch
    from safetensors.torch import load_file, save_file

    from model.tiny import init_tiny_model

    init_tiny_model(out, seed=0, **geometry)  # type: ignore[arg-type]
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    params = sum(t.numel() for t in tensors.values())
    head = tensors["lm_head.weight"]  # untied in init_tiny_model's Qwen3
    tensors["lm_head.weight"] = head * (LOGIT_STD / (float(head.std()) * head.shape[1] ** 0.5))
    cast = getattr(torch, dtype)
    save_file({k: v.to(cast).contiguous() for k, v in tensors.items()}, str(weights))
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"dir": str(out), "parameters": params, "dtype": dtype, "pretrained": False,
            "logit_std": LOGIT_STD}  # fmt: skip


def request(rid: str, n: int) -> Any:
    from schemas.serving import GenerateRequest, SamplingParams

    prompt = [(37 * i + 11) % 4000 + 50 for i in range(24)]
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )


async def handover(run_dir: Path, url: str) -> dict[str, Any]:
    """Kill the main worker mid-stream; what the takeover cost and whether the output held."""
    from common.bus import connect
    from common.config import RunPaths
    from common.events import EventTail
    from common.node import resolve_bus
    from schemas import events as ev
    from services.router.client import generate, router_status

    nc = await connect(url, name="gpu-check", bus=resolve_bus(url, paths=RunPaths(run_dir))[1])
    try:
        events = await EventTail(nc).start()
        await events.wait_for(ev.ShadowReady, after=0, timeout=300)
        status = await router_status(nc, timeout=10)
        engine = next(e for e in status.engines if e.id == ENGINE)
        t0 = time.perf_counter()
        reference = (await generate(nc, request("ref", STREAM_TOKENS), timeout=300)).token_ids
        tok_s = STREAM_TOKENS / (time.perf_counter() - t0)
        times: list[float] = []
        held = asyncio.Event()

        def on_delta(d: Any) -> None:
            times.extend([time.time()] * len(d.token_ids))
            if len(times) >= KILL_AFTER:
                held.set()

        rid = f"ho-{uuid.uuid4().hex[:8]}"
        task = asyncio.create_task(
            generate(nc, request(rid, STREAM_TOKENS), on_delta=on_delta, timeout=300)
        )
        await asyncio.wait_for(held.wait(), 120)
        t_kill, received = time.time(), len(times)
        os.kill(engine.worker_pid, signal.SIGKILL)
        done = await events.wait_for(
            ev.HandoverComplete, after=t_kill, timeout=120, old_pid=engine.worker_pid
        )
        result = await task
        resumed = await events.wait_for(ev.RequestsResumed, after=t_kill, timeout=60)
        # The first resumed token is the one at position held_tokens: earlier ones were in
        # flight from the dead worker (generated before the kill, delivered just after).
        n_held = resumed.held_tokens
        first = times[n_held] - t_kill if len(times) > n_held else None
        return {
            "device_reported": engine.device,
            "greedy_tok_s_batch1": tok_s,
            "detect_s": done.t_detect - t_kill,
            "ready_s": done.t_ready - t_kill,
            "first_resumed_token_s": first,
            "tokens_received_before_kill": received,
            "held_tokens": n_held,
            # tokens the client already had that the new worker produced again
            "regenerated_tokens": max(0, received - n_held),
            "tokens_delivered": len(times),
            "greedy_equal": result.token_ids == reference,
            "first_divergence": next(
                (
                    i
                    for i, (a, b) in enumerate(zip(result.token_ids, reference, strict=False))
                    if a != b
                ),
                None,
            ),
            "resumes": result.resumes,
        }
    finally:
        await nc.drain()


def node_handover(model_dir: Path, run_dir: Path, device: str) -> dict[str, Any]:
    up = belayer(
        "up", "--detach", "--run-dir", str(run_dir), "--engines", "1", "--model", str(model_dir),
        "--device", device, "--no-deterministic", "--failure-window", "0", "--no-environment",
        timeout=420,
    )  # fmt: skip
    if up.returncode != 0:
        return {"ran": False, "error": f"belayer up failed: {up.stderr.strip()[-2000:]}"}
    try:
        url = json.loads((run_dir / "node.json").read_text())["nats_url"]
        return {"ran": True, **asyncio.run(handover(run_dir, url))}
    finally:
        belayer("down", "--run-dir", str(run_dir), timeout=120)


def sglang_resume(model_dir: Path) -> dict[str, Any]:
    """The sglang backend alone: greedy run, then a resume from its middle (prompt + half)."""
    from model.config import load_model_config
    from services.worker.engine.backend import sglang_importable
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.sequence import SamplingParams

    if not sglang_importable():
        return {"ran": False, "reason": "the sglang package is not installed on this machine"}
    from services.worker.sglang_engine import SglangEngine

    config = EngineConfig(deterministic=True, max_num_seqs=8)
    engine = SglangEngine(str(model_dir), load_model_config(model_dir), config)
    try:
        prompt = list(request("s", 1).prompt_token_ids)

        def run(tokens: list[int], n: int, offset: int) -> list[int]:
            rid = uuid.uuid4().hex[:8]
            engine.add_request(rid, tokens, SamplingParams(temperature=0, max_tokens=n,
                               ignore_eos=True), generated_offset=offset)  # fmt: skip
            out: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    out += o.new_token_ids
            return out

        engine.warmup()
        full = run(prompt, 128, 0)
        t0 = time.perf_counter()
        rest = run(prompt + full[:64], 64, 64)
        return {"ran": True, "greedy_resume_equal": full[64:] == rest,
                "resume_seconds": time.perf_counter() - t0}  # fmt: skip
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--work", type=Path, default=Path("/tmp/belayer-gpu-check"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sglang", action="store_true", help="also check the sglang backend")
    parser.add_argument("--rehearse-on-cpu", action="store_true", help="tiny model, --device cpu")
    args = parser.parse_args()
    import torch

    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rehearse = bool(args.rehearse_on_cpu)
    if not torch.cuda.is_available() and not rehearse:
        report.update(ran=False, reason="torch sees no CUDA device: nothing was run")
        args.out.write_text(json.dumps(report, indent=2))
        log(report["reason"])
        return 0
    report["rehearsal"] = rehearse
    report["gpu"] = None if rehearse else torch.cuda.get_device_name(0)
    report["torch"] = torch.__version__
    try:
        log("writing the model")
        geometry = {} if rehearse else GEOMETRY
        report["model"] = write_model(args.work / "model", args.dtype, geometry)
        log(f"model: {report['model']['parameters'] / 1e9:.3f}B parameters; starting the node")
        device = "cpu" if rehearse else "cuda"
        report["handover"] = node_handover(args.work / "model", args.work / "node", device)
        if args.sglang:
            report["sglang"] = sglang_resume(args.work / "model")
    except Exception:
        report["error"] = traceback.format_exc()[-4000:]
    args.out.write_text(json.dumps(report, indent=2))
    log(json.dumps(report, indent=2))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    raise SystemExit(main())
