"""Simulated hosts (axonml_distributed.simhosts, the `sim_hosts` fixture): hosts share no memory and no
process view and differ in identity; they talk over TCP, through links that can be cut and shaped; gloo
under torchrun and MPICH under mpiexec run 2 hosts x 2 ranks across them; nothing is left behind, by
`down`, by a killed host, or by a run whose owner was killed (the next run's sweep removes it).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonml_distributed.simhosts import DEFAULT_ROOT, SimHosts, sweep_stale
from mpi_run import JOBS, MPIEXEC, job_env, needs_mpi, open_mpi
from simhosts_fixture import mpich_across, needs_simhosts, new_sim_hosts

pytestmark = needs_simhosts

TESTS = Path(__file__).parent
PROBE = str(TESTS / "host_probe.py")
GLOO_JOB = TESTS / "torch_jobs" / "gloo_across_hosts.py"
SIMHOSTS_CLI = [sys.executable, "-m", "axonml_distributed.simhosts"]


def run_ok(hosts: SimHosts, where: int | str, argv: list[str], timeout: float = 60) -> str:
    done = hosts.run(where, argv, timeout=timeout)  # type: ignore[arg-type]
    assert done.returncode == 0, f"{argv} on {where}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def netns_of(prefix: str) -> list[str]:
    """The run's namespaces, as `ip netns list` shows them."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.split()[0].startswith(prefix + "-")]


