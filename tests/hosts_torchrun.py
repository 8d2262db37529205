"""Torchrun jobs across simulated hosts (tests/torch_jobs/hosts_*.py): one torchrun agent a host, 2
ranks each, c10d rendezvous on host 0; each agent's output (its workers' too) in a file of `out_dir`
(``h<i>.out``), read back as `Agent`s, and the jobs' lines found in it."""

from __future__ import annotations

import itertools
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from axonml_distributed.simhosts import SimHosts

JOBS = Path(__file__).parent / "torch_jobs"
_ports = itertools.count(29411)


@dataclass
class Agent:
    """One host's torchrun: its exit code and everything it and its workers printed."""

    host: int
    code: int | None
    out: str


def start_torchrun(
    hosts: SimHosts,
    job: str,
    *args: str,
    env: dict[str, str] | None = None,
    nnodes: str = "2",
    torchrun_args: tuple[str, ...] = (),
    out_dir: Path,
) -> list[subprocess.Popen[bytes]]:
    port = next(_ports)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}"]
    # torchrun's agent ends a failed worker's siblings at its next look (every 0.1 s by default): on a
    # loaded machine, before they report what they raised. A slower look lets the fault jobs report.
    if job == "hosts_faults.py":
        cmd += ["--monitor-interval", "5"]
    cmd += ["--rdzv-id", f"job{secrets.token_hex(4)}", *torchrun_args, str(JOBS / job), *args]
    agents = []
    # The jobs' tensors are small: every all_reduce of 64 KiB or more takes both levels.
    env = {"AXONML_HOSTS_FLAT_BELOW": "65536", **(env or {})}
    for i in range(2):
        with open(out_dir / f"h{i}.out", "wb") as out:
            agents.append(hosts.popen(i, cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return agents


def finish(agents: list[subprocess.Popen[bytes]], out_dir: Path, timeout: float) -> list[Agent]:
    codes: list[int | None] = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            agent.kill()
            codes.append(None)
    return [Agent(i, code, (out_dir / f"h{i}.out").read_text()) for i, code in enumerate(codes)]


def torchrun(hosts: SimHosts, job: str, *args: str, out_dir: Path, timeout: float = 150, **kw) -> list[Agent]:  # type: ignore[no-untyped-def]
    return finish(start_torchrun(hosts, job, *args, out_dir=out_dir, **kw), out_dir, timeout)


def wait_for_lines(
    out_dir: Path, word: str, count: int, agents: list[subprocess.Popen[bytes]], limit: float = 90
) -> None:
    """Until the hosts' outputs hold `count` lines with `word`, every agent ended, or `limit` seconds
    passed (the test then fails on what the jobs said)."""
    deadline = time.monotonic() + limit
    while sum(path.read_text().count(word) for path in out_dir.glob("h*.out")) < count:
        if all(agent.poll() is not None for agent in agents) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def said(agents: list[Agent]) -> str:
    return "\n".join(f"--- h{a.host} (exit {a.code}) ---\n{a.out[-8000:]}" for a in agents)


def lines(agents: list[Agent], pattern: str) -> list[re.Match[str]]:
    found = (re.match(pattern, line) for a in agents for line in a.out.splitlines())
    return [m for m in found if m]


RAISED = r"rank (\d) raised (\w+): (.*)$"


def raised(agents: list[Agent]) -> dict[int, tuple[str, str]]:
    """Each rank's failure as it reported it: its type and message."""
    return {int(m[1]): (m[2], m[3]) for m in lines(agents, RAISED)}
