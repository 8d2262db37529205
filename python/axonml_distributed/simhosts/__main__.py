"""``python -m axonml_distributed.simhosts``: simulated hosts from a shell (a CI script, a terminal)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from axonml_distributed.simhosts.hosts import (
    CTL,
    DEFAULT_NET,
    DEFAULT_PREFIX,
    DEFAULT_PRIVATE,
    DEFAULT_ROOT,
    SimHosts,
    SimHostsError,
    sweep_stale,
    teardown,
)

_COMMANDS = """\
commands:
  up N                  create N hosts h0..h<N-1> (addresses NET.1..NET.N) and a ctl node (NET.254);
                        they stay up until `down`
  exec I CMD...         run CMD on host I (h3, its address, or 3), in this directory if the host sees
                        it; exit status = CMD's
  ctl CMD...            run CMD on the ctl node (a launcher, e.g. mpiexec); it finds the fake ssh in
                        $SIMHOSTS_SSH and the host names in $SIMHOSTS_HOSTS
  ssh [OPTS] HOST CMD   ssh-compatible: run CMD (words joined, through sh -c) on HOST; the file
                        $SIMHOSTS_SSH calls this (MPICH: -launcher ssh -launcher-exec $SIMHOSTS_SSH)
  shape I|all RATE      limit both directions of a host's link to RATE (tc's form: 10gbit, 100mbit)
  unshape I|all         remove the limit
  link I up|down        plug or unplug host I's cable
  kill I                kill every process of host I (it vanishes; its address still answers)
  status                print the run's hosts, addresses and state as JSON
  down                  kill every process of the run, delete its namespaces and state
  sweep                 remove what crashed runs left (runs whose owner and hosts are all gone)

processes on host I find SIMHOST_INDEX, SIMHOST_NAME, SIMHOST_ADDR, SIMHOSTS_N, SIMHOSTS_ADDRS,
SIMHOSTS_CTL_ADDR and SIMHOSTS_IFACE (eth0) in their environment.

