"""Simulated hosts for tests and CI: N "hosts" on one Linux machine (root) that share no memory and talk
only over a network, each with its own hostname, machine id and boot id. See `hosts` for what a host is,
and ``python -m axonml_distributed.simhosts --help`` for the command line.

    from axonml_distributed.simhosts import SimHosts

    with SimHosts(2) as hosts:                      # h0 = 198.18.0.1, h1 = 198.18.0.2, ctl = 198.18.0.254
        hosts.run(0, ["hostname"], timeout=10)      # on h0
        hosts.run("ctl", ["mpiexec", "-launcher", "ssh", "-launcher-exec", hosts.ssh, ...], timeout=60)
"""

from axonml_distributed.simhosts.hosts import (
    CTL,
    DEFAULT_NET,
    DEFAULT_PREFIX,
    DEFAULT_PRIVATE,
    DEFAULT_ROOT,
    IFACE,
    SimHosts,
    SimHostsError,
    missing_requirements,
    sweep_stale,
    teardown,
)

__all__ = [
    "CTL",
    "DEFAULT_NET",
    "DEFAULT_PREFIX",
    "DEFAULT_PRIVATE",
    "DEFAULT_ROOT",
    "IFACE",
    "SimHosts",
    "SimHostsError",
    "missing_requirements",
    "sweep_stale",
    "teardown",
]
