"""The "axonml" torch backend across simulated hosts (2 hosts x 2 ranks under torchrun, c10d rendezvous):
every collective against torch's reference, DDP against gloo's, faults (a rank that raises on the other
host, a host killed, a link cut, a mismatch across hosts), hosts found honestly, an elastic restart.

One pair of hosts serves the module (bringing hosts up costs seconds); a test that kills a host brings
up a fresh pair for those after it. Jobs are tests/torch_jobs/hosts_*.py.
"""

from __future__ import annotations

import itertools
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from axonml_distributed.simhosts import SimHosts
from simhosts_fixture import MISSING, needs_simhosts, new_sim_hosts

pytestmark = needs_simhosts
torch = pytest.importorskip("torch")

JOBS = Path(__file__).parent / "torch_jobs"
_ports = itertools.count(29411)


class Hosts:
    """The module's simulated hosts, brought up again after a test took one down."""

    def __init__(self) -> None:
        self.sim: SimHosts | None = None

    def get(self) -> SimHosts:
        if self.sim is None:
            self.sim = new_sim_hosts().up()
        return self.sim

    def spoiled(self) -> None:
        if self.sim is not None:
            self.sim.down()
            self.sim = None


@pytest.fixture(scope="module")
def hosts_holder() -> Iterator[Hosts]:
    if MISSING is not None:
        pytest.skip(MISSING)
    holder = Hosts()
    try:
        yield holder
    finally:
        holder.spoiled()


@pytest.fixture
def hosts(hosts_holder: Hosts) -> SimHosts:
    return hosts_holder.get()


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
    cmd += ["--rdzv-id", f"job{secrets.token_hex(4)}", *torchrun_args, str(JOBS / job), *args]
    agents = []
    for i in range(2):
        with open(out_dir / f"h{i}.out", "wb") as out:
            agents.append(hosts.popen(i, cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return agents


def finish(agents: list[subprocess.Popen[bytes]], out_dir: Path, timeout: float) -> list[Agent]:
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            agent.kill()
            codes.append(None)
    return [Agent(i, code, (out_dir / f"h{i}.out").read_text()) for i, code in enumerate(codes)]


def torchrun(hosts: SimHosts, job: str, *args: str, out_dir: Path, timeout: float = 150, **kw) -> list[Agent]:  # type: ignore[no-untyped-def]
    return finish(start_torchrun(hosts, job, *args, out_dir=out_dir, **kw), out_dir, timeout)


def said(agents: list[Agent]) -> str:
    return "\n".join(f"--- h{a.host} (exit {a.code}) ---\n{a.out[-8000:]}" for a in agents)


def lines(agents: list[Agent], pattern: str) -> list[re.Match[str]]:
    found = (re.match(pattern, line) for a in agents for line in a.out.splitlines())
    return [m for m in found if m]


@pytest.mark.timeout(240)
def test_every_collective_and_ddp_across_hosts_against_torch(hosts: SimHosts, tmp_path: Path) -> None:
    agents = torchrun(
        hosts, "hosts_collectives.py", out_dir=tmp_path, env={"AXONML_HOSTS_SEGMENT_KIB": "64"}, timeout=200
    )
    assert [a.code for a in agents] == [0, 0], said(agents)
    done = lines(agents, r"rank (\d) of 4 on (h\d): (\d+) checks, 0 wrong$")
    assert sorted(int(m[1]) for m in done) == [0, 1, 2, 3], said(agents)
    assert all(m[2] == f"h{int(m[1]) // 2}" for m in done), said(agents)
    assert len({m[3] for m in done}) <= 2, said(agents)  # ranks check different counts (root-only ones)
    assert "HostsProcessGroup" in agents[0].out, said(agents)
