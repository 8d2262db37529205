"""PID 1 of a simulated host: gives the host its identity and private directories, then reaps orphans.

Started by `SimHosts.up` as ``python -I -S hostinit.py CONFIG_JSON`` inside fresh net, IPC, UTS, PID and
mount namespaces (``ip netns exec NS unshare ... --propagation private``), so every mount below stays
inside the host. Standard library only, run by path: it starts before anything else on the host, and
importing the package (numpy, the native module) would only slow every host's start.

CONFIG_JSON keys: name (hostname), binds ({target: source file}, e.g. /etc/hosts, /etc/machine-id, the
kernel's boot_id), private (directories that get a fresh tmpfs), share (paths inside those directories
that stay visible, e.g. a venv or a clone under /tmp), scratch (an empty directory to build each tmpfs in).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys

_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(
        source.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None if data is None else data.encode(),
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _private_dir(directory: str, shares: list[str], scratch: str, name: str) -> None:
    """A fresh tmpfs over `directory`, with the shared paths under it bound back in. Built in `scratch`
    and moved into place, because the shared paths must still be reachable when they are bound."""
    _mount(f"simhost-{name}", scratch, "tmpfs", 0, "mode=1777")
    for path in shares:
        inside = os.path.join(scratch, os.path.relpath(path, directory))
        if os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            open(inside, "a").close()
        _mount(path, inside, None, _MS_BIND | _MS_REC)
    _mount(scratch, directory, None, _MS_MOVE)


def _reap_forever() -> None:
    """Processes entered into this host (nsenter) are re-parented here when their parent exits."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        signal.sigwait({signal.SIGCHLD})  # blocked, so one that came before the wait is still pending


def main() -> None:
    config = json.loads(sys.argv[1])
    socket.sethostname(config["name"])
    for target, source in config["binds"].items():
        if os.path.exists(target):
            _mount(source, target, None, _MS_BIND)
    for directory in config["private"]:
        if os.path.isdir(directory):
            shares = [s for s in config["share"] if s.startswith(directory.rstrip("/") + "/")]
            _private_dir(directory, shares, config["scratch"], config["name"])
    # The host's creator waits for this line; nothing may write to its pipe afterwards.
    print("READY", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _reap_forever()


if __name__ == "__main__":
    main()
