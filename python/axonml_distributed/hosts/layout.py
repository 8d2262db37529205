"""Which ranks share a host, found honestly: a name is not enough (containers and clusters reuse
hostnames; vLLM and DeepSpeed both shipped shared memory chosen across nodes that way).

Two ranks are candidates for one host when their identities agree: hostname, kernel boot id, machine
id, IPC namespace and the /dev/shm file system they see (or AXONML_HOST_ID, where set). Candidates then
prove it: the lowest rank of each candidate host creates a random object in /dev/shm (0600, random
contents) and the others open and read it back; those that cannot prove among themselves in a next
round, so a claim that two hosts share still yields two hosts. Ranks of different candidates never try
one another's memory. The exchange is a function `all_gather(item) -> items` of fixed-size bytes over
whatever the job already has (torch's Store, an MPI communicator).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from axonml_distributed import settings
from axonml_distributed._core import SEGMENT_DIR

# Every item exchanged is this many bytes: a digest of the identity, a proof's offer, a verdict.
ITEM_BYTES = 32
AllGather = Callable[[bytes], list[bytes]]
_PROOF_PREFIX = "axonml-proof-"


@dataclass(frozen=True)
class HostLayout:
    """The job's hosts as `rank` sees them: `hosts[h]` is host h's global ranks, ascending; hosts are
    ordered by their lowest rank, so every rank numbers them alike."""

    hosts: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def host(self) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.hosts[self.host]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def uniform(self) -> bool:
        """Whether every host holds as many ranks: the two-level collectives need it."""
        return len({len(ranks) for ranks in self.hosts}) == 1

    def peers(self) -> tuple[int, ...]:
        """The global ranks with this rank's local index on every host (uniform layouts), host order."""
        i = self.local_rank
        return tuple(ranks[i] for ranks in self.hosts)

    def within(self, ranks: list[int]) -> HostLayout:
        """The layout of the group of global `ranks` (which holds this rank): hosts keep their order,
        each keeps the group's ranks on it, and hosts with none drop out."""
        members = set(ranks)
        kept = (tuple(r for r in host if r in members) for host in self.hosts)
        return HostLayout(tuple(host for host in kept if host), self.rank)


def identity() -> bytes:
    """This process's claim to a host, as a digest (the parts may be long)."""
    claimed = settings.host_id()
    if claimed is not None:
        parts = ["claimed", claimed]
    else:
        shm = os.stat(SEGMENT_DIR) if os.path.isdir(SEGMENT_DIR) else None
        parts = [
            socket.gethostname(),
            _read("/proc/sys/kernel/random/boot_id"),
            _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id"),
            _link("/proc/self/ns/ipc"),
            f"{shm.st_dev}:{shm.st_ino}" if shm else "no /dev/shm",
        ]
    return hashlib.sha256("\0".join(parts).encode()).digest()


def find_hosts(rank: int, size: int, all_gather: AllGather) -> HostLayout:
    """The job's hosts (collective: every rank of the job calls it with the same `all_gather`)."""
    claims = all_gather(identity())
    if len(claims) != size:
        raise RuntimeError(f"finding hosts: {len(claims)} claims for {size} ranks")
    candidates: dict[bytes, list[int]] = {}
    for r, claim in enumerate(claims):
        candidates.setdefault(claim, []).append(r)
    # Rounds of proof: in each, the lowest unproven rank of each candidate group offers an object and
    # the group's other unproven ranks try it; those that read it share its host. Every rank sees every
    # verdict, so all run the same rounds; each round settles at least each group's offerer.
    hosts: list[tuple[int, ...]] = []
    unproven = list(candidates.values())
    while unproven:
        mine = next((group for group in unproven if rank in group), None)
        offering = mine is not None and mine[0] == rank
        # An offerer that cannot make its object (no /dev/shm, or full) still settles, as a host of its own.
        proof = _Proof.try_create() if offering else None
        try:
            offers = all_gather(proof.offer if proof else bytes(ITEM_BYTES))
            proven = offering or (mine is not None and _Proof.check(offers[mine[0]]))
            verdicts = all_gather((b"\1" if proven else b"\0") * ITEM_BYTES)
        finally:
            if proof is not None:
                proof.remove()
        groups, unproven = unproven, []
        for group in groups:
            hosts.append(tuple(r for r in group if verdicts[r][0]))
            rest = [r for r in group if not verdicts[r][0]]
            if rest:
                unproven.append(rest)
    return HostLayout(tuple(sorted(hosts, key=min)), rank)


def proof_creator(filename: str) -> int | None:
    """The pid of the process that made the proof object `filename` (a name in /dev/shm), if it is one
    of this user's: `shm.cleanup_stale_segments` removes those whose creator is gone (a process killed
    while finding hosts leaves its proof behind)."""
    mine = f"{_PROOF_PREFIX}{os.geteuid()}-"
    if not filename.startswith(mine):
        return None
    pid = filename.removeprefix(mine).split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


class _Proof:
    """A random object in /dev/shm: whoever reads its contents back shares this host's memory. Its name
    starts with its creator's pid, so a sweep can tell a leftover (`proof_creator`)."""

    def __init__(self, name: bytes, token: bytes) -> None:
        self.name, self.token = name, token

    @staticmethod
    def path(name: bytes) -> Path:
        pid, rest = int.from_bytes(name[:4], "little"), name[4:]
        return Path(SEGMENT_DIR) / f"{_PROOF_PREFIX}{os.geteuid()}-{pid}-{rest.hex()}"

    @classmethod
    def try_create(cls) -> _Proof | None:
        try:
            return cls.create()
        except OSError:
            return None

    @classmethod
    def create(cls) -> _Proof:
        name = os.getpid().to_bytes(4, "little") + secrets.token_bytes(ITEM_BYTES // 2 - 4)
        proof = cls(name, secrets.token_bytes(ITEM_BYTES // 2))
        fd = os.open(proof.path(proof.name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, proof.token)
        finally:
            os.close(fd)
        return proof

    @property
    def offer(self) -> bytes:
        return self.name + self.token

    @classmethod
    def check(cls, offer: bytes) -> bool:
        half = ITEM_BYTES // 2
        try:
            with open(cls.path(offer[:half]), "rb") as f:
                return os.fstat(f.fileno()).st_uid == os.geteuid() and f.read(half + 1) == offer[half:]
        except OSError:
            return False

    def remove(self) -> None:
        self.path(self.name).unlink(missing_ok=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
