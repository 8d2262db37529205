"""The shared-memory world's collectives across real processes: every collective, dtype and op against the
numpy reference in rank order (bitwise, on private and on segment arrays, small and pipelined sizes), two
groups over one backend, point-to-point above the eager limit, subgroups. Each worker computes its
references independently; no test leaves a segment of ours in /dev/shm.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from axonml_distributed import (
    ProcessGroup,
)
from reference import NUMBERS, OP_NAMES, digest, reduce_ref, same_bits, wide_values
from shm_run import (
    connect,
    ok,
    run_world,
    segments_unchanged,
)

no_leak = pytest.fixture(autouse=True)(segments_unchanged)


def w_collectives(rank, n, ports, job, timeout, q):
    """Every collective x dtype (x op) x size on private arrays, then on segment arrays."""
    pg = connect(rank, n, ports[0], timeout)
    fails: list[str] = []
    digests: list[str] = []
    case = 0

    def check(name: str, got: np.ndarray, want: np.ndarray, everywhere: bool = True) -> None:
        """`everywhere`: the result is the same on every rank, so its digest is compared across ranks."""
        if everywhere:
            digests.append(f"{name}={digest(got)}")
        if not same_bits(got, want):
            fails.append(f"{name}: got {got.ravel()[:4]} want {want.ravel()[:4]}")

    sizes = [0, 1, 7, 1023, 3 * 4096 + 3, 40_003]
    for dt in NUMBERS:
        for op in OP_NAMES:
            if op == "AVERAGE" and np.dtype(dt).kind != "f":
                continue
            for size in sizes:
                case += 1
                xs = [wide_values(r, case, size, dt, op) for r in range(n)]
                x = xs[rank].copy()
                pg.all_reduce(x, op)
                check(f"all_reduce {dt.__name__} {op} {size}", x, reduce_ref(xs, op))
                x = xs[rank].copy()
                pg.reduce(x, n - 1, op)
                want = reduce_ref(xs, op) if rank == n - 1 else xs[rank]
                check(f"reduce {dt.__name__} {op} {size}", x, want, everywhere=False)
                big = [wide_values(r, case, n * size, dt, op) for r in range(n)]
                out = np.empty(size, dt)
                pg.reduce_scatter(big[rank], out, op)
                want = reduce_ref(big, op)[rank * size : (rank + 1) * size]
                check(f"reduce_scatter {dt.__name__} {op} {size}", out, want, everywhere=False)
        for size in sizes:
            case += 1
            xs = [wide_values(r, case, size, dt) for r in range(n)]
            root = case % n
            x = xs[rank].copy()
            pg.broadcast(x, root)
            check(f"broadcast {dt.__name__} {size}", x, xs[root])
            out = np.empty((n, size), dt)
            pg.all_gather(xs[rank], out)
            check(f"all_gather {dt.__name__} {size}", out, np.stack(xs))
            g = np.empty((n, size), dt) if rank == root else None
            pg.gather(xs[rank], g, root)
            if rank == root:
                check(f"gather {dt.__name__} {size}", g, np.stack(xs), everywhere=False)
            full = [wide_values(r, case + 7, n * size, dt) for r in range(n)]
            out = np.empty(size, dt)
            pg.scatter(full[rank] if rank == root else None, out, root)
            want = full[root][rank * size : (rank + 1) * size]
            check(f"scatter {dt.__name__} {size}", out, want, everywhere=False)
    # Large messages cross many pipeline rounds (1 MiB buffers): >= 8 MiB per rank.
    large = [(np.float32, 2 * 1024 * 1024 + 3), (np.float16, 4 * 1024 * 1024 + 1), (np.int8, 8 << 20)]
    for dt, size in large:
        case += 1
        xs = [wide_values(r, case, size, dt) for r in range(n)]
        x = xs[rank].copy()
        pg.all_reduce(x)
        check(f"all_reduce large {dt.__name__}", x, reduce_ref(xs, "SUM"))
    case += 1
    xs = [wide_values(r, case, 2 * 1024 * 1024 + 5, np.float32) for r in range(n)]
    x = xs[rank].copy()
    pg.broadcast(x, 1)
    check("broadcast large", x, xs[1])
    out = np.empty((n, xs[0].size), np.float32)
    pg.all_gather(xs[rank], out)
    check("all_gather large", out, np.stack(xs))
    pg.barrier()
    # Segment arrays: collectives run straight on them (zero copy), results identical.
    for dt in NUMBERS:
        for size in [1, 1023, 40_003, 3 * 4096 + 3]:
            case += 1
            xs = [wide_values(r, case, size, dt) for r in range(n)]
            a = pg.empty(size, dt)
            assert isinstance(a.base, object) and a.flags.c_contiguous and a.flags.writeable
            a[:] = xs[rank]
            pg.all_reduce(a, "MAX")
            check(f"segment all_reduce {dt.__name__} {size}", a, reduce_ref(xs, "MAX"))
            a[:] = xs[rank]
            pg.broadcast(a, 0)
            check(f"segment broadcast {dt.__name__} {size}", a, xs[0])
            out = pg.empty((n, size), dt)
            pg.all_gather(xs[rank], out)  # private send, segment recv: staged, still right
            check(f"mixed all_gather {dt.__name__} {size}", out, np.stack(xs))
            s = pg.empty(n * size, dt)
            s[:] = wide_values(rank, case + 9, n * size, dt)
            full = [wide_values(r, case + 9, n * size, dt) for r in range(n)]
            r = pg.empty(size, dt)
            pg.reduce_scatter(s, r)
            want = reduce_ref(full, "SUM")[rank * size :][:size]
            check(f"segment reduce_scatter {dt.__name__} {size}", r, want, everywhere=False)
    case += 1
    size = 2 * 1024 * 1024 + 3
    xs = [wide_values(r, case, size, np.float32) for r in range(n)]
    a = pg.empty(size, np.float32)
    a[:] = xs[rank]
    pg.all_reduce(a)
    check("segment all_reduce large", a, reduce_ref(xs, "SUM"))
    # Point to point: a ring, two tags, in order.
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for tag, size in [(3, 5), (4, 300_001)]:
        msg = wide_values(rank, tag, size, np.int64)
        if rank % 2 == 0:
            pg.send(msg, nxt, tag)
            got = np.empty(size, np.int64)
            pg.recv(got, prv, tag)
        else:
            got = np.empty(size, np.int64)
            pg.recv(got, prv, tag)
            pg.send(msg, nxt, tag)
        check(f"send/recv tag {tag}", got, wide_values(prv, tag, size, np.int64), everywhere=False)
    # Subgroups: evens and odds reduce concurrently.
    from axonml_distributed import World

    world = World(pg.backend())
    evens, odds = world.new_group(list(range(0, n, 2))), world.new_group(list(range(1, n, 2)))
    mine = evens if rank % 2 == 0 else odds
    x = np.full(70_000, rank + 1, np.int64)
    mine.all_reduce(x)
    want = np.full(70_000, sum(r + 1 for r in mine.ranks()), np.int64)
    check("subgroup all_reduce", x, want, everywhere=False)
    return fails, digests


# The route a call of private arrays takes: by what each route took lately for calls like it, or by
# kind for the largest (the default: these tests' calls are mostly first of their kind, and those
# stage), or straight between processes from 64 KiB per buffer whenever the kernel allows
# (`AXONML_SHM_CMA=1`).
ROUTES = {"timed": None, "cross-memory": "1"}


def w_on_route(rank, n, ports, job, timeout, q, cma, work, *args):
    """`work` with `AXONML_SHM_CMA` set to `cma` on every rank (None: unset)."""
    if cma is not None:
        os.environ["AXONML_SHM_CMA"] = cma
    return work(rank, n, ports, job, timeout, q, *args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_dtype_and_op_matches_numpy_bitwise_on_every_rank(n, route):
    results = ok(run_world(n, w_on_route, ROUTES[route], w_collectives, limit=110))
    for rank, (fails, _) in enumerate(results):
        assert not fails, f"rank {rank}: {fails[:5]}"
    for rank, (_, digests) in enumerate(results):
        assert digests == results[0][1], f"rank {rank} differs from rank 0"


def w_collectives_with_rank_0_on(rank, n, ports, job, timeout, q, rank0):
    """As w_collectives, with rank 0's `AXONML_SHM_CMA` set to `rank0` (None: unset) and the others
    asking for cross-memory copies at every size."""
    if rank == 0 and rank0 is not None:
        os.environ["AXONML_SHM_CMA"] = rank0
    elif rank != 0:
        os.environ["AXONML_SHM_CMA"] = "1"
    return w_collectives(rank, n, ports, job, timeout, q)


# Rank 0 refusing cross-memory copies (as a sandbox would make it) makes every call stage; with rank 0
# on its timings, the others ask for every call of 64 KiB or more per buffer to cross (which route a
# call took is not visible from here: the Rust tests `a_timed_call_*` check the rule). Either way every
# rank must take the same route for each call and results stay exact.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank0", ["0", None], ids=["refusing", "timed"])
def test_ranks_choosing_routes_differently_agree_on_each_call_and_results_stay_exact(rank0):
    results = ok(run_world(2, w_collectives_with_rank_0_on, rank0, limit=110))
    for rank, (fails, _) in enumerate(results):
        assert not fails, f"rank {rank}: {fails[:5]}"
    assert results[1][1] == results[0][1], "rank 1 differs from rank 0"


def w_repeated(rank, n, ports, job, timeout, q, calls):
    """`calls` calls of each bulk collective at 256 KiB of float32 per buffer, new data each time:
    enough for the timed route choice to learn both routes and probe each again (`route_times.rs`)."""
    pg = connect(rank, n, ports[0], timeout)
    fails: list[str] = []
    digests: list[str] = []
    size = (256 << 10) // 4
    for call in range(calls):
        xs = [wide_values(r, call, size, np.float32) for r in range(n)]
        x = xs[rank].copy()
        pg.all_reduce(x)
        want = reduce_ref(xs, "SUM")
        digests.append(digest(x))
        if not same_bits(x, want):
            fails.append(f"all_reduce call {call}")
        root = call % n
        x = xs[rank].copy()
        pg.broadcast(x, root)
        if not same_bits(x, xs[root]):
            fails.append(f"broadcast call {call}")
        out = np.empty((n, size // n), np.float32)
        pg.all_gather(xs[rank][: size // n], out)
        if not same_bits(out, np.stack([v[: size // n] for v in xs])):
            fails.append(f"all_gather call {call}")
        out = np.empty(size // n, np.float32)
        pg.reduce_scatter(xs[rank], out)
        if not same_bits(out, reduce_ref(xs, "SUM")[rank * (size // n) : (rank + 1) * (size // n)]):
            fails.append(f"reduce_scatter call {call}")
    return fails, digests


# With a core per rank, calls of one kind and size switch routes while the choice learns (runs of 2
# staged, then 2 crossing, ...) and at every probe; each call must still be exact on every rank.
@pytest.mark.timeout(120)
def test_calls_that_switch_routes_while_learning_and_probing_stay_exact():
    results = ok(run_world(2, w_repeated, 40, limit=110))
    for rank, (fails, _) in enumerate(results):
        assert not fails, f"rank {rank}: {fails[:5]}"
    assert results[1][1] == results[0][1], "rank 1 differs from rank 0"


def w_two_groups(rank, n, ports, job, timeout, q):
    """Two groups over one backend, async on one and blocking on the other, in the same program order."""
    pg = connect(rank, n, ports[0], timeout)
    g2 = ProcessGroup(pg.backend())
    seen = []
    for i in range(100):
        a = np.full(4, 10.0 * (rank + 1) + i, np.float64)
        c = np.full(4, 1.0 * (rank + 1), np.float64)
        w = pg.all_reduce(a, async_op=True)
        g2.all_reduce(c)
        w.wait()
        seen.append((float(a[0]), float(c[0])))
    return seen == [(30.0 + 2 * i, 3.0) for i in range(100)]


@pytest.mark.timeout(90)
def test_two_groups_over_one_shm_backend_match_calls_in_program_order():
    assert ok(run_world(2, w_two_groups, timeout=30)) == [True, True]


def w_exchange(rank, n, ports, job, timeout, q, size):
    """isend then a blocking recv on both ranks, above the eager limit."""
    pg = connect(rank, n, ports[0], timeout)
    peer = 1 - rank
    x = np.arange(size, dtype=np.float32) + 1000 * rank
    y = np.zeros(size, np.float32)
    w = pg.send(x, peer, async_op=True)
    pg.recv(y, peer)
    w.wait()
    return bool(np.array_equal(y, np.arange(size, dtype=np.float32) + 1000 * peer))


@pytest.mark.timeout(90)
def test_the_isend_recv_exchange_completes_above_the_eager_limit():
    assert ok(run_world(2, w_exchange, 1 << 20, timeout=30)) == [True, True]


def w_two_tags(rank, n, ports, job, timeout, q):
    """Two isends above the eager limit with two tags, received in the other order."""
    pg = connect(rank, n, ports[0], timeout)
    size = 1 << 18
    if rank == 0:
        works = [pg.send(np.full(size, float(tag), np.float32), 1, tag, async_op=True) for tag in (1, 2)]
    else:
        bufs = {tag: np.zeros(size, np.float32) for tag in (2, 1)}
        works = [pg.recv(bufs[tag], 0, tag, async_op=True) for tag in (2, 1)]
    for w in works:
        w.wait()
    return rank == 0 or all(bool((bufs[t] == t).all()) for t in (1, 2))


@pytest.mark.timeout(90)
def test_isends_with_two_tags_received_in_the_other_order_complete_in_the_shm_world():
    assert ok(run_world(2, w_two_tags, timeout=30)) == [True, True]


def w_groups(rank, n, ports, job, timeout, q):
    """Create, use and drop a subgroup of every rank many times."""
    from axonml_distributed import World

    world = World(connect(rank, n, ports[0], timeout).backend())
    got = []
    for i in range(100):
        g = world.new_group([0, 1])
        x = np.full(70_000, rank + i, np.float32)  # past the one-shot size: the group's staging is used
        g.all_reduce(x)
        got.append(float(x[-1]))
        del g
    return got


@pytest.mark.timeout(120)
def test_creating_and_dropping_a_subgroup_100_times_works():
    res = ok(run_world(2, w_groups, timeout=20, limit=110))
    assert res[0] == res[1] == [float(2 * i + 1) for i in range(100)]


def at_offset(size: int, dtype, offset: int) -> np.ndarray:
    """An uninitialised array of `size` elements starting `offset` bytes past a page boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.empty(size * item + 2 * 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    return raw[start : start + size * item].view(dtype)


def w_staged_at_offsets(rank, n, ports, job, timeout, q, chunk_kib):
    """Every staged collective over many rounds, on arrays at page offsets that alias with naively
    placed staging (16 bytes past a page) or with its skewed placement (near 2048), against numpy."""
    os.environ["AXONML_SHM_CMA"] = "0"
    os.environ["AXONML_SHM_CHUNK_KIB"] = str(chunk_kib)
    pg = connect(rank, n, ports[0], timeout)
    fails = []
    size = 50_003
    for case, offset in enumerate([0, 16, 2040, 2056, 4088]):
        xs = [wide_values(r, case, size, np.float64) for r in range(n)]
        big = [wide_values(r, 100 + case, n * size, np.float64) for r in range(n)]

        def mine(values, offset=offset):
            a = at_offset(values.size, np.float64, offset)
            a[:] = values
            return a

        got = {}
        x = mine(xs[rank])
        pg.all_reduce(x)
        got["all_reduce"] = (x, reduce_ref(xs, "SUM"))
        x = mine(xs[rank])
        pg.reduce(x, 1)
        got["reduce"] = (x, reduce_ref(xs, "SUM") if rank == 1 else xs[rank])
        out = mine(np.zeros(size))
        pg.reduce_scatter(mine(big[rank]), out)
        got["reduce_scatter"] = (out, reduce_ref(big, "SUM")[rank * size : (rank + 1) * size])
        x = mine(xs[rank])
        pg.broadcast(x, n - 1)
        got["broadcast"] = (x, xs[n - 1])
        out = mine(np.zeros(n * size))
        pg.all_gather(mine(xs[rank]), out)
        got["all_gather"] = (out, np.concatenate(xs))
        out = mine(np.zeros(n * size))
        pg.gather(mine(xs[rank]), out if rank == 2 else None, 2)
        if rank == 2:
            got["gather"] = (out, np.concatenate(xs))
        out = mine(np.zeros(size))
        pg.scatter(mine(big[0]) if rank == 0 else None, out, 0)
        got["scatter"] = (out, big[0][rank * size : (rank + 1) * size])
        for name, (have, want) in got.items():
            if not same_bits(have, want):
                fails.append(f"{name} at offset {offset}")
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk_kib", [64, 1024])
def test_staged_collectives_are_exact_at_any_page_offset(chunk_kib):
    # 3 ranks: the per-owner regions are not whole pages. 64 KiB rounds cut each call into many, and
    # their per-owner regions (21 KiB) are too small to place pieces in: both ways are run.
    assert ok(run_world(3, w_staged_at_offsets, chunk_kib, timeout=30, limit=110)) == [[], [], []]


def w_shared_copies(rank, n, ports, job, timeout, q):
    """Broadcast from every root, all_gather and gather, on private arrays
    (copied between processes, or staged) and segment arrays, at sizes around the members' shares (one owned
    slice, several tiles, past the streaming limit), private arrays 8 bytes past a page, against numpy."""
    pg = connect(rank, n, ports[0], timeout)
    fails = []
    # float64 elements: 1025 (8 KiB and one element: uneven shares), 2^17 + 3 (1 MiB and 3: many
    # tiles), 7 * 2^17 + 5 (7 MiB and 5: streamed).
    for case, size in enumerate([1025, (1 << 17) + 3, (7 << 17) + 5]):
        xs = [wide_values(r, case, size, np.float64) for r in range(n)]
        for kind in ("private", "segment"):

            def mine(values, kind=kind):
                a = (
                    pg.empty(values.size, np.float64)
                    if kind == "segment"
                    else at_offset(values.size, np.float64, 8)
                )
                a[:] = values
                return a

            for root in range(n):
                x = mine(xs[rank])
                pg.broadcast(x, root)
                if not same_bits(x, xs[root]):
                    fails.append(f"{kind} broadcast {size} from {root}")
            out = mine(np.zeros(n * size))
            pg.all_gather(mine(xs[rank]), out)
            if not same_bits(out, np.concatenate(xs)):
                fails.append(f"{kind} all_gather {size}")
            root = (case + 1) % n
            out = mine(np.zeros(n * size))
            pg.gather(mine(xs[rank]), out if rank == root else None, root)
            if rank == root and not same_bits(out, np.concatenate(xs)):
                fails.append(f"{kind} gather {size} to {root}")
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ROUTES)
def test_shared_copies_from_every_root_are_exact_on_private_and_segment_arrays(route):
    # 3 ranks: shares that are not equal; roots 0..2 each write a different slice. On 2 cores these
    # stage by size (ranks outnumber cores), streaming the largest outputs.
    results = run_world(3, w_on_route, ROUTES[route], w_shared_copies, timeout=30, limit=110)
    assert ok(results) == [[], [], []]
