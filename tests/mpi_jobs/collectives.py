"""What only the MPI process group does, against the numpy reference: async completion in issue order,
small all_reduces riding along with the signature check, staging buffers kept alive, unaligned and
strided buffers, subgroups, bad input, the check switched off. Exit code 0 = pass. The collectives every
world shares are tests/conformance.py's (run here too with `--network`).

`--network`: the launcher turned MPI's shared-memory path off; first prove the bytes really cross a
network transport (the loopback interface's byte counter grows by at least the payload).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from axonml_distributed import ReduceOp
from axonml_distributed.mpi import MpiProcessGroup, init_mpi_process_group
from conformance import CHECKS, raises, started
from reference import all_inputs, expect_same, reduce_ref


def check_async(pg: MpiProcessGroup) -> None:
    n, me = pg.size(), pg.group_rank(pg.rank())
    inputs = all_inputs(n, "async", (64 * 1024 + 5,), np.float32)
    bufs = [inputs[me].copy() for _ in range(4)]
    works = [started(pg.all_reduce(b, ReduceOp.SUM, async_op=True)) for b in bufs]
    gathered = pg.all_gather_tensor(inputs[me][:9], async_op=True)
    works.append(started(pg.barrier(async_op=True)))
    # Waiting on the last completes everything issued before it, in order.
    assert works[-1].wait() is None
    assert all(w.is_completed() for w in works) and gathered.is_completed()
    for b in bufs:
        expect_same(b, reduce_ref(inputs, "SUM"), "async all_reduce")
    expect_same(gathered.wait(), inputs[:, :9], "async all_gather_tensor result")
    avg = pg.all_reduce_tensor(inputs[me], ReduceOp.AVERAGE, async_op=True)
    expect_same(avg.wait(), reduce_ref(inputs, "AVERAGE"), "async AVERAGE")
    # Ranks may take different paths for matching calls: odd ranks issue the first all_reduce async, so
    # their second one queues behind it; even ranks run both blocking on an idle queue (the short path).
    first, second = inputs[me].copy(), inputs[me].copy()
    pending = started(pg.all_reduce(first, async_op=True)) if me % 2 else None
    if pending is None:
        pg.all_reduce(first)
    pg.all_reduce(second)
    assert pending is None or pending.is_completed()
    expect_same(first, reduce_ref(inputs, "SUM"), "all_reduce, async on odd ranks only")
    expect_same(second, reduce_ref(inputs, "SUM"), "blocking all_reduce behind async work")


def check_small_all_reduces(pg: MpiProcessGroup) -> None:
    """Blocking float SUM/AVERAGE all_reduces of at most 8 elements ride along with the signature check
    when every rank's does; when some rank's cannot (async here, or work pending), all fall back to the
    data call. Either way the result is the same, up to and past the 8-element limit and in any shape."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for dtype in (np.float32, np.float64):
        for op in ("SUM", "AVERAGE"):
            rop = getattr(ReduceOp, op)
            for shape in ((), (1,), (8,), (9,), (2, 4), (4, 1, 2)):
                case = f"small-{np.dtype(dtype).name}-{op}-{shape}"
                inputs = all_inputs(n, case, shape, dtype, op)
                expected = reduce_ref(inputs, op)
                buf = np.array(inputs[me])  # a 0-d array for shape (), not a numpy scalar
                pg.all_reduce(buf, rop)
                expect_same(buf, expected, f"all_reduce {case}")
                # Odd ranks' call cannot ride along: async, then a blocking one behind it.
                first, second = np.array(inputs[me]), np.array(inputs[me])
                pending = started(pg.all_reduce(first, rop, async_op=True)) if me % 2 else None
                if pending is None:
                    pg.all_reduce(first, rop)
                pg.all_reduce(second, rop)
                assert pending is None or pending.is_completed()
                expect_same(first, expected, f"all_reduce {case}, async on odd ranks")
                expect_same(second, expected, f"all_reduce {case}, behind async work on odd ranks")
    # float32 rides along as float64: the sum, exact there, is rounded to float32 once.
    big = np.array([2.0**24, -(2.0**24)], np.float32) if me == 0 else np.ones(2, np.float32)
    pg.all_reduce(big)
    want = np.array([2.0**24 + n - 1, -(2.0**24) + n - 1], np.float64).astype(np.float32)
    expect_same(big, want, "small float32 all_reduce, summed in float64")


