"""``belayer bench env``: full_checkpoint / full_restore latency against sandbox memory and
writable-layer size, next to raw ``criu dump`` + tar on the same container, raw untar +
``runc restore`` of the same checkpoint into a bare bundle (no Docker, no containerd), and a
fresh container from the base image (the restart-from-scratch baseline); plus kill/restore
consistency cycles. Runs the real manager with a real nats-server (KV compare-and-set).

Targets: the small sandbox (an idle python process, 2 MB layer) checkpoints within 300 ms and
restores within 600 ms; the largest process measured (256 MB, 64 MB with ``quick``)
checkpoints within 1.5× raw criu + tar and restores within 2× raw untar + runc restore; no
kill/restore cycle comes back inconsistent. The times and ratios are judged on their 95 %
bootstrap interval over the repeats (a ratio's over the pairs: repeat i of each side ran back
to back); the consistency count is an invariant (one inconsistent cycle is a MISS), its
interval over the cycles stated.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.report import Row, Target, progress, target_text
from bench.stats import (
    Interval,
    bootstrap,
    ci_text,
    judged_json,
    median_interval,
    paired_ratio,
)
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
GRID = [(0, 2), (64, 2), (256, 2), (0, 100)]
"""(process memory MB, writable-layer MB) of each configuration."""
QUICK_GRID = [(0, 2), (64, 2)]
SMALL = (0, 2)
"""The small sandbox: an idle python process and a 2 MB layer."""

TARGETS: dict[str, Target] = {
    "checkpoint_small_ms": ("<=", 300.0),
    "restore_small_ms": ("<=", 600.0),
    "checkpoint_over_raw": ("<=", 1.5),
    "restore_over_raw": ("<=", 2.0),
    "inconsistent_restores": ("<=", 0.0),
}
"""Metric → (comparison, bound). ``checkpoint_over_raw`` and ``restore_over_raw`` are judged on
the configuration with the largest process and a 2 MB layer; ``inconsistent_restores`` only
when cycles run."""
BUNDLES = (
    "/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby",
    "/run/containerd/io.containerd.runtime.v2.task/moby",
)
"""Where containerd keeps the OCI bundle (``config.json``) of a running Docker container."""
RAW_RUNC_ROOT = Path("/run/belayer-bench-raw")
"""runc state of the raw restores (on /run, like Docker's)."""


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


class RawRestore:
    """Raw restore baseline: untar the layer into a fresh overlay upper dir and ``runc restore``
    the CRIU images into a bare bundle made from the sandbox container's own OCI config (its
    init layer and bind-mounted files copied, its own cgroup, no Docker hooks). What a restore
    costs without Docker and containerd. Blocking (run it in a thread)."""

    def __init__(self, mgr: SandboxManager, container_id: str, workdir: Path) -> None:
        info = mgr.docker.inspect(container_id)
        bundles = [Path(b) / container_id for b in BUNDLES if (Path(b) / container_id).is_dir()]
        assert bundles, f"no OCI bundle of the running container {container_id[:12]}"
        self.spec: dict[str, Any] = json.loads((bundles[0] / "config.json").read_text())
        self.spec.pop("hooks", None)  # Docker's network hook: not for a bare bundle
        self.dir = workdir / f"raw-template-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        lowers = info["GraphDriver"]["Data"]["LowerDir"].split(":")
        subprocess.run(["cp", "-a", lowers[0], str(self.dir / "init")], check=True)
        cdir = mgr.docker.container_dir(container_id)
        for m in self.spec["mounts"]:
            if m["source"].startswith(cdir):
                dst = self.dir / Path(m["source"]).name
                shutil.copy2(m["source"], dst)
                m["source"] = str(dst)
        self.lower = ":".join([str(self.dir / "init"), *lowers[1:]])
        self.n = 0

    def run(self, checkpoint: Path) -> float:
        """One timed raw restore of ``checkpoint`` (then killed and cleaned up)."""
        self.n += 1
        r, name = self.dir / f"r{self.n}", f"belayer-raw-{os.getpid()}-{self.n}"
        for sub in ("upper", "work", "merged", "bundle"):
            (r / sub).mkdir(parents=True)
        ops.link_or_copy_tree(checkpoint / core.CRIU_DIR, r / "images")
        spec = json.loads(json.dumps(self.spec))
        spec["root"] = {"path": str(r / "merged")}
        spec["linux"]["cgroupsPath"] = f"/{name}"
        (r / "bundle" / "config.json").write_text(json.dumps(spec))
        runc = ["runc", "--root", str(RAW_RUNC_ROOT)]
        mount = f"lowerdir={self.lower},upperdir={r / 'upper'},workdir={r / 'work'}"
        steps = [
            ["tar", "-C", str(r / "upper"), *ops.TAR_EXTRACT, "-xf", str(checkpoint / core.FS_ARCHIVE)],
            ["mount", "-t", "overlay", "overlay", "-o", mount, str(r / "merged")],
            # CRIU copies the root mount's sharing from its parent: shared, like Docker's rootfs
            ["mount", "--make-shared", str(r / "merged")],
            [*runc, "restore", "--detach", "--image-path", str(r / "images"),
             "--work-path", str(r / "criu-work"), "--bundle", str(r / "bundle"), name],
        ]  # fmt: skip
        os.sync()
        t0 = time.monotonic()
        try:
            with open(r / "steps.log", "wb") as out:  # the restored tree keeps its stdio open
                for argv in steps:
                    code = subprocess.run(
                        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120
                    ).returncode
                    if code != 0:
                        log = (r / "steps.log").read_text()[-500:]
                        raise RuntimeError(f"raw restore: {argv[0]} failed ({code}): {log}")
            return time.monotonic() - t0
        finally:
            for argv in ([*runc, "kill", name, "KILL"], [*runc, "delete", "-f", name],
                         ["umount", str(r / "merged")]):  # fmt: skip
                subprocess.run(argv, capture_output=True, check=False, timeout=60)
            ops.remove_tree(r)

    def close(self) -> None:
        ops.remove_tree(self.dir)


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
        ck, rs, raw, raw_rs = [], [], [], []
        raw_restore = RawRestore(mgr, rec.container_id, workdir)
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
            checkpoint = mgr.sandbox_dir(rec.id) / info.checkpoint_id
            if i % 2:  # alternate which restore reads the checkpoint first
                raw_rs.append(await asyncio.to_thread(raw_restore.run, checkpoint))
            await asyncio.to_thread(os.sync)
            restored = await mgr.restore(rec.id)
            rs.append(restored.seconds)
            if not i % 2:
                raw_rs.append(await asyncio.to_thread(raw_restore.run, checkpoint))
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
            "raw_restore_untar_ms": round(_median(raw_rs) * 1000, 1),
            "restore_over_raw": round(_median(rs) / _median(raw_rs), 2),
            "restore_method": restored.method,
            "runs_ms": _runs_ms(
                checkpoint=ck, restore=rs, raw_criu_tar=raw, raw_restore_untar=raw_rs
            ),
        }
    finally:
        raw_restore.close()
        await mgr.destroy(rec.id)


