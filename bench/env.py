"""``belayer bench env``: full_checkpoint / full_restore latency against sandbox memory and
writable-layer size, next to raw ``criu dump`` + tar on the same container and a fresh
container from the base image (the restart-from-scratch baseline); plus kill/restore
consistency cycles. Runs the real manager with a real nats-server (KV compare-and-set)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common.bus import connect, ensure_jetstream
from common.natsserver import start_nats_server
from services.environment import core
from services.environment import criu_ops as ops
from services.environment.config import EnvConfig
from services.environment.manager import SandboxManager
from services.environment.service import KvReadyStore

HOLDER = (
    'nohup python3 -c "import signal,sys\n'
    "b=bytearray({mb}<<20)\n"
    "for i in range(0,len(b),4096): b[i]=1\n"
    "f=open('/root/held.log','a')\n"
    'signal.pause()" >/dev/null 2>&1 & sleep {wait}'
)
HASH = "find /root -xdev -type f | sort | xargs -r sha256sum | sha256sum"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def _raw_dump(mgr: SandboxManager, container_id: str, workdir: Path) -> float:
    """Freeze → tar upper dir → ``criu dump --leave-running`` → thaw, straight on the container."""
    info = mgr.docker.inspect(container_id)
    pid = int(info["State"]["Pid"])
    upper = info["GraphDriver"]["Data"]["UpperDir"]
    control = ops.freezer_path(pid)
    assert control is not None
    d = workdir / f"raw-{time.monotonic_ns()}"
    d.mkdir(parents=True)
    t0 = time.monotonic()
    await ops.freeze(control)
    try:
        await ops.archive_layer(upper, d / "fs.tar", timeout=120)
        await ops.run(
            [
                "criu",
                "dump",
                "-t",
                str(pid),
                "-D",
                str(d),
                "--leave-running",
                "--ext-mount-map",
                "auto",
                "--enable-external-sharing",
                "--enable-external-masters",
                "--manage-cgroups=ignore",
                "--freeze-cgroup",
                str(control.parent),
                "-o",
                "dump.log",
            ],
            timeout=120,
            what="raw criu dump",
        )
    finally:
        ops.thaw(control)
    dt = time.monotonic() - t0
    ops.remove_tree(d)
    return dt


async def _config_run(
    mgr: SandboxManager, mem_mb: int, layer_mb: int, repeats: int, workdir: Path
) -> dict[str, Any]:
    limit = max(256, mem_mb * 2 + 128)
    rec = await mgr.create(
        image="", files=[], limits=core.Limits(memory_mb=limit, cpus=1.0, pids=256)
    )
    try:
        if layer_mb:
            await mgr.exec(rec.id, f"head -c {layer_mb << 20} /dev/urandom > /root/layer.bin", 120)
        await mgr.exec(rec.id, HOLDER.format(mb=mem_mb, wait=0.5 + mem_mb / 200), 60)
        ck, rs, raw = [], [], []
        for i in range(repeats):
            # Each timed dump starts from a clean page cache (``sync``): otherwise whichever
            # runs second pays for writing back the first one's hundreds of MB, and the
            # comparison measures the disk's writeback, not the checkpoint. The order also
            # alternates.
            if i % 2:
                await asyncio.to_thread(os.sync)
                raw.append(await _raw_dump(mgr, rec.container_id, workdir))
            await asyncio.to_thread(os.sync)
            info = await mgr.checkpoint(rec.id, i + 1)
            ck.append(info.total_s)
            if not i % 2:
                await asyncio.to_thread(os.sync)
                raw.append(await _raw_dump(mgr, rec.container_id, workdir))
            await mgr.kill(rec.id)
            _, _, secs, _ = await mgr.restore(rec.id)
            rs.append(secs)
        return {
            "memory_mb": mem_mb,
            "layer_mb": layer_mb,
            "repeats": repeats,
            "checkpoint_ms": round(_median(ck) * 1000, 1),
            "restore_ms": round(_median(rs) * 1000, 1),
            "raw_criu_tar_ms": round(_median(raw) * 1000, 1),
            "checkpoint_over_raw": round(_median(ck) / _median(raw), 2),
            "fs_bytes": info.fs_bytes,
            "criu_bytes": info.criu_bytes,
            "method": info.method,
        }
    finally:
        await mgr.destroy(rec.id)


async def _fresh_container(mgr: SandboxManager, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        rec = await mgr.create(
            image="", files=[], limits=core.Limits(memory_mb=256, cpus=1.0, pids=256)
        )
        await mgr.exec(rec.id, "true", 10)
        times.append(time.monotonic() - t0)
        await mgr.destroy(rec.id)
    return _median(times)


async def _cycles(mgr: SandboxManager, n: int) -> dict[str, Any]:
    """n × (act → checkpoint k → act more → docker kill → restore → compare with state at k)."""
    rec = await mgr.create(
        image="", files=[], limits=core.Limits(memory_mb=256, cpus=1.0, pids=256)
    )
    bad = 0
    try:
        await mgr.exec(
            rec.id,
            "nohup python3 -c \"import signal\nn=0\nf=open('/root/n','a',buffering=1)\n"
            "def b(*_):\n  global n; n+=1; f.write(str(n)+'\\\\n')\nsignal.signal(signal.SIGUSR1,b)\n"
            'while True: signal.pause()" >/dev/null 2>&1 & sleep 0.3',
            10,
        )
        for k in range(1, n + 1):
            await mgr.exec(
                rec.id,
                f"echo {k} > /root/step-{k}; rm -f /root/step-{k - 2}; "
                "pkill -USR1 -f '^python3 -c' ; sleep 0.05",
                10,
            )
            want = (await mgr.exec(rec.id, HASH + "; tail -n1 /root/n", 10)).stdout
            await mgr.checkpoint(rec.id, k)
            await mgr.exec(
                rec.id,
                "echo junk > /root/junk; rm -f /root/step-*; pkill -USR1 -f '^python3 -c'",
                10,
            )
            await mgr.kill(rec.id)
            await mgr.restore(rec.id)
            got = (await mgr.exec(rec.id, HASH + "; tail -n1 /root/n", 10)).stdout
            bad += got != want
    finally:
        await mgr.destroy(rec.id)
    return {"cycles": n, "inconsistent": bad}


async def run_bench(repeats: int, cycles: int, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="belayer-bench-env-") as tmp:
        server = start_nats_server(Path(tmp) / "nats")
        nc = await connect(server.url, name="bench-env")
        try:
            js = nc.jetstream()
            await ensure_jetstream(js)
            config = EnvConfig(run_dir=Path(tmp) / "run", node="bench-" + str(int(time.time())))
            mgr = SandboxManager(config, KvReadyStore(js, source="bench"))
            await mgr.adopt()
            grid = [(0, 2), (64, 2), (256, 2), (0, 100)] if not quick else [(0, 2), (64, 2)]
            rows = [await _config_run(mgr, m, layer, repeats, Path(tmp)) for m, layer in grid]
            fresh = await _fresh_container(mgr, repeats)
            result: dict[str, Any] = {"rows": rows, "fresh_container_ms": round(fresh * 1000, 1)}
            if cycles:
                result["consistency"] = await _cycles(mgr, cycles)
            return result
        finally:
            await nc.drain()
            server.stop()


def main(*, as_json: bool, out: Path, repeats: int, cycles: int, quick: bool) -> int:
    result = asyncio.run(run_bench(repeats, cycles, quick))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="belayer bench env (medians)")
    for col in [
        "memory",
        "layer",
        "checkpoint ms",
        "raw criu+tar ms",
        "ratio",
        "restore ms",
        "fresh ms",
    ]:
        t.add_column(col)
    for r in result["rows"]:
        t.add_row(
            f"{r['memory_mb']} MB",
            f"{r['layer_mb']} MB",
            str(r["checkpoint_ms"]),
            str(r["raw_criu_tar_ms"]),
            str(r["checkpoint_over_raw"]),
            str(r["restore_ms"]),
            str(result["fresh_container_ms"]),
        )
    Console().print(t)
    if "consistency" in result:
        c = result["consistency"]
        print(f"consistency: {c['inconsistent']} inconsistent restores in {c['cycles']} cycles")
    print(f"written to {out}")
    return 0