example (MPICH, 2 hosts x 2 ranks):
  python -m axonml_distributed.simhosts up 2
  python -m axonml_distributed.simhosts ctl sh -c 'mpiexec -launcher ssh -launcher-exec "$SIMHOSTS_SSH" \\
      -iface eth0 -hosts h0:2,h1:2 -n 4 python -m mpi4py train.py'
  python -m axonml_distributed.simhosts down
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m axonml_distributed.simhosts",
        description="Simulated hosts on one Linux machine (root): each its own network, IPC, PID, UTS and "
        "mount namespaces, with a private /dev/shm, /tmp and /var/tmp, joined by a switch.",
        epilog=_COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    parser.add_argument(
        "--prefix",
        default=env("SIMHOSTS_PREFIX") or DEFAULT_PREFIX,
        help="name of the run: 'axsim' then up to 16 of [a-z0-9] (env SIMHOSTS_PREFIX; default %(default)s)",
    )
    parser.add_argument(
        "--root",
        default=env("SIMHOSTS_ROOT") or DEFAULT_ROOT,
        help="where runs keep their state (env SIMHOSTS_ROOT; default %(default)s)",
    )
    parser.add_argument(
        "--net",
        help=f"up: the /24 the hosts live in, first three parts (env SIMHOSTS_NET; default {DEFAULT_NET})",
    )
    parser.add_argument(
        "--share",
        default=env("SIMHOSTS_SHARE") or "",
        help="up: colon list of paths inside the private directories that the hosts still see, "
        "e.g. a venv or a clone in /tmp (env SIMHOSTS_SHARE); this Python's own paths always are",
    )
    parser.add_argument(
        "--private",
        default=env("SIMHOSTS_PRIVATE") or ":".join(DEFAULT_PRIVATE),
        help="up: colon list of directories each host gets a fresh tmpfs on (env SIMHOSTS_PRIVATE; "
        "default %(default)s)",
    )
    parser.add_argument(
        "command",
        choices=["up", "exec", "ctl", "ssh", "shape", "unshape", "link", "kill", "status", "down", "sweep"],
        metavar="COMMAND",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments")
    opts = parser.parse_args(argv)
    try:
        return _dispatch(opts, parser)
    except (SimHostsError, ValueError) as exc:
        print(f"simhosts: {exc}", file=sys.stderr)
        return 1


def _dispatch(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command, args = opts.command, opts.args

    def want(count: int, usage: str) -> None:
        """`count` arguments; at least that many when `usage` ends in a command (CMD...)."""
        if len(args) < count or (len(args) > count and not usage.endswith("...")):
            parser.error(f"usage: {command} {usage}")

    if command == "up":
        want(1, "N")
        split = [p for p in opts.share.split(":") if p]
        hosts = SimHosts(
            int(args[0]),
            prefix=opts.prefix,
            net=opts.net,
            share=split,
            private=[p for p in opts.private.split(":") if p],
            root=opts.root,
        )
        hosts.up(detach=True)
        listed = ", ".join(f"{hosts.name(i)} {addr}" for i, addr in enumerate(hosts.addrs))
        print(
            f"simhosts: {hosts.n} hosts up: {listed}, ctl {hosts.ctl_addr}; ssh for launchers: {hosts.ssh}",
            file=sys.stderr,
        )
        return 0
    if command == "sweep":
        for prefix in sweep_stale(opts.root):
            print(f"simhosts: removed the remains of {prefix}", file=sys.stderr)
        return 0
    if command == "down":
        teardown(opts.prefix, opts.root)
        return 0
    hosts = SimHosts.attach(opts.prefix, opts.root)
    if command == "exec":
        want(2, "I CMD...")
        return _exec(hosts, hosts.host_index(args[0]), args[1:])
    if command == "ctl":
        want(1, "CMD...")
        return _exec(hosts, CTL, args)
    if command == "ssh":
        host, words = _ssh_target(args)
        return _exec(hosts, hosts.host_index(host), ["/bin/sh", "-c", " ".join(words)])
    if command in ("shape", "unshape"):
        want(2 if command == "shape" else 1, "I|all RATE" if command == "shape" else "I|all")
        which = None if args[0] == "all" else hosts.host_index(args[0])
        hosts.shape(which, args[1] if command == "shape" else None)
        return 0
    if command == "link":
        want(2, "I up|down")
        if args[1] not in ("up", "down"):
            parser.error("usage: link I up|down")
        hosts.link(hosts.host_index(args[0]), args[1] == "up")
        return 0
    if command == "kill":
        want(1, "I")
        hosts.kill(hosts.host_index(args[0]))
        return 0
    want(0, "")  # status
    status = {
        "prefix": hosts.prefix,
        "ctl": hosts.ctl_addr,
        "ssh": hosts.ssh,
        "hosts": {hosts.name(i): hosts.addr(i) for i in range(hosts.n)},
        "share": hosts.share,
    }
    print(json.dumps(status, indent=1))
    return 0


def _exec(hosts: SimHosts, where: int | str, argv: list[str]) -> NoReturn:
    """Become `argv` on the host: its exit status is ours, signals reach it."""
    full = hosts.command(where, argv)  # type: ignore[arg-type]
    os.execvpe(full[0], full, {**os.environ, **hosts.env(where)})  # type: ignore[arg-type]


def _ssh_target(args: list[str]) -> tuple[str, list[str]]:
    """ssh [options] [user@]host command...: the host and the command words (options are ignored)."""
    with_value = set("bcDEeFIiJLlmOoPpQRSWw")  # ssh's options that take an argument
    k = 0
    while k < len(args) and args[k].startswith("-"):
        k += 2 if len(args[k]) == 2 and args[k][1] in with_value else 1
    if len(args) - k < 2:
        raise SimHostsError("ssh: usage: ssh [options] host command...")
    return args[k].rpartition("@")[2], args[k + 1 :]


if __name__ == "__main__":
    sys.exit(main())