def _runs_ms(**runs: list[float]) -> dict[str, list[float]]:
    """Every repeat's seconds, in ms (what the intervals resample)."""
    return {name: [round(x * 1000, 1) for x in xs] for name, xs in runs.items()}


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
    outcomes: list[int] = []
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
            outcomes.append(int(got != want))
    finally:
        await mgr.destroy(rec.id)
    return {"cycles": n, "inconsistent": sum(outcomes), "outcomes": outcomes}


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
            rows = []
            for m, layer in QUICK_GRID if quick else GRID:
                progress("env", f"{m} MB process, {layer} MB layer: {repeats} checkpoint/restores")
                rows.append(await _config_run(mgr, m, layer, repeats, Path(tmp)))
            progress("env", f"fresh container from the base image, {repeats} times")
            fresh = await _fresh_container(mgr, repeats)
            result: dict[str, Any] = {"rows": rows, "fresh_container_ms": round(fresh * 1000, 1)}
            if cycles:
                progress("env", f"{cycles} kill/restore consistency cycles")
                result["consistency"] = await _cycles(mgr, cycles)
            return result
        finally:
            await nc.drain()
            server.stop()


def _ratio_config(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration ``checkpoint_over_raw`` is judged on: the largest process, 2 MB layer."""
    thin = [r for r in rows if r["layer_mb"] == SMALL[1]]
    return max(thin, key=lambda r: r["memory_mb"]) if thin else None


def judged(measured: dict[str, Any]) -> dict[str, float]:
    """The values the targets judge (a key is absent when its configuration was not run)."""
    values: dict[str, float] = {}
    for r in measured["rows"]:
        if (r["memory_mb"], r["layer_mb"]) == SMALL:
            values["checkpoint_small_ms"] = r["checkpoint_ms"]
            values["restore_small_ms"] = r["restore_ms"]
    biggest = _ratio_config(measured["rows"])
    if biggest is not None:
        values["checkpoint_over_raw"] = biggest["checkpoint_over_raw"]
        values["restore_over_raw"] = biggest["restore_over_raw"]
    if "consistency" in measured:
        values["inconsistent_restores"] = measured["consistency"]["inconsistent"]
    return values


INVARIANTS = ("inconsistent_restores",)
"""Targets judged on every trial (one violation is a MISS), not on an interval."""


def env_intervals(measured: dict[str, Any]) -> dict[str, Interval | None]:
    """The targets' 95 % bootstrap intervals, from the configurations ``judged`` reads."""
    out: dict[str, Interval | None] = {}
    for r in measured["rows"]:
        runs = r.get("runs_ms")
        if runs and (r["memory_mb"], r["layer_mb"]) == SMALL:
            out["checkpoint_small_ms"] = median_interval(runs["checkpoint"])
            out["restore_small_ms"] = median_interval(runs["restore"])
    biggest = _ratio_config(measured["rows"])
    if biggest is not None and biggest.get("runs_ms"):
        runs = biggest["runs_ms"]
        out["checkpoint_over_raw"] = paired_ratio(runs["checkpoint"], runs["raw_criu_tar"])
        out["restore_over_raw"] = paired_ratio(runs["restore"], runs["raw_restore_untar"])
    if "consistency" in measured:
        out["inconsistent_restores"] = bootstrap(
            measured["consistency"].get("outcomes", []), lambda v: float(sum(v))
        )
    return out


def table(result: dict[str, Any]) -> list[Row]:
    """The table: four rows per configuration, the fresh container, the consistency cycles."""
    judged_verdicts = result["verdicts"]

    def row(metric: str, shown: str, key: str | None = None, unit: str = "") -> Row:
        if key is None or key not in judged_verdicts:
            return Row(metric, shown)
        fmt = {"ms": lambda x: f"{x:.0f} ms", "x": lambda x: f"{x:.2f}x"}.get(unit, str)
        shown += ci_text(result["intervals"].get(key), fmt)
        return Row(metric, shown, target_text(TARGETS[key], unit), judged_verdicts[key])

    out = []
    for r in result["rows"]:
        small = (r["memory_mb"], r["layer_mb"]) == SMALL
        ratio_judged = result["checkpoint_over_raw_config"] == {
            "memory_mb": r["memory_mb"],
            "layer_mb": r["layer_mb"],
        }
        out += [
            row(
                f"full_checkpoint, {r['memory_mb']} MB process, {r['layer_mb']} MB layer",
                f"{r['checkpoint_ms']:.0f} ms",
                "checkpoint_small_ms" if small else None,
                "ms",
            ),
            row("  raw criu dump + tar", f"{r['raw_criu_tar_ms']:.0f} ms"),
            row(
                "  checkpoint / raw",
                f"{r['checkpoint_over_raw']:.2f}x",
                "checkpoint_over_raw" if ratio_judged else None,
                "x",
            ),
            row(
                f"  full_restore ({r['restore_method']})",
                f"{r['restore_ms']:.0f} ms",
                "restore_small_ms" if small else None,
                "ms",
            ),
            row("  raw untar + runc restore", f"{r['raw_restore_untar_ms']:.0f} ms"),
            row(
                "  restore / raw",
                f"{r['restore_over_raw']:.2f}x",
                "restore_over_raw" if ratio_judged else None,
                "x",
            ),
        ]
    out.append(row("fresh container from the base image", f"{result['fresh_container_ms']:.0f} ms"))
    if "consistency" in result:
        c = result["consistency"]
        out.append(
            row(
                "kill/restore cycles restored inconsistently",
                f"{c['inconsistent']} of {c['cycles']}",
                "inconsistent_restores",
            )
        )
    return out


def main(
    json_path: Path, *, repeats: int = 5, cycles: int = 100, quick: bool = False
) -> dict[str, Any]:
    """Measure (minutes; ``quick``: small configurations only), print the table, write
    ``json_path``. Needs dockerd and CRIU."""
    machine = report.machine_at_start("env")
    measured = asyncio.run(run_bench(repeats, cycles, quick))
    values = judged(measured)
    targets = {k: t for k, t in TARGETS.items() if k in values}
    intervals = env_intervals(measured)
    biggest = _ratio_config(measured["rows"])
    result: dict[str, Any] = {
        "bench": "env",
        "timestamp": report.timestamp(),
        "unix_time": time.time(),
        "repeats": repeats,
        "quick": quick,
        **measured,
        "checkpoint_over_raw_config": (
            None if biggest is None else {k: biggest[k] for k in ("memory_mb", "layer_mb")}
        ),
        **judged_json(targets, values, intervals, INVARIANTS),
        "machine": report.machine_after(machine),
    }
    title = "belayer bench env (medians, 95 % intervals over the repeats)"
    report.publish("env", title, table(result), json_path, result)
    return result