def check_buffer_lifetimes(pg: MpiProcessGroup) -> None:
    """Async operations whose MPI buffers exist only inside the group (float16's float32 staging copies,
    the contiguous copy of a strided send_tensor) must keep them alive until completion: churn the heap
    while they are pending, then check the results."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    count = 3 * n * 65536  # large enough for rendezvous protocols: MPI reads the buffers late
    inputs = all_inputs(n, "lifetime", (count,), np.float16)
    works = [pg.all_reduce_tensor(inputs[me], async_op=True) for _ in range(2)]
    works.append(pg.reduce_scatter_tensor(inputs[me], async_op=True))
    if n > 1:
        ring = pg.ranks()
        works.append(pg.send_tensor(np.repeat(inputs[me], 2)[::2], ring[(me + 1) % n], 9, async_op=True))
        got = pg.recv_tensor((count,), np.float16, ring[(me - 1) % n], 9, async_op=True)
    for _ in range(20):
        np.full(count * 2, 7.0, np.float32)  # reuses whatever memory was freed
    total = reduce_ref(inputs, "SUM")
    expect_same(works[0].wait(), total, "async float16 all_reduce_tensor")
    expect_same(works[2].wait(), total.reshape(n, -1)[me], "async float16 reduce_scatter_tensor")
    if n > 1:
        works[3].wait()
        expect_same(got.wait(), inputs[(me - 1) % n], "async send_tensor of a strided array")


def check_unaligned_and_strided(pg: MpiProcessGroup) -> None:
    """Only MPI takes buffers not aligned for their dtype and strided send_tensor input (the native worlds
    refuse both): it reduces the former in place and copies the latter."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    count = 1023
    inputs = all_inputs(n, "unaligned", (count,), np.float32)
    raw = np.zeros(count * 4 + 1, np.uint8)
    buf = raw[1:].view(np.float32)  # one byte past an aligned address
    assert not buf.flags.aligned
    buf[...] = inputs[me]
    pg.all_reduce(buf)
    expect_same(buf, reduce_ref(inputs, "SUM"), "unaligned all_reduce")
    offset = np.zeros(count + 1, np.float64)[1:]  # element-offset view
    offset[...] = inputs[me]
    pg.all_reduce(offset)
    expect_same(offset, reduce_ref(inputs.astype(np.float64), "SUM"), "offset view all_reduce")
    if n > 1:
        ring = pg.ranks()
        for dtype in (np.float16, np.float32, np.int32):
            mine = all_inputs(n, "tensor", (2 * n, 3), dtype)[me]
            work = started(pg.send_tensor(mine.T, ring[(me + 1) % n], 5, async_op=True))
            got = pg.recv_tensor((3, 2 * n), dtype, ring[(me - 1) % n], 5)
            work.wait()
            want = all_inputs(n, "tensor", (2 * n, 3), dtype)[(me - 1) % n].T
            expect_same(got, want, "send_tensor of a strided array")


def check_subgroups(pg: MpiProcessGroup) -> None:
    n = pg.size()
    # Members are kept sorted whatever the order given, as in the native groups.
    members = sorted({n - 1, *range(0, n - 1, 2)})
    sub = pg.new_group(members[::-1])
    assert sub.ranks() == members and sub.size() == len(members) and sub.world_size() == n
    assert sub.rank() == pg.rank() and sub.backend().name() == "mpi"
    if sub.contains(pg.rank()):
        me = sub.group_rank(pg.rank())
        inputs = all_inputs(len(members), "sub", (2 * len(members) + 1,), np.float64)
        buf = inputs[me].copy()
        sub.all_reduce(buf, ReduceOp.MIN)
        expect_same(buf, reduce_ref(inputs, "MIN"), "subgroup all_reduce")
        chunks = all_inputs(len(members), "sub-rs", (len(members), 3), np.int64)
        got = sub.reduce_scatter_tensor(chunks[me].reshape(-1))
        expect_same(got, reduce_ref(chunks, "SUM")[me], "subgroup reduce_scatter: chunk i to the i-th member")
        expect_same(sub.broadcast_tensor(inputs[me]), inputs[0], "subgroup broadcast default src")
        inner = sub.new_group(members[:1])
        assert inner.size() == 1
        if inner.contains(pg.rank()):
            expect_same(inner.all_reduce_tensor(inputs[me]), inputs[me], "one-rank group")
    else:
        raises(ValueError, sub.all_reduce, np.zeros(3), match="not a member")
        raises(ValueError, sub.barrier, match="not a member")
        raises(ValueError, sub.group_rank, pg.rank(), match="not a member")
    # The native groups' checks and words (the core's).
    raises(ValueError, pg.new_group, [0, 0], match="appears twice")
    raises(TypeError, pg.new_group, [0.5])
    raises(ValueError, pg.new_group, [n], match="out of range")
    raises(ValueError, pg.new_group, [], match="at least one")
    pg.barrier()


