"""The `sim_hosts` fixture: two simulated hosts (`axonml_distributed.simhosts`) for one test.

Each test gets a run of its own (a random prefix, so concurrent test runs on one machine never meet),
removed after the test however it ends; a run that a killed test process left is removed by the next
`up` (its sweep of runs nobody holds). The repository stays visible on the hosts wherever it was cloned
(a clone under /tmp too). Skipped, saying why, where simulated hosts cannot run: not root, or `ip` /
`unshare` / `nsenter` missing.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from axonml_distributed.simhosts import SimHosts, missing_requirements

REPO = Path(__file__).resolve().parent.parent
MISSING = missing_requirements()
needs_simhosts = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def mpich_across(hosts: SimHosts, per_host: int, mpiexec: str, script: str, *args: str) -> list[str]:
    """MPICH's mpiexec (hydra), run on the ctl node, starting its proxies on every host through the fake
    ssh: `per_host` ranks on each, over the hosts' own network, each running `script` under
    ``python -m mpi4py`` (an exception on any rank ends the job)."""
    placed = ",".join(f"{hosts.name(i)}:{per_host}" for i in range(hosts.n))
    cmd = [mpiexec, "-launcher", "ssh", "-launcher-exec", hosts.ssh, "-iface", "eth0", "-hosts", placed]
    return [*cmd, "-n", str(per_host * hosts.n), sys.executable, "-m", "mpi4py", script, *args]


def new_sim_hosts(n: int = 2) -> SimHosts:
    """Hosts with a prefix of their own, not yet up."""
    return SimHosts(n, prefix=f"axsim{secrets.token_hex(4)}", share=[str(REPO)])


@pytest.fixture
def sim_hosts() -> Iterator[SimHosts]:
    if MISSING is not None:
        pytest.skip(MISSING)
    hosts = new_sim_hosts().up()
    try:
        yield hosts
    finally:
        hosts.down()
