"""N simulated hosts on one Linux machine (root): `SimHosts`, and `sweep_stale` for runs that crashed.

Host i (hostname h<i>, address NET.<i+1> on eth0) is its own net namespace, joined by a veth to a bridge
in a switch namespace, and runs in its own IPC, UTS, PID and mount namespaces: a fresh tmpfs on each
private directory (/dev/shm, /tmp, /var/tmp), so no segment or file there is seen by another host; its
own /etc/hosts (ctl and h0..h<N-1>), /etc/hostname, /etc/machine-id and kernel boot_id, so software that
tells hosts apart by those sees different hosts. A "ctl" node (NET.254) is the login node: it shares only
the network with the hosts and keeps the machine's own processes and files in view, so a launcher there
(mpiexec) starts processes on the hosts through `ssh`, a fake ssh that enters a host's namespaces.

A run is named by its prefix: its namespaces are <prefix>-sw, <prefix>-ctl and <prefix>-h<i>, its state
is <root>/<prefix>/. Its lock file is held while the run is alive: by the process that brought it up, or,
for a detached run (the command line's `up`), by the hosts themselves. A run whose lock is free crashed,
and `sweep_stale` (called by every `up`) removes what it left.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from axonml_distributed.run import _die_with_launcher

# RFC 2544's benchmarking range: nothing real lives there, and the addresses exist only inside the run's
# own namespaces (the machine's own network never sees them), so concurrent runs may share them. The
# environment variable NET_VARIABLE picks another /24 (first three parts) where that range is in use.
DEFAULT_NET = "198.18.0"
NET_VARIABLE = "SIMHOSTS_NET"
DEFAULT_PRIVATE = ("/dev/shm", "/tmp", "/var/tmp")
DEFAULT_ROOT = "/run/axonml-simhosts"
DEFAULT_PREFIX = "axsim"
CTL: Literal["ctl"] = "ctl"
IFACE = "eth0"
# Where `ip netns add` pins the namespaces.
_NETNS_DIR = Path("/run/netns")
_PREFIX = re.compile(r"axsim[a-z0-9]{0,16}")
_OUR_NETNS = re.compile(r"(axsim[a-z0-9]{0,16})-(?:sw|ctl|h\d+)")
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", re.IGNORECASE)
_HOSTINIT = Path(__file__).with_name("hostinit.py")
_TOOLS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux"}
# Slow machines (2 loaded cores) start a Python interpreter in well under this.
_START_TIMEOUT = 30.0
_GONE_TIMEOUT = 10.0

Where = int | Literal["ctl"]


class SimHostsError(RuntimeError):
    """A simulated-hosts operation failed (not root, a tool missing, a host down, ...)."""


def missing_requirements() -> str | None:
    """Why simulated hosts cannot run here (not root, or a tool missing), or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network, PID and mount namespaces)"
    missing = [f"{tool} ({package})" for tool, package in _TOOLS.items() if shutil.which(tool) is None]
    return f"simulated hosts need {', '.join(missing)}" if missing else None