def check_bad_input(pg: MpiProcessGroup) -> None:
    """Symmetric bad calls: every rank raises its own error (the core's, as on the native groups; the
    conformance suite compares the words), and the group stays usable."""
    n = pg.size()
    a = np.zeros(8, np.float32)
    readonly = np.zeros(8, np.float32)
    readonly.flags.writeable = False
    raises(TypeError, pg.all_reduce, np.zeros(3, dtype=object), match="not supported")
    raises(TypeError, pg.all_reduce, np.zeros(3, dtype=np.longdouble), match="not supported")
    raises(TypeError, pg.all_reduce, np.zeros(3, dtype=">f4"), match="not supported")
    raises(TypeError, pg.all_reduce, [1.0, 2.0], match="numpy.ndarray")
    raises(TypeError, pg.all_reduce, a, 2.5, match="ReduceOp")
    raises(ValueError, pg.all_reduce, a, "median", match="unknown reduce op")
    raises(ValueError, pg.all_reduce, np.zeros(8, np.float32)[::2], match="contiguous")
    raises(ValueError, pg.all_reduce, np.zeros((4, 4), np.float32, order="F"), match="contiguous")
    raises(ValueError, pg.all_reduce, readonly, match="read-only")
    average = ReduceOp.AVERAGE
    raises(TypeError, pg.all_reduce, np.zeros(3, np.int32), average, match="AVERAGE is not defined for int32")
    raises(ValueError, pg.broadcast, a, n, match="not a member")
    raises(OverflowError, pg.broadcast, a, -1)  # ranks are unsigned, as everywhere
    raises(TypeError, pg.reduce, a, 1.5)
    raises(ValueError, pg.all_gather, a, np.zeros(8 * n + 1, np.float32), match="elements")
    raises(ValueError, pg.all_gather, a, np.zeros(8 * n, np.float64), match="dtype")
    raises(ValueError, pg.reduce_scatter, np.zeros(8 * n + 1, np.float32), a, match="elements")
    if n > 1:
        raises(ValueError, pg.reduce_scatter_tensor, np.zeros(n + 1, np.float32), match="divide")
    raises(ValueError, pg.send, a, pg.rank(), match="itself")
    raises(ValueError, pg.recv, a, n + 3, match="not a member")
    if n > 1:
        raises(ValueError, pg.send, a, (pg.rank() + 1) % n, -1, match="tag")
        # The largest tag MPI allows is the group's own (new_group's arrival check).
        reserved = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        raises(ValueError, pg.recv, a, (pg.rank() + 1) % n, reserved, match=f"[0, {reserved - 1}]")
    raises(TypeError, pg.empty, 3, np.longdouble, match="cannot carry")
    buf = np.ones(4, np.float32)
    pg.all_reduce(buf)
    expect_same(buf, np.full(4, n, np.float32), "all_reduce after bad calls")


def check_unchecked(n: int) -> None:
    """The same answers with the signature check switched off."""
    pg = init_mpi_process_group(timeout=60, check_signatures=False)
    me = pg.rank()
    inputs = all_inputs(n, "unchecked", (1000,), np.float32)
    buf = inputs[me].copy()
    pg.all_reduce(buf, ReduceOp.AVERAGE)
    expect_same(buf, reduce_ref(inputs, "AVERAGE"), "unchecked all_reduce")
    expect_same(pg.all_gather_tensor(inputs[me]), inputs, "unchecked all_gather")
    raises(ValueError, pg.all_reduce, inputs[me][::2], match="contiguous")
    pg.barrier()


def loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])
    raise AssertionError("no loopback interface in /proc/net/dev")


def check_network_transport(pg: MpiProcessGroup) -> None:
    world = MPI.COMM_WORLD
    if "MPICH" in MPI.Get_library_version():
        # MPIR_CVAR_NOLOCAL: every rank believes it is alone on its node.
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        assert node.Get_size() == 1, f"shared-memory peers still visible: {node.Get_size()}"
        node.Free()
    payload = np.ones(4 << 20, np.float32)  # 16 MiB
    pg.barrier()
    before = loopback_bytes()
    pg.all_reduce(payload)
    pg.barrier()
    moved = loopback_bytes() - before
    assert moved >= payload.nbytes, f"only {moved} bytes crossed the loopback interface"
    expect_same(payload[:4], np.full(4, pg.size(), np.float32), "network all_reduce")
    if pg.rank() == 0:
        print(f"network transport: {moved / 2**20:.1f} MiB crossed lo for a 16 MiB all_reduce", flush=True)


def main() -> None:
    pg = init_mpi_process_group(timeout=120)
    assert pg.backend().name() == "mpi" and pg.ranks() == list(range(pg.world_size()))
    if "--network" in sys.argv:
        check_network_transport(pg)
        # Over the network transport, the collectives every world shares as well, but for receives from
        # any source: under MPIR_CVAR_NOLOCAL (MPICH 5, ch4 over ofi tcp) a receive from MPI.ANY_SOURCE
        # of tag 12 never matched the tag-12 messages queued behind ones of tag 11 (a receive naming
        # the source did); with shared memory on, test_mpi runs the check as every world does.
        for name, check in CHECKS.items():
            if name != "any_source":
                check(pg)
    check_async(pg)
    check_small_all_reduces(pg)
    check_buffer_lifetimes(pg)
    check_unaligned_and_strided(pg)
    check_subgroups(pg)
    check_bad_input(pg)
    check_unchecked(pg.size())
    pg.barrier()
    if pg.rank() == 0:
        print(f"collectives OK on {pg.size()} ranks", flush=True)


if __name__ == "__main__":
    main()
