"""The MPI backend over several hosts (`init_process_group("mpi")` -> `MpiHostsProcessGroup`), under MPICH's
mpiexec on 2 simulated hosts x 2 ranks, launched as tests/test_simhosts.py launches it: every collective
against numpy with the two-level all_reduce bitwise identical on every rank, our numpy and torch-module
DDP equal to one process, a rank that raises on the other host ending the whole job, and no
shared-memory segment of ours left on any host after any of them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from axonml_distributed._core import SEGMENT_DIR, SEGMENT_PREFIX
from axonml_distributed.hosts.layout import _PROOF_PREFIX
from axonml_distributed.simhosts import SimHosts
from mpi_run import JOBS, MPIEXEC, job_env, needs_mpi, open_mpi
from simhosts_fixture import mpich_across, needs_simhosts, new_sim_hosts

pytestmark = [needs_simhosts, needs_mpi]


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimHosts]:
    """One pair of hosts for the module's jobs (each job leaves them as it found them: checked)."""
    if open_mpi():
        pytest.skip("the launcher flags here are MPICH's (hydra)")
    sim = new_sim_hosts().up()
    try:
        yield sim
    finally:
        sim.down()


def mpiexec(
    hosts: SimHosts, script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`script` from tests/mpi_jobs as 2 ranks on each host under `python -m mpi4py`; then no segment or
    proof of ours is left in any host's /dev/shm."""
    assert MPIEXEC is not None
    cmd = mpich_across(hosts, 2, MPIEXEC, str(JOBS / script), *args)
    done = hosts.run("ctl", cmd, timeout=150, cwd=str(JOBS), env={**job_env(), **(env or {})})
    for i in range(hosts.n):
        listed = hosts.run(i, ["ls", "-a", SEGMENT_DIR], timeout=30).stdout.split()
        ours = [name for name in listed if name.startswith((SEGMENT_PREFIX.lstrip("/"), _PROOF_PREFIX))]
        assert ours == [], f"left in h{i}'s {SEGMENT_DIR} by {script}: {ours}"
    return done


@pytest.mark.timeout(180)
def test_every_collective_across_hosts_matches_numpy_and_all_reduce_is_bitwise_identical(
    hosts: SimHosts,
) -> None:
    done = mpiexec(hosts, "hosts_collectives.py", env={"AXONML_HOSTS_SEGMENT_KIB": "64"})
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "hosts collectives OK on 4 ranks: [[0, 1], [2, 3]]" in done.stdout, done.stdout


@pytest.mark.timeout(180)
def test_numpy_and_torch_module_ddp_across_hosts_train_like_one_process(hosts: SimHosts) -> None:
    done = mpiexec(hosts, "hosts_ddp.py", env={"AXONML_HOSTS_FLAT_BELOW": "0"})
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "hosts ddp OK on 4 ranks" in done.stdout, done.stdout


@pytest.mark.timeout(180)
def test_a_rank_raising_on_the_other_host_ends_every_rank(hosts: SimHosts) -> None:
    """Rank 3 (host h1) raises while the others wait in a two-level all_reduce (timeout 120 s): mpi4py
    aborts the job, and every rank ends, in time for this test's limit far below the group's timeout."""
    done = mpiexec(hosts, "hosts_raise.py", env={"AXONML_HOSTS_FLAT_BELOW": "0"})
    said = f"{done.stdout}\n{done.stderr}"
    assert done.returncode != 0, said
    assert "rank 3 on h1 fails in user code" in said, said
    assert "should never have returned" not in said, said


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "env"),
    [("stall", {"AXONML_HOSTS_FLAT_BELOW": "0"}), ("absent", {})],
    ids=["in-a-two-level-all_reduce", "at-the-hosts-rendezvous"],
)
def test_a_rank_missing_from_its_host_s_level_is_named_by_its_job_rank(
    hosts: SimHosts, mode: str, env: dict[str, str]
) -> None:
    """Rank 3 never takes part in the host level of a two-level all_reduce ("stall"), or never comes to
    its host's rendezvous ("absent"; tests/mpi_jobs/hosts_host_level.py): rank 2, its host peer (which
    keeps the host's store), times out, and the error it aborts the job with names rank 3 and itself as
    the job numbers them (the host's world calls them 1 and 0)."""
    done = mpiexec(hosts, "hosts_host_level.py", mode, env=env)
    said = f"{done.stdout}\n{done.stderr}"
    assert done.returncode != 0, said
    assert "should never have returned" not in said, said
    reported = [line for line in said.splitlines() if "CollectiveTimeoutError: rank 2: " in line]
    assert reported, said
    assert "failed inside this host (rank(s) [3];" in reported[0], said
    assert "host ranks to global ranks: 0 = 2, 1 = 3" in reported[0], said


@pytest.mark.timeout(180)
def test_the_host_level_meets_without_loopback(hosts: SimHosts) -> None:
    """Each host's ranks meet for their shared-memory world through MPI (`mpi.host_store`), not a TCP
    port on 127.0.0.1 (which another process could take between its choice and its use, and which ranks
    in different network namespaces do not share): with every host's loopback down, the job still meets
    and reduces across both levels."""
    for i in range(hosts.n):
        hosts.run(i, ["ip", "link", "set", "lo", "down"], timeout=30).check_returncode()
    try:
        done = mpiexec(hosts, "hosts_host_level.py", "meet", env={"AXONML_HOSTS_FLAT_BELOW": "0"})
    finally:
        for i in range(hosts.n):
            hosts.run(i, ["ip", "link", "set", "lo", "up"], timeout=30).check_returncode()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "host level met without loopback: hosts [[0, 1], [2, 3]]" in done.stdout, done.stdout