def processes_with(word: str) -> list[int]:
    """Processes anywhere on the machine with `word` in their command line (the test runs at its root)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if word.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def wait_for(condition, what: str, limit: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit} s: {what}"
        time.sleep(0.02)


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


@pytest.mark.timeout(60)
def test_hosts_share_no_memory_no_process_view_and_differ_in_identity(sim_hosts: SimHosts) -> None:
    """A file in /dev/shm, a POSIX shared-memory object and a SysV segment made on one host open on that
    host alone (each host checks the other's and its own, the control); its processes too."""
    names = [f"axsimprobe{secrets.token_hex(4)}" for _ in range(2)]
    holders = [
        sim_hosts.popen(
            i,
            [sys.executable, PROBE, "hold", names[i]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for holder in holders:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        looks = [json.loads(run_ok(sim_hosts, i, [sys.executable, PROBE, "look", *names])) for i in range(2)]
        machine = json.loads(
            subprocess.run([sys.executable, PROBE, "look", *names], capture_output=True, check=True).stdout
        )
    finally:
        for holder in holders:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=30)
    for i, look in enumerate(looks):
        for j, name in enumerate(names):
            expected = {kind: i == j for kind in ("file", "posix", "sysv", "process")}
            assert look["seen"][name] == expected, f"h{i} looking at h{j}'s"
    for name in names:  # the machine's own namespaces: no host's segments (its PID view holds them all)
        assert machine["seen"][name] == {"file": False, "posix": False, "sysv": False, "process": True}
    assert [look["hostname"] for look in looks] == ["h0", "h1"]
    for key in ("machine_id", "boot_id"):
        ids = [looks[0][key], looks[1][key], machine[key]]
        assert len(set(ids)) == 3, f"{key}: {ids}"


@pytest.mark.timeout(60)
def test_hosts_talk_over_tcp_through_a_link_that_can_be_cut_and_shaped(sim_hosts: SimHosts) -> None:
    server = sim_hosts.popen(
        1, [sys.executable, PROBE, "serve", sim_hosts.addr(1), "5000"], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline() == "listening\n"

    def call(host: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return sim_hosts.run(
            0, [sys.executable, PROBE, "call", host, "5000", "hello", str(timeout)], timeout=60
        )

    assert call(sim_hosts.addr(1)).stdout == "hello from h1\n"
    assert call("h1").stdout == "hello from h1\n"  # by name, through the hosts' /etc/hosts
    sim_hosts.link(1, False)
    cut = call(sim_hosts.addr(1), timeout=1)
    assert cut.returncode == 1 and cut.stdout.startswith("unreachable"), cut.stdout
    sim_hosts.link(1, True)
    assert call(sim_hosts.addr(1)).stdout == "hello from h1\n"
    sim_hosts.shape(None, "100mbit")
    for ns, dev in ((sim_hosts.netns(1), "eth0"), (sim_hosts.netns_sw, "h1")):
        shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True)
        assert "tbf" in shown.stdout and "100Mbit" in shown.stdout, shown.stdout
    assert call(sim_hosts.addr(1)).stdout == "hello from h1\n"
    sim_hosts.shape(None, None)
    shown = subprocess.run(
        ["tc", "-n", sim_hosts.netns(1), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
    )
    assert "tbf" not in shown.stdout


@pytest.mark.timeout(240)
def test_gloo_all_reduce_across_2_hosts_x_2_ranks_under_torchrun(sim_hosts: SimHosts, tmp_path: Path) -> None:
    """The baseline the "axonml" backend will have to match across hosts: torchrun's c10d rendezvous on
    h0's address, one agent per host."""
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    cmd += [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{sim_hosts.addr(0)}:29400",
        "--rdzv-id",
        "simhosts",
    ]
    outputs = [tmp_path / f"h{i}.out" for i in range(2)]
    agents = []
    for i in range(2):
        with open(outputs[i], "w") as out:
            agents.append(sim_hosts.popen(i, [*cmd, str(GLOO_JOB)], stdout=out, stderr=subprocess.STDOUT))
    codes = [agent.wait(timeout=200) for agent in agents]
    said = [path.read_text() for path in outputs]
    assert codes == [0, 0], "\n".join(said)
    ranks = []
    for i, text in enumerate(said):
        lines = [line for line in text.splitlines() if line.startswith("rank ")]
        assert len(lines) == 2 and all(line.endswith(f"of 4 on h{i}: sum right") for line in lines), text
        ranks += [int(line.split()[1]) for line in lines]
    assert sorted(ranks) == [0, 1, 2, 3]


@needs_mpi
@pytest.mark.timeout(120)
def test_mpich_all_reduce_across_2_hosts_x_2_ranks_under_mpiexec(sim_hosts: SimHosts) -> None:
    """mpiexec (hydra) on the ctl node starts its proxies on h0 and h1 through the fake ssh; the MPI
    process group's all_reduce against numpy (mpi_jobs/across_hosts.py)."""
    if open_mpi():
        pytest.skip("the launcher flags here are MPICH's (hydra)")
    assert MPIEXEC is not None
    cmd = mpich_across(sim_hosts, 2, MPIEXEC, str(JOBS / "across_hosts.py"))
    done = sim_hosts.run("ctl", cmd, timeout=100, cwd=str(JOBS), env=job_env())
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    for rank in range(4):
        assert f"rank {rank} of 4 on h{rank // 2}: all_reduce right\n" in done.stdout, done.stdout


@pytest.mark.timeout(60)
def test_down_leaves_no_namespace_link_process_or_state_also_after_a_host_was_killed() -> None:
    links = root_links()
    hosts = new_sim_hosts().up()
    try:
        marker = f"600.{secrets.randbelow(10**9)}"  # a sleep's argument no other process has
        sleepers = [hosts.popen(where, ["sleep", marker]) for where in (0, 1, "ctl")]
        wait_for(
            lambda: len(processes_with(marker)) == 3 + 2, "the sleeps started (on hosts: beside nsenter)"
        )
        hosts.kill(1)
        assert sleepers[1].wait(timeout=30) != 0
        assert len(processes_with(marker)) == 3  # h0's sleep and its nsenter, the ctl node's sleep
        assert len(netns_of(hosts.prefix)) == 4
        assert root_links() == links  # every link of the run lives in its own namespaces
    finally:
        hosts.down()
    assert [sleeper.wait(timeout=30) != 0 for sleeper in sleepers] == [True] * 3
    assert processes_with(marker) == []
    assert netns_of(hosts.prefix) == []
    assert not (Path(DEFAULT_ROOT) / hosts.prefix).exists()
    assert root_links() == links


_CRASHING_OWNER = """
import sys, time
from axonml_distributed.simhosts import SimHosts
hosts = SimHosts(2, prefix=sys.argv[1]).up()
hosts.popen(0, ["sleep", sys.argv[2]])
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_killed_owners_hosts_die_and_the_next_sweep_removes_the_rest_not_a_live_run(
    sim_hosts: SimHosts,
) -> None:
    prefix, marker = f"axsim{secrets.token_hex(4)}", f"600.{secrets.randbelow(10**9)}"
    owner = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_OWNER, prefix, marker], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "up\n"
    finally:
        owner.kill()
        owner.wait()
    # Its hosts die with it (their unshare has SIGKILL as its parent-death signal); nothing removes the
    # namespaces and state but a sweep.
    wait_for(lambda: not processes_with(marker), "the killed owner's host processes died")
    assert len(netns_of(prefix)) == 4 and (Path(DEFAULT_ROOT) / prefix).exists()
    swept = sweep_stale()
    assert prefix in swept and sim_hosts.prefix not in swept
    assert netns_of(prefix) == [] and not (Path(DEFAULT_ROOT) / prefix).exists()
    assert run_ok(sim_hosts, 0, ["hostname"]) == "h0\n"


@pytest.mark.timeout(90)
def test_the_command_line_runs_hosts_that_outlive_it_until_down() -> None:
    cli = [*SIMHOSTS_CLI, "--prefix", f"axsim{secrets.token_hex(4)}"]
    prefix = cli[-1]

    def simhosts(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)

    try:
        assert simhosts("up", "2").returncode == 0
        assert prefix not in sweep_stale()  # its hosts hold the run's lock: alive
        assert simhosts("exec", "1", "hostname").stdout == "h1\n"
        ssh = simhosts("ctl", "sh", "-c", '"$SIMHOSTS_SSH" -o BatchMode=yes -x h0 echo on \\$\\(hostname\\)')
        assert ssh.stdout == "on h0\n", ssh.stderr
        assert simhosts("kill", "1").returncode == 0
        gone = simhosts("exec", "1", "hostname")
        assert gone.returncode == 1 and "is down" in gone.stderr
    finally:
        assert simhosts("down").returncode == 0
    assert netns_of(prefix) == []
