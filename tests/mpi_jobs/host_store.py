"""An mpiexec job for tests/test_hosts_mpi_store.py: `mpi.host_store.HostStore` over COMM_WORLD (its
rank 0 the keeper), against torch's Store contract as the rendezvous uses it. Every rank adds to one
counter, sets a key of its own, waits for every rank's, reads them back, deletes its own; a key never
set is absent, and a wait for it raises TimeoutError. Exit code 0 = pass; rank 0 prints
``host store OK on N ranks``."""

from __future__ import annotations

from datetime import timedelta

from mpi4py import MPI

from axonml_distributed.mpi.host_store import HostStore

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()
store = HostStore(comm, timeout=60)
store.add("counter", me + 1)
store.set(f"key/{me}", f"value of rank {me}".encode() * (1000 if me == 1 else 1))  # one longer value
keys = [f"key/{r}" for r in range(n)]
store.wait(keys, timedelta(seconds=60))
assert store.check(keys)
for r in range(n):
    assert store.get(f"key/{r}") == f"value of rank {r}".encode() * (1000 if r == 1 else 1), r
assert not store.check(["never set"]) and not store.check([keys[me], "never set"])
try:
    store.wait(["never set"], timedelta(milliseconds=50))
    raise AssertionError("a wait for a key never set returned")
except TimeoutError:
    pass
# Every rank has read every key before any is deleted (through the store: the keeper answers only
# inside its own calls, so an MPI barrier would leave the others' questions unanswered).
store.set(f"read/{me}", b"")
store.wait([f"read/{r}" for r in range(n)], timedelta(seconds=60))
assert store.delete_key(keys[me]) and not store.delete_key(keys[me])
assert not store.check([keys[me]])
try:
    store.get(keys[me])
    raise AssertionError("a deleted key was read")
except KeyError:
    pass
if me == 0:
    store.finish()
else:
    store.done()
totals = comm.allgather(store.add("counter", 0) if me == 0 else None)
assert totals[0] == n * (n + 1) // 2, totals
if me == 0:
    print(f"host store OK on {n} ranks", flush=True)
