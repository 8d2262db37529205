"""Every object path of the package (the object collectives and Horovod's broadcast_optimizer_state) run
on one group with pickle and torch.save/torch.load trapped, against references each rank
computes itself. Shared by the thread, shm and MPI tests (tests/test_never_pickled.py and
tests/mpi_jobs/object_paths.py)."""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import torch

import axonml_distributed as ad
from conformance import same_object, sample_object

# Every way a peer's bytes could be unpickled or pickled: the module's functions and classes, and
# torch's own (torch.load with weights_only has its own unpickler). Not marshal: imports read bytecode
# with it (and the package never calls it: a grep of python/ finds none).
TRAPPED = [
    (pickle, "dumps"), (pickle, "loads"), (pickle, "dump"), (pickle, "load"), (pickle, "Pickler"),
    (pickle, "Unpickler"), (torch, "save"), (torch, "load"),
]  # fmt: skip


class PickleUsed(AssertionError):
    pass


# Rank threads of one process share the trap: the first in saves the originals and traps, the last out
# restores them (each thread saving and restoring its own view would leave a trap in place for good).
_trap_lock = threading.Lock()
_trap_users = 0
_originals: list[tuple[Any, str, Any]] = []


@contextlib.contextmanager
def pickle_trapped() -> Iterator[None]:
    """Every function of `TRAPPED` raises PickleUsed while inside (in every thread of the process)."""
    global _trap_users

    def trap(name: str) -> Any:
        def refuse(*args: object, **kwargs: object) -> None:
            raise PickleUsed(f"{name} was called on an object path")

        return refuse

    with _trap_lock:
        if _trap_users == 0:
            _originals[:] = [(module, name, getattr(module, name)) for module, name in TRAPPED]
            for module, name, _ in _originals:
                setattr(module, name, trap(f"{module.__name__}.{name}"))
        _trap_users += 1
    try:
        yield
    finally:
        with _trap_lock:
            _trap_users -= 1
            if _trap_users == 0:
                for module, name, original in _originals:
                    setattr(module, name, original)


def same(a: Any, b: Any) -> bool:
    """`conformance.same_object`, with torch tensors: the same dtype, shape and bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return same_object(a, b)


def raw(t: torch.Tensor) -> bytes:
    if t.numel() == 0:  # torch views an empty tensor as bytes only if its last stride is 1
        return b""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def tensors(rank: int) -> dict[str | int, Any]:
    """Tensors of every dtype the codec carries (bfloat16 and bool too), 0-d, empty and strided ones."""
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(3, 5, generator=g, dtype=torch.float64) * (rank + 1) * 100
    out: dict[str | int, Any] = {
        str(dtype): base.to(dtype)
        for dtype in (
            torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
            torch.uint64,
        )
    }  # fmt: skip
    out["bool"] = base > 0
    out["strided"] = base.T[::2]
    out["0-d"] = torch.tensor(rank + 0.5, dtype=torch.bfloat16)
    out[rank] = torch.empty(0, 4, dtype=torch.int32)  # an int key, as an optimizer's state has
    return out


def sample(rank: int) -> Any:
    return {"plain": sample_object(rank), "tensors": tensors(rank)}


def model_and_optimizer(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    g = torch.Generator().manual_seed(0)  # not torch's global generator: the ranks may be threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    first, second = model
    opt = torch.optim.Adam(
        [{"params": first.parameters(), "amsgrad": True}, {"params": second.parameters(), "lr": lr / 2}],
        lr=lr,
        betas=(0.8, 0.99),
        foreach=False,
    )
    return model, opt


def stepped_state() -> dict[str, Any]:
    """The optimizer state of the root in `check_object_paths`: two Adam steps of one model."""
    model, opt = model_and_optimizer(0.01)
    first, second = model
    for i in range(2):
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / (i + 1)
        loss = second(first(x).to(torch.bfloat16)).float().square().sum()
        loss.backward()
        opt.step()
    return opt.state_dict()


def check_object_paths(pg: Any) -> list[str]:
    """Run every object path on `pg` with pickle trapped; returns what differed from the references (an
    empty list: all passed). Ranks are global, as everywhere in the package."""
    ranks, me = pg.ranks(), pg.rank()
    n, index = len(ranks), pg.group_rank(me)
    objs = {r: sample(r) for r in ranks}
    failures: list[str] = []

    def expect(got: Any, want: Any, what: str) -> None:
        if not same(got, want):
            failures.append(f"rank {me}: {what} differs from the reference")

    root = ranks[-1]
    _, opt = model_and_optimizer(0.5 * (me + 1))
    if me == root:
        opt.load_state_dict(stepped_state())
    with pickle_trapped():
        expect(ad.all_gather_object(objs[me], pg), [objs[r] for r in ranks], "all_gather_object")
        expect(
            ad.broadcast_object(objs[me] if me == root else None, root, pg), objs[root], "broadcast_object"
        )
        gathered = ad.gather_object(objs[me], root, pg)
        expect(gathered, [objs[r] for r in ranks] if me == root else None, "gather_object")
        scattered = ad.scatter_object([objs[r] for r in ranks] if me == root else None, root, pg)
        expect(scattered, objs[me], "scatter_object")
        nxt, prev = ranks[(index + 1) % n], ranks[(index - 1) % n]
        if index % 2 == 0:
            ad.send_object(objs[me], nxt, pg, tag=3)
            got = ad.recv_object(prev, pg, tag=3)
        else:
            got = ad.recv_object(prev, pg, tag=3)
            ad.send_object(objs[me], nxt, pg, tag=3)
        expect(got, objs[prev], "send_object/recv_object")
        ad.broadcast_optimizer_state(opt, root, pg)
        expect(opt.state_dict(), stepped_state(), "broadcast_optimizer_state")
        # The size limit holds on this path too: every rank refuses alike, nothing moves.
        try:
            ad.broadcast_optimizer_state(opt, root, pg, max_bytes=100)
            failures.append(f"rank {me}: broadcast_optimizer_state sent a state over max_bytes=100")
        except ValueError as exc:
            if me == root and "exceeds max_bytes=100" not in str(exc):
                failures.append(f"rank {me}: broadcast_optimizer_state over max_bytes said {exc}")
    probe = ad.all_gather_object(me, pg)
    if probe != ranks:
        failures.append(f"rank {me}: the group after the object paths gave {probe}")
    return failures
