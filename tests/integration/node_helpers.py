"""A real Belayer node for integration tests: started with the CLI (`belayer up --detach`) in a
temporary run directory, stopped with `belayer down`, checked for leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.config import SHM_DIR, shm_prefix

BELAYER = [sys.executable, "-m", "services.cli.main"]


def cli(
    *args: str, run_dir: Path, timeout: float = 120.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BELAYER_HOME": str(run_dir)}
    proc = subprocess.run(
        [*BELAYER, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"belayer {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@dataclass
class Node:
    run_dir: Path
    nats_url: str
    run_id: str

    def status(self) -> dict:
        return json.loads(cli("status", "--json", run_dir=self.run_dir).stdout)

    def pids(self) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in self.status()["procs"]}


def start_node(run_dir: Path, *args: str) -> Node:
    cli("up", "--detach", *args, run_dir=run_dir, timeout=180)
    info = json.loads((run_dir / "node.json").read_text())
    return Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])


def stop_node(node: Node) -> None:
    """`belayer down`, then prove nothing is left: no process of the node, no shm file."""
    cli("down", run_dir=node.run_dir, timeout=60)
    leftovers = list(SHM_DIR.glob(f"{shm_prefix(node.run_id)}*"))
    assert not leftovers, f"shared-memory files left behind: {leftovers}"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = [
        line
        for line in ps.splitlines()
        if str(node.run_dir) in line or node.nats_url.rsplit(":", 1)[1] in line
    ]
    assert not mine, f"processes left behind: {mine}"
