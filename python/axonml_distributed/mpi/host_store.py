"""The key-value store the ranks of one host meet through to join their shared-memory world
(`ShmBackend.join`), carried by MPI over the host's communicator: its first rank keeps the store in
memory, the others ask it by message. No TCP port is chosen, so none can be taken by another process
between choosing and listening, and the host's ranks need no common network namespace or loopback: MPI
already joins them. Only the job's ranks reach the communicator, so the store admits no stranger.

The keeper answers requests only while it is inside a call of its own (the rendezvous calls its store
in slices while it waits) and, once its rendezvous has ended, in `finish` until every other rank has
said it is done; a rank that asks waits for the answer until the store's timeout. Messages are bytes
(MPI_BYTE; nothing is pickled): a request is an operation byte, the key (16-bit length first) and the
operand; an answer is the operation's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from mpi4py import MPI

from axonml_distributed.exceptions import CollectiveTimeoutError

KEEPER = 0  # the rank of the host's communicator that keeps the store
ASK, ANSWER = 1, 2  # tags, on a communicator the store has to itself
SET, GET, CHECK, ADD, DELETE, DONE = range(1, 7)
MISSING = b"\x00"
FIRST_PAUSE_S, MAX_PAUSE_S = 0.0005, 0.005


class HostStore:
    """torch's Store methods (`_core._Store`) for the rendezvous of the ranks of `comm` (one host's).
    Every rank makes one; the keeper (rank 0 of `comm`) then calls `finish` after its rendezvous, every
    other rank `done` after its own, however it ended."""

    def __init__(self, comm: MPI.Intracomm, timeout: float) -> None:
        self._comm = comm
        self._timeout = timeout
        self._keeper = comm.Get_rank() == KEEPER
        self._map: dict[str, bytes] = {}
        self._done: set[int] = set()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._call(SET, key, data)

    def get(self, key: str) -> bytes:
        found = self._call(GET, key)
        if found[:1] == MISSING:
            raise KeyError(key)
        return found[1:]

    def check(self, keys: list[str]) -> bool:
        return all(self._call(CHECK, key) == b"\x01" for key in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Returns once every key is set; raises TimeoutError after `timeout`, as torch's stores do."""
        deadline = time.monotonic() + timeout.total_seconds()
        pause = FIRST_PAUSE_S
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"keys {keys} not set within {timeout.total_seconds():g} s")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))  # Ctrl-C raises here
            pause = min(2 * pause, MAX_PAUSE_S)

    def add(self, key: str, delta: int) -> int:
        total = self._call(ADD, key, delta.to_bytes(8, "little", signed=True))
        return int.from_bytes(total, "little", signed=True)

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, key) == b"\x01"

    def done(self) -> None:
        """A rank that is not the keeper: its rendezvous has ended, it asks no more."""
        self._send(DONE.to_bytes(1, "little"), KEEPER, ASK)

    def finish(self) -> None:
        """The keeper, its rendezvous ended: answer the others until each has said it is done (they may
        still ask while they attach), or the timeout passes."""
        others = self._comm.Get_size() - 1
        deadline = time.monotonic() + self._timeout
        pause = FIRST_PAUSE_S
        while len(self._done) < others:
            if self._serve():
                pause = FIRST_PAUSE_S
                continue
            if time.monotonic() >= deadline:
                late = sorted(set(range(1, others + 1)) - self._done)
                raise CollectiveTimeoutError(
                    f"rank {KEEPER}: the host's rendezvous store: rank(s) {late} did not end their "
                    f"rendezvous within {self._timeout:g} s",
                    rank=KEEPER,
                    ranks=late,
                    call="init_mpi_process_group (the host's rendezvous)",
                    group=list(range(others + 1)),
                    waited=self._timeout,
                )
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)

    # -- the keeper's side ----------------------------------------------------------------------------

    def _apply(self, op: int, key: str, operand: bytes) -> bytes:
        if op == SET:
            self._map[key] = operand
            return b""
        if op == GET:
            value = self._map.get(key)
            return MISSING if value is None else b"\x01" + value
        if op == CHECK:
            return b"\x01" if key in self._map else b"\x00"
        if op == ADD:
            total = int(self._map.get(key, b"0")) + int.from_bytes(operand, "little", signed=True)
            self._map[key] = str(total).encode()
            return total.to_bytes(8, "little", signed=True)
        if op == DELETE:
            return b"\x01" if self._map.pop(key, None) is not None else b"\x00"
        raise ValueError(f"the host's rendezvous store: unknown operation {op}")

    def _serve(self) -> bool:
        """Answer every request waiting now; whether there was one."""
        status = MPI.Status()
        served = False
        while self._comm.Iprobe(MPI.ANY_SOURCE, ASK, status):
            source = status.Get_source()
            request = bytearray(status.Get_count(MPI.BYTE))
            self._comm.Recv([request, MPI.BYTE], source, ASK)
            served = True
            if request[0] == DONE:
                self._done.add(source)
                continue
            size = int.from_bytes(request[1:3], "little")
            key, operand = request[3 : 3 + size].decode(), bytes(request[3 + size :])
            self._send(self._apply(request[0], key, operand), source, ANSWER)
        return served

    # -- every rank -----------------------------------------------------------------------------------

    def _call(self, op: int, key: str, operand: bytes = b"") -> bytes:
        if self._keeper:
            self._serve()
            return self._apply(op, key, operand)
        encoded = key.encode()
        self._send(bytes([op]) + len(encoded).to_bytes(2, "little") + encoded + operand, KEEPER, ASK)
        return self._receive()

    def _send(self, data: bytes, dest: int, tag: int) -> None:
        request = self._comm.Isend([data, MPI.BYTE], dest, tag)
        self._until(request.Test, "a message to reach")

    def _receive(self) -> bytes:
        status = MPI.Status()
        self._until(lambda: self._comm.Iprobe(KEEPER, ANSWER, status), "an answer from")
        answer = bytearray(status.Get_count(MPI.BYTE))
        self._comm.Recv([answer, MPI.BYTE], KEEPER, ANSWER)
        return bytes(answer)

    def _until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll `ready()` until true, or raise TimeoutError after the store's timeout."""
        deadline = time.monotonic() + self._timeout
        pause = FIRST_PAUSE_S
        while not ready():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the host's rendezvous store: waited {self._timeout:g} s in vain for {what} its "
                    "keeper (the host's first rank)"
                )
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