class SimHosts:
    """`n` simulated hosts. ``with SimHosts(2) as hosts: hosts.run(0, [...])``, or `up` and `down`.

    `net`: the first three parts of the /24 the hosts live in (default: $SIMHOSTS_NET, else 198.18.0).
    `share`: paths under the private directories that processes on the hosts must still see (a clone or
    a venv under /tmp); the running interpreter's prefixes and sys.path entries are always shared. The
    hosts of a run brought up without `detach` die with the thread that brought them up (and are removed
    at its interpreter's exit if `down` was not called)."""

    def __init__(
        self,
        n: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        net: str | None = None,
        share: Iterable[str] = (),
        private: Sequence[str] = DEFAULT_PRIVATE,
        root: str = DEFAULT_ROOT,
    ) -> None:
        net = net or os.environ.get(NET_VARIABLE) or DEFAULT_NET
        if not 1 <= n <= 253:
            raise ValueError(f"simulated hosts: 1 to 253 hosts, not {n}")
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"simulated hosts: prefix {prefix!r} must be 'axsim' and up to 16 of [a-z0-9]")
        if not re.fullmatch(r"(\d{1,3}\.){2}\d{1,3}", net):
            raise ValueError(
                f"simulated hosts: net {net!r} (or ${NET_VARIABLE}): the first three parts of an IPv4 /24"
            )
        self.n, self.prefix, self.net = n, prefix, net
        self.private = [os.path.abspath(d) for d in private]
        self.share = _shares([*share, *_interpreter_paths()], self.private)
        self.state = Path(root) / prefix
        self._lock: int | None = None
        self._starters: list[subprocess.Popen[bytes]] = []
        self._inits: dict[Where, int] = {}

    # ---- names and addresses -------------------------------------------------------------------------

    def name(self, i: int) -> str:
        return f"h{self._index(i)}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{self._index(i) + 1}"

    @property
    def addrs(self) -> list[str]:
        return [self.addr(i) for i in range(self.n)]

    @property
    def ctl_addr(self) -> str:
        return f"{self.net}.254"

    @property
    def ssh(self) -> str:
        """The fake ssh for launchers on the ctl node (MPICH: ``-launcher ssh -launcher-exec``)."""
        return str(self.state / "ssh")

    def netns(self, where: Where) -> str:
        """The name `ip netns` knows a host (or the ctl node) by."""
        return f"{self.prefix}-{CTL if where == CTL else self.name(int(where))}"

    def host_index(self, host: str) -> int:
        """h3, its address, or 3 -> 3 (as ssh names hosts)."""
        if re.fullmatch(r"h\d+", host):
            return self._index(int(host[1:]))
        if host.startswith(self.net + "."):
            return self._index(int(host.rsplit(".", 1)[1]) - 1)
        if host.isdigit():
            return self._index(int(host))
        raise SimHostsError(f"no simulated host {host!r} (h0..h{self.n - 1} or their addresses)")

    def _index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise SimHostsError(f"no simulated host {i}: this run has h0..h{self.n - 1}")
        return i

    # ---- life ----------------------------------------------------------------------------------------

    def up(self, *, detach: bool = False) -> SimHosts:
        """Create the hosts. Detached, they outlive this process until `down` (the command line's way)."""
        problem = missing_requirements()
        if problem:
            raise SimHostsError(problem)
        sweep_stale(str(self.state.parent))
        self._lock = _create_state(self.state)
        try:
            self._write_files()
            self._make_network()
            self._start_inits(detach)
            self._save()
        except BaseException:
            self.down()
            raise
        if detach:
            os.close(self._lock)  # the hosts hold it now
            self._lock = None
        else:
            atexit.register(self.down)
        return self

    def down(self) -> None:
        """Kill every process of the run, delete its namespaces and state. Idempotent."""
        atexit.unregister(self.down)
        teardown(self.prefix, str(self.state.parent))
        for starter in self._starters:
            starter.wait()  # the unshare of a host exits once its PID 1 is gone
        self._starters.clear()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> SimHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX, root: str = DEFAULT_ROOT) -> SimHosts:
        """The run `prefix` that is up (brought up by another process, e.g. the command line's `up`)."""
        try:
            saved = json.loads((Path(root) / prefix / "state.json").read_text())
        except FileNotFoundError:
            raise SimHostsError(
                f"no simulated hosts {prefix!r} are up (no {root}/{prefix}/state.json)"
            ) from None
        hosts = cls(saved["n"], prefix=prefix, net=saved["net"], private=saved["private"], root=root)
        hosts.share = saved["share"]
        hosts._inits = {CTL: saved["ctl"], **dict(enumerate(saved["inits"]))}
        return hosts

    # ---- running commands ----------------------------------------------------------------------------

    def env(self, where: Where) -> dict[str, str]:
        """What processes on host `where` (or the ctl node) find in their environment, beside ours."""
        common = {
            "SIMHOSTS_N": str(self.n),
            "SIMHOSTS_ADDRS": ",".join(self.addrs),
            "SIMHOSTS_CTL_ADDR": self.ctl_addr,
            "SIMHOSTS_IFACE": IFACE,
        }
        if where == CTL:
            hosts = ",".join(self.name(i) for i in range(self.n))
            return {**common, "SIMHOSTS_SSH": self.ssh, "SIMHOSTS_HOSTS": hosts}
        i = int(where)
        return {**common, "SIMHOST_INDEX": str(i), "SIMHOST_NAME": self.name(i), "SIMHOST_ADDR": self.addr(i)}

    def command(self, where: Where, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """`argv` run on host `where` (or the ctl node), in `cwd` (default: ours) if the host sees it,
        else in /. With the environment of `env(where)` added to the caller's."""
        pid = self._live_init(where)
        # A host: all of its namespaces. The ctl node: its network, hostname and /etc/hosts only.
        spaces = ["-n", "-u", "-m"] if where == CTL else ["-n", "-i", "-u", "-m", "-p"]
        wd = cwd or os.getcwd()
        if where != CTL and not self._visible(wd):
            wd = "/"
        return ["nsenter", "-t", str(pid), *spaces, f"--wd={wd}", "--", *argv]

    def popen(
        self,
        where: Where,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` on host `where` (or the ctl node); `kwargs` go to Popen. On a host, the process
        is a child of nsenter (which waits for it): killing the Popen leaves it to `kill` or `down`."""
        full_env = {**os.environ, **self.env(where), **(env or {})}
        return subprocess.Popen(self.command(where, argv, cwd), env=full_env, **kwargs)

    def run(
        self,
        where: Where,
        argv: Sequence[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on host `where` to completion; output captured as text."""
        with self.popen(
            where,
            argv,
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        ) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise SimHostsError(
                    f"{shlex.join(argv)} on {where} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}"
                ) from None
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    # ---- faults and links ----------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """Host i vanishes: every process on it is killed at once (SIGKILL of its PID 1). Its address
        stays up, so peers get refused connections; `link(i, False)` as well for a silent host."""
        pid = self._live_init(self._index(i))
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid])

    def link(self, i: int, up: bool) -> None:
        """Plug (True) or unplug (False) host i's cable, at the switch."""
        _ip(["-n", self.netns_sw, "link", "set", self.name(i), "up" if up else "down"])

    def shape(self, i: int | None, rate: str | None) -> None:
        """Limit both directions of host i's link (every host's for None) to `rate` (tc's form:
        10gbit, 100mbit, 1gbps) with a token bucket; None removes the limit."""
        if rate is not None and shutil.which("tc") is None:
            raise SimHostsError("shaping links needs tc (iproute2)")
        burst = None if rate is None else _burst(rate)
        for k in range(self.n) if i is None else [self._index(i)]:
            # Host egress, and the switch's egress towards the host.
            for ns, dev in ((self.netns(k), IFACE), (self.netns_sw, self.name(k))):
                if rate is None:
                    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                else:
                    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf])

    @property
    def netns_sw(self) -> str:
        return f"{self.prefix}-sw"

    # ---- bringing up ---------------------------------------------------------------------------------

    def _write_files(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"{self.ctl_addr} {CTL}"]
        lines += [f"{self.addr(i)} {self.name(i)}" for i in range(self.n)]
        (self.state / "hosts").write_text("\n".join(lines) + "\n")
        for i in range(self.n):
            (self.state / f"{self.name(i)}.hostname").write_text(self.name(i) + "\n")
            (self.state / f"{self.name(i)}.machine-id").write_text(uuid.uuid4().hex + "\n")
            (self.state / f"{self.name(i)}.boot_id").write_text(str(uuid.uuid4()) + "\n")
            (self.state / f"{self.name(i)}.scratch").mkdir()
        cli = [sys.executable, "-m", "axonml_distributed.simhosts", "--prefix", self.prefix]
        cli += ["--root", str(self.state.parent), "ssh"]
        (self.state / "ssh").write_text(
            f'#!/bin/sh\n# ssh for launchers on the ctl node\nexec {shlex.join(cli)} "$@"\n'
        )
        (self.state / "ssh").chmod(0o755)

    def _make_network(self) -> None:
        nodes: list[tuple[str, str, str]] = [(self.netns(CTL), CTL, self.ctl_addr)]
        nodes += [(self.netns(i), self.name(i), self.addr(i)) for i in range(self.n)]
        _ip(["-batch", "-"], [f"netns add {ns}" for ns in [self.netns_sw, *(ns for ns, _, _ in nodes)]])
        switch = ["link set lo up", "link add br0 type bridge", "link set br0 up"]
        for ns, port, _ in nodes:
            switch += [
                f"link add {port} type veth peer name {IFACE} netns {ns}",
                f"link set {port} master br0 up",
            ]
        _ip(["-n", self.netns_sw, "-batch", "-"], switch)
        for ns, _, addr in nodes:
            _ip(
                ["-n", ns, "-batch", "-"],
                ["link set lo up", f"addr add {addr}/24 dev {IFACE}", f"link set {IFACE} up"],
            )

    def _start_inits(self, detach: bool) -> None:
        """Start every node's PID 1 at once, then wait for each to report it is set up."""
        started: dict[Where, subprocess.Popen[bytes]] = {}
        for where in [CTL, *range(self.n)]:
            if where == CTL:
                spaces = ["--uts", "--mount"]
                binds, private, scratch = {"/etc/hosts": str(self.state / "hosts")}, [], ""
            else:
                spaces = ["--ipc", "--uts", "--mount", "--pid", "--mount-proc"]
                binds, private = self._identity(where), self.private
                scratch = str(self.state / f"{self.name(where)}.scratch")
            config = {"name": self.name(where) if where != CTL else CTL, "binds": binds, "private": private}
            config |= {"share": self.share, "scratch": scratch}
            # --kill-child: the host's PID 1, and with it the host, dies with its unshare.
            unshare = ["unshare", *spaces, "--fork", "--propagation", "private", "--kill-child"]
            init = [sys.executable, "-I", "-S", str(_HOSTINIT), json.dumps(config)]
            with open(self.state / f"{self.netns(where)}.log", "wb") as log:
                started[where] = subprocess.Popen(
                    ["ip", "netns", "exec", self.netns(where), *unshare, *init],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                    # Detached, the hosts hold the run's lock; owned, they die with their owner.
                    pass_fds=(self._lock,) if detach and self._lock is not None else (),
                    preexec_fn=None if detach else _die_with_launcher(os.getpid()),
                )
        self._starters = list(started.values())
        deadline = time.monotonic() + _START_TIMEOUT
        for where, proc in started.items():
            assert proc.stdout is not None
            ready = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
            line = proc.stdout.readline() if ready else b""
            proc.stdout.close()
            if line != b"READY\n":
                said = (self.state / f"{self.netns(where)}.log").read_text(errors="replace")
                raise SimHostsError(f"simulated host {self.netns(where)} did not start:\n{said}")
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            self._inits[where] = int(children[0])
        if detach:
            self._starters = []  # re-parented when this process exits; their new parent reaps them

    def _identity(self, i: int) -> dict[str, str]:
        name = self.name(i)
        machine_id = str(self.state / f"{name}.machine-id")
        return {
            "/etc/hosts": str(self.state / "hosts"),
            "/etc/hostname": str(self.state / f"{name}.hostname"),
            "/etc/machine-id": machine_id,
            "/var/lib/dbus/machine-id": machine_id,
            "/proc/sys/kernel/random/boot_id": str(self.state / f"{name}.boot_id"),
        }

    def _save(self) -> None:
        saved = {
            "n": self.n,
            "net": self.net,
            "private": self.private,
            "share": self.share,
            "ctl": self._inits[CTL],
            "inits": [self._inits[i] for i in range(self.n)],
        }
        (self.state / "state.json").write_text(json.dumps(saved, indent=1) + "\n")

    # ---- helpers -------------------------------------------------------------------------------------

    def _live_init(self, where: Where) -> int:
        """The PID 1 of a node, checked to still be that node's (not a reused pid)."""
        pid = self._inits.get(where)
        if pid is None:
            raise SimHostsError(f"simulated hosts {self.prefix!r} are not up")
        if pid not in _pids_in_netns([self.netns(where)]):
            raise SimHostsError(f"simulated host {self.netns(where)} is down (killed)")
        return pid

    def _visible(self, path: str) -> bool:
        """Whether processes on a host see `path` as it is here (not hidden by a private directory)."""
        path = os.path.abspath(path)
        hidden = any(_within(path, d) for d in self.private)
        return not hidden or any(_within(path, s) for s in self.share)


# ---- module helpers ------------------------------------------------------------------------------------


def sweep_stale(root: str = DEFAULT_ROOT) -> list[str]:
    """Remove what crashed runs left (namespaces, processes, state): runs whose lock nobody holds.
    Returns their prefixes."""
    names = os.listdir(_NETNS_DIR) if _NETNS_DIR.is_dir() else []
    prefixes = {m.group(1) for name in names if (m := _OUR_NETNS.fullmatch(name))}
    if os.path.isdir(root):
        prefixes |= {p for p in os.listdir(root) if _PREFIX.fullmatch(p)}
    swept = []
    for prefix in sorted(prefixes):
        try:
            fd = os.open(Path(root) / prefix / "lock", os.O_RDWR)
        except FileNotFoundError:
            fd = None  # namespaces without state: the run died while tearing down
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # type: ignore[arg-type]
            continue  # alive
        teardown(prefix, root)
        swept.append(prefix)
        if fd is not None:
            os.close(fd)
    return swept


def _create_state(state: Path) -> int:
    """The run's state directory, with its lock held (returned). Made under a temporary name and renamed
    into place, so a sweep never finds it without a held lock."""
    state.parent.mkdir(parents=True, exist_ok=True)
    if state.exists():
        raise SimHostsError(f"simulated hosts {state.name!r} are already up ({state}): down them first")
    tmp = Path(tempfile.mkdtemp(prefix=f".{state.name}.", dir=state.parent))
    fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.rename(tmp, state)
    except OSError:
        os.close(fd)
        shutil.rmtree(tmp)
        raise SimHostsError(
            f"simulated hosts {state.name!r} are already up ({state}): down them first"
        ) from None
    return fd


def teardown(prefix: str, root: str = DEFAULT_ROOT) -> None:
    """Remove the run `prefix`, whoever brought it up: kill every process in its namespaces (a host's
    PID 1 takes its whole PID namespace along), delete the namespaces, then the state."""
    names = os.listdir(_NETNS_DIR) if _NETNS_DIR.is_dir() else []
    ours = [n for n in names if (m := _OUR_NETNS.fullmatch(n)) and m.group(1) == prefix]
    pids = _pids_in_netns(ours)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)
    if ours:
        _ip(["-force", "-batch", "-"], [f"netns del {n}" for n in ours], check=False)
    shutil.rmtree(Path(root) / prefix, ignore_errors=True)


def _pids_in_netns(names: Iterable[str]) -> list[int]:
    """Processes (not zombies: those have left their namespaces) in any of the named net namespaces."""
    wanted = set()
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(_NETNS_DIR / name)
            wanted.add((st.st_dev, st.st_ino))
    found = []
    for entry in os.listdir("/proc") if wanted else []:
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in wanted:
                found.append(int(entry))
    return found


def _wait_gone(pids: Sequence[int]) -> None:
    deadline = time.monotonic() + _GONE_TIMEOUT
    for pid in pids:
        while _alive(pid):
            if time.monotonic() > deadline:
                raise SimHostsError(f"process {pid} of a simulated host outlived SIGKILL")
            time.sleep(0.005)


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a zombie has left its namespaces)."""
    return os.path.exists(f"/proc/{pid}/ns/net")


def _ip(args: list[str], batch: list[str] | None = None, *, check: bool = True) -> None:
    _run(["ip", *args], "\n".join(batch or []) + "\n", check=check)


def _run(argv: list[str], stdin: str | None = None, *, check: bool = True) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SimHostsError(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def _burst(rate: str) -> int:
    """tbf's bucket: 1 ms worth of bytes, and at least 256 KiB (veth sends 64 KiB GSO super-packets)."""
    m = _RATE.fullmatch(rate)
    if m is None:
        raise ValueError(f"rate {rate!r}: a number, an optional k/m/g/t, then bit or bps (10gbit, 100mbit)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    bytes_per_s = float(m.group(1)) * scale / (8 if m.group(3).lower() == "bit" else 1)
    return max(int(bytes_per_s / 1000), 256 * 1024)


def _interpreter_paths() -> list[str]:
    """What a Python on the hosts needs to see to run as this one does."""
    return [sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if p)]


def _shares(paths: Iterable[str], private: Sequence[str]) -> list[str]:
    """The existing paths strictly inside a private directory, none of them inside another."""
    inside = set()
    for path in map(os.path.abspath, paths):
        if os.path.exists(path) and any(path != d and _within(path, d) for d in private):
            inside.add(path)
    return sorted(p for p in inside if not any(q != p and _within(p, q) for q in inside))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
