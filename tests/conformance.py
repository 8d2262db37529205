"""The conformance suite: what every world's process group must do alike (threads, shm, MPI), written once
against the group API. Each check runs on every rank of a world and returns digests of the results that
must be bitwise identical on every rank; the runner (tests/test_conformance.py) compares them across
ranks through its own channel, never through the group under test. Inputs are `small_values`, exact in
any order of reduction, so the MPI world (whose reduction order is MPI's) meets the same bitwise bar.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

import axonml_distributed as ad
from axonml_distributed import CollectiveMismatchError, ReduceOp
from axonml_distributed.codec import encode

try:
    from ml_dtypes import bfloat16
except ImportError:  # numpy arrays of bfloat16 need ml_dtypes
    bfloat16 = None
from reference import (
    DTYPES,
    FLOATS,
    NUMBERS,
    OP_NAMES,
    all_inputs,
    digest,
    expect_same,
    reduce_ref,
    small_values,
)


def dtypes(pg: Any) -> list[type]:
    """The dtypes the group's world carries: all of the core's, but bool over MPI."""
    return NUMBERS if pg.backend().name() == "mpi" else DTYPES


def sizes(n: int) -> list[int]:
    return [0, 1, 7, 1023, n * 4096 + 3]


def raises(exc_type: type[BaseException], fn: Callable[..., object], *args: object, match: str = "") -> str:
    """Run fn and require exc_type whose message contains `match`; return the message."""
    try:
        fn(*args)
    except exc_type as exc:
        if match not in str(exc):
            raise AssertionError(f"{exc_type.__name__} without {match!r}: {exc}") from exc
        return str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def started(work: Any) -> Any:
    """The work of an operation issued with async_op=True."""
    assert work is not None
    return work


def check_reductions(pg: Any) -> list[str]:
    """all_reduce, reduce to every destination and reduce_scatter: every dtype, op and odd size."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for dtype in DTYPES:
        for op in OP_NAMES:
            if op == "AVERAGE" and dtype not in FLOATS:
                continue
            for count in sizes(n):
                case = f"{np.dtype(dtype).name}-{op}-{count}"
                inputs = all_inputs(n, case, (count,), dtype, op)
                expected = reduce_ref(inputs, op)

                buf = inputs[me].copy()
                pg.all_reduce(buf, getattr(ReduceOp, op))
                expect_same(buf, expected, f"all_reduce {case}")

                for dst in pg.ranks():
                    buf = inputs[me].copy()
                    pg.reduce(buf, dst, getattr(ReduceOp, op))
                    # Off the destination the buffer is left as it was.
                    want = expected if pg.rank() == dst else inputs[me]
                    expect_same(buf, want, f"reduce {case} dst {dst}")

                chunks = all_inputs(n, case + "-rs", (n, count), dtype, op)
                recv = np.empty(count, dtype)
                pg.reduce_scatter(chunks[me], recv, getattr(ReduceOp, op))
                expect_same(recv, reduce_ref(chunks, op)[me], f"reduce_scatter {case}")
    return []


def check_movers(pg: Any) -> list[str]:
    """broadcast from every source, all_gather, gather to and scatter from every root, and a ring of
    send/recv: every dtype and odd size, float16 bit patterns (NaN payloads, signed zeros) kept."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for dtype in DTYPES:
        for count in sizes(n):
            case = f"{np.dtype(dtype).name}-{count}"
            inputs = all_inputs(n, case, (count,), dtype)
            if dtype == np.float16:
                rng = np.random.default_rng([count, 7])
                inputs = rng.integers(0, 1 << 16, size=(n, count), dtype=np.uint16).view(np.float16)
            for src in pg.ranks():
                buf = inputs[me].copy()
                pg.broadcast(buf, src)
                expect_same(buf, inputs[pg.group_rank(src)], f"broadcast {case} src {src}")
            buf = inputs[me].copy()
            pg.broadcast(buf)  # src None = first rank of the group
            expect_same(buf, inputs[0], f"broadcast {case} default src")

            recv = np.empty((n, count), dtype)
            pg.all_gather(inputs[me], recv)
            expect_same(recv, inputs, f"all_gather {case}")

            for dst in pg.ranks():
                into = np.empty((n, count), dtype) if pg.rank() == dst else None
                pg.gather(inputs[me], into, dst)
                if into is not None:
                    expect_same(into, inputs, f"gather {case} dst {dst}")
            for src in pg.ranks():
                out = np.empty(count, dtype)
                pg.scatter(inputs if pg.rank() == src else None, out, src)
                expect_same(out, inputs[me], f"scatter {case} src {src}")

            # A ring: each rank sends to the next and receives from the previous, tag per case.
            ring = pg.ranks()
            nxt, prev = ring[(me + 1) % n], ring[(me - 1) % n]
            if n > 1:
                tag = 100 + count % 1000
                sent = started(pg.send(inputs[me], nxt, tag, async_op=True))
                got = np.empty(count, dtype)
                pg.recv(got, prev, tag)
                sent.wait()
                expect_same(got, inputs[(me - 1) % n], f"send/recv {case}")
    pg.barrier()
    return []


def any_source_payload(src: int, tag: int, i: int, count: int) -> np.ndarray:
    """A message of `check_any_source`: its sender, tag and number first, then a filler of `count` in all."""
    out = np.arange(count, dtype=np.int64) * 7 + src
    out[:3] = (src, tag, i)
    return out


def check_any_source(pg: Any) -> list[str]:
    """Receives from any source: the group's first rank takes from any sender K messages of each of two
    small tags (received one tag after the other, so the first tag's filter skips the second's) and one
    large one, half of them with async_op. It gets every message once, from its sender, in order per
    (sender, tag)."""
    ranks, me = pg.ranks(), pg.rank()
    root, k, small, large = ranks[0], 3, 5, 3 * 4096 + 5  # large: past one shm cell and the eager limit
    plan = [(11, small, k), (12, small, k), (13, large, 1)]
    if me != root:
        works = [
            started(pg.send(any_source_payload(me, tag, i, count), root, tag, async_op=True))
            for i in range(k)
            for tag, count, many in plan
            if i < many
        ]
        for w in works:
            w.wait()
    else:
        for tag, count, many in [plan[1], plan[2], plan[0]]:
            got: dict[int, list[np.ndarray]] = {}
            for j in range(many * (len(ranks) - 1)):
                buf = np.full(count, -1, np.int64)
                if j % 2:
                    work = started(pg.recv_any(buf, tag, async_op=True))
                    src = work.wait()
                    assert src == work.source_rank(), (src, work.source_rank())
                else:
                    src = pg.recv_any(buf, tag)
                got.setdefault(src, []).append(buf)
            assert sorted(got) == ranks[1:], f"tag {tag}: senders {sorted(got)}, expected {ranks[1:]}"
            for src, bufs in got.items():
                want = [any_source_payload(src, tag, i, count) for i in range(many)]
                expect_same(np.stack(bufs), np.stack(want), f"recv_any tag {tag} from rank {src}")
    pg.barrier()
    return []


def check_tensor_variants(pg: Any) -> list[str]:
    """The returning variants: new arrays, inputs untouched, op names read as ReduceOp members."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for dtype in (np.float16, np.float32, np.int32):
        inputs = all_inputs(n, "tensor", (2 * n, 3), dtype)
        mine = inputs[me]
        before = mine.copy()
        expect_same(pg.all_reduce_tensor(mine), reduce_ref(inputs, "SUM"), "all_reduce_tensor")
        # op None is SUM, and names work case-insensitively ("mean" = AVERAGE).
        for op, ref in ((None, "SUM"), ("max", "MAX"), ("Min", "MIN"), ("mean", "AVERAGE")):
            if ref != "AVERAGE" or dtype in FLOATS:
                got = pg.all_reduce_tensor(mine, op)
                expect_same(got, reduce_ref(inputs, ref), f"all_reduce_tensor op {op!r}")
        expect_same(mine, before, "all_reduce_tensor leaves its input alone")
        expect_same(pg.broadcast_tensor(mine, pg.ranks()[-1]), inputs[-1], "broadcast_tensor")
        expect_same(pg.all_gather_tensor(mine), inputs, "all_gather_tensor")
        expected = reduce_ref(inputs, "MAX").reshape(n, 2, 3)[me]
        expect_same(pg.reduce_scatter_tensor(mine, ReduceOp.MAX), expected, "reduce_scatter_tensor")
        # Non-contiguous input is fine for the returning variants: they copy.
        strided = pg.all_reduce_tensor(mine[:, ::2])
        expect_same(strided, reduce_ref(inputs, "SUM")[:, ::2], "strided all_reduce_tensor")
        if n > 1:
            ring = pg.ranks()
            # Contiguous: the native worlds refuse a strided send_tensor, MPI copies it (mpi_jobs test that).
            work = started(pg.send_tensor(mine.T.copy(), ring[(me + 1) % n], 5, async_op=True))
            got = pg.recv_tensor((3, 2 * n), dtype, ring[(me - 1) % n], 5)
            work.wait()
            expect_same(got, inputs[(me - 1) % n].T, "send_tensor/recv_tensor")
    expect_same(np.asarray(pg.empty((2, 3), np.float32).shape), np.asarray((2, 3)), "empty")
    return []


def check_random_floats(pg: Any) -> list[str]:
    """Arbitrary floats: close to numpy's sum, and bitwise identical on every rank (the digests)."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    digests = []
    for dtype, rtol in ((np.float16, 2e-3), (np.float32, 1e-5), (np.float64, 1e-12)):
        for op in ("SUM", "AVERAGE"):
            rng = [np.random.default_rng([r, 99]) for r in range(n)]
            inputs = np.stack([g.standard_normal(100_003).astype(dtype) for g in rng])
            buf = inputs[me].copy()
            pg.all_reduce(buf, getattr(ReduceOp, op))
            ref = inputs.astype(np.float64).sum(axis=0) / (n if op == "AVERAGE" else 1)
            np.testing.assert_allclose(buf.astype(np.float64), ref, rtol=rtol, atol=rtol * n)
            digests.append(f"all_reduce {op} {np.dtype(dtype).name} {digest(buf)}")
    return digests


def check_offset_views(pg: Any) -> list[str]:
    """A view that starts inside its array (one element in); bytes outside it untouched. (Buffers that
    are not aligned for their dtype only MPI takes: the native worlds refuse them, see mpi_jobs.)"""
    n, me = pg.size(), pg.group_rank(pg.rank())
    count = 1023
    inputs = all_inputs(n, "offset", (count + 1,), np.float64)
    base = inputs[me].copy()
    view = base[1:]
    pg.all_reduce(view)
    expect_same(view, reduce_ref(inputs[:, 1:], "SUM"), "offset view all_reduce")
    expect_same(base[:1], inputs[me][:1], "the byte before the view")
    return []


def check_mismatch_message(pg: Any) -> list[str]:
    """Calls that differ (here the count, on every rank) fail every rank, before any byte moves, with the
    core's description: the same message on every rank and, tests/test_conformance.py checks, in every
    world."""
    buf = np.ones(1000 + pg.group_rank(pg.rank()), np.float32)
    message = raises(CollectiveMismatchError, pg.all_reduce, buf)
    expect_same(buf, np.ones_like(buf), "the buffer of a mismatched call")
    return [message]


def check_argument_mistakes(pg: Any) -> list[str]:
    """Every kind of argument mistake, made alike on every rank: each raises the core's exception with
    the core's message (tests/test_conformance.py compares them across worlds). A native world is
    aborted by the first one, but argument checks come before that is looked at, so each later mistake
    still raises its own error; over MPI no data call is made."""
    n, me = pg.size(), pg.rank()
    outside = pg.world_size()  # a rank no group has
    buf, chunk = np.zeros(4, np.float32), np.zeros(3, np.float32)
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    strided = np.zeros(8, np.float32)[::2]
    mistakes: list[tuple[str, Callable[[], object]]] = [
        ("bad root", lambda: pg.broadcast(buf, outside)),
        ("bad dst", lambda: pg.reduce(buf, outside)),
        ("peer not a member", lambda: pg.send(buf, outside)),
        ("send to self", lambda: pg.send(buf, me)),
        ("recv from self", lambda: pg.recv(buf, me)),
        ("wrong size", lambda: pg.all_gather(buf, np.zeros(n * 4 + 1, np.float32))),
        ("indivisible", lambda: pg.reduce_scatter(np.zeros(n * 3 + 1, np.float32), chunk)),
        ("wrong dtype", lambda: pg.all_gather(buf, np.zeros(n * 4, np.float64))),
        ("read-only", lambda: pg.all_reduce(read_only)),
        ("non-contiguous", lambda: pg.all_reduce(strided)),
        ("unsupported dtype", lambda: pg.all_reduce(np.zeros(4, np.longdouble))),
        ("AVERAGE of integers", lambda: pg.all_reduce(np.zeros(4, np.int32), ReduceOp.AVERAGE)),
        ("root without recv", lambda: pg.gather(buf, None, me)),
    ]
    messages = []
    for name, make in mistakes:
        try:
            make()
        except (TypeError, ValueError) as exc:
            # The same on every rank: this rank's number written as "me".
            text = str(exc).replace(f"rank {me} ", "rank <me> ")
            messages.append(f"{name}: {type(exc).__name__}: {text}")
        else:
            raise AssertionError(f"{name}: no error")
    return messages


# --- dtypes beyond the first nine, bitwise ops, Horovod's scaling, out= (issue 13) --------------------

BF16 = [] if bfloat16 is None else [bfloat16]
NEW_DTYPES = [np.int16, np.uint16, np.uint32, np.uint64, np.complex64, np.complex128, *BF16]
SCALABLE = [np.float16, np.float32, np.float64, np.complex64, np.complex128, *BF16]
BITWISE = ["BAND", "BOR", "BXOR"]


def allowed(op: str, dtype: Any) -> bool:
    """The documented op/dtype table: real floats all but the bitwise ops, complex SUM, PRODUCT and
    AVERAGE, integers and bool all but AVERAGE."""
    kind = np.dtype(dtype).kind
    if kind in "fV":  # "V": ml_dtypes' bfloat16
        return op not in BITWISE
    if kind == "c":
        return op in ("SUM", "PRODUCT", "AVERAGE")
    return op != "AVERAGE"


def expect_reduced(pg: Any, op: str, got: Any, expected: Any, what: str) -> None:
    """`expect_same`, but over MPI a complex PRODUCT's zero parts may differ in sign: MPI multiplies in
    an order of its own, and the sign of a zero part depends on it (every other bit does not, for
    these inputs)."""
    if op == "PRODUCT" and np.asarray(got).dtype.kind == "c" and pg.backend().name() == "mpi":
        got, expected = np.asarray(got) + 0, np.asarray(expected) + 0
    expect_same(got, expected, what)


def check_new_dtypes_and_ops(pg: Any) -> list[str]:
    """The new dtypes under every op, and the bitwise ops on the older integer dtypes and bool:
    all_reduce, reduce and reduce_scatter against the reference where the table allows the pair, a
    TypeError before anything moves where it does not; broadcast and all_gather carry the new dtypes."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    ops = {d: OP_NAMES + BITWISE for d in NEW_DTYPES}
    ops.update({d: BITWISE for d in (np.bool_, np.int8, np.uint8, np.int32, np.int64, np.float32)})
    for dtype, names in ops.items():
        for op in filter(lambda op: allowed(op, dtype), names):
            for count in (0, 1, 1023, n * 4096 + 3):
                case = f"{np.dtype(dtype).name}-{op}-{count}"
                inputs = all_inputs(n, case, (count,), dtype, op)
                expected = reduce_ref(inputs, op)
                buf = inputs[me].copy()
                pg.all_reduce(buf, getattr(ReduceOp, op))
                expect_reduced(pg, op, buf, expected, f"all_reduce {case}")
                dst = pg.ranks()[-1]
                buf = inputs[me].copy()
                pg.reduce(buf, dst, getattr(ReduceOp, op))
                expect_reduced(pg, op, buf, expected if pg.rank() == dst else inputs[me], f"reduce {case}")
                chunks = all_inputs(n, case + "-rs", (n, count), dtype, op)
                recv = np.empty(count, dtype)
                pg.reduce_scatter(chunks[me], recv, getattr(ReduceOp, op))
                expect_reduced(pg, op, recv, reduce_ref(chunks, op)[me], f"reduce_scatter {case}")
    for dtype in NEW_DTYPES + [np.bool_]:
        inputs = all_inputs(n, "movers", (1027,), dtype)
        buf = inputs[me].copy()
        pg.broadcast(buf, pg.ranks()[-1])
        expect_same(buf, inputs[-1], f"broadcast {np.dtype(dtype).name}")
        recv = np.empty((n, 1027), dtype)
        pg.all_gather(inputs[me], recv)
        expect_same(recv, inputs, f"all_gather {np.dtype(dtype).name}")
    return []


def check_scaling(pg: Any) -> list[str]:
    """prescale_factor and postscale_factor on all_reduce, reduce and all_reduce_tensor (powers of two,
    so exact in any order of reduction), refused on integers; factors that differ between ranks are a
    mismatch on every rank, before anything moves (last: it ends the native worlds)."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    pre, post = 0.5, 4.0
    for dtype in SCALABLE:
        for op in ("SUM", "AVERAGE", "PRODUCT", "MAX"):
            if not allowed(op, dtype):
                continue
            for count in (1, 1023, n * 4096 + 3):
                case = f"scaled-{np.dtype(dtype).name}-{op}-{count}"
                inputs = all_inputs(n, case, (count,), dtype, op)
                expected = reduce_ref(inputs, op, pre, post)
                factors = {"prescale_factor": pre, "postscale_factor": post}
                buf = inputs[me].copy()
                pg.all_reduce(buf, getattr(ReduceOp, op), **factors)
                expect_reduced(pg, op, buf, expected, f"all_reduce {case}")
                dst = pg.ranks()[0]
                buf = inputs[me].copy()
                pg.reduce(buf, dst, getattr(ReduceOp, op), **factors)
                expect_reduced(pg, op, buf, expected if pg.rank() == dst else inputs[me], f"reduce {case}")
                got = pg.all_reduce_tensor(inputs[me], getattr(ReduceOp, op), **factors)
                expect_reduced(pg, op, got, expected, f"all_reduce_tensor {case}")
    buf = np.ones(8, np.float32)
    if n == 1:
        return []
    message = raises(CollectiveMismatchError, lambda: pg.all_reduce(buf, postscale_factor=1.0 + me))
    expect_same(buf, np.ones_like(buf), "the buffer of a mismatched scaling")
    return [message]


def check_out_of_place(pg: Any) -> list[str]:
    """out=: the input is only read (read-only here) and the result lands in out, for all_reduce,
    reduce (only the destination's out written) and the returning variants, which then return out; on
    ordinary arrays and on the group's own (`pg.empty`: segment arrays in the shm world), mixed."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    makers = {"ordinary": np.empty, "group": pg.empty}
    for (sname, make_in), (oname, make_out) in [(a, b) for a in makers.items() for b in makers.items()]:
        for dtype in (np.float32, np.complex128, np.int64):
            # Past one-shot, and (float32 only, to keep the suite short) several pipeline rounds.
            for count in (1, n * 4096 + 3) + ((300_003,) if dtype == np.float32 else ()):
                case = f"out-{sname}-{oname}-{np.dtype(dtype).name}-{count}"
                inputs = all_inputs(n, case, (count,), dtype)
                send = make_in(count, dtype)
                send[...] = inputs[me]
                send.flags.writeable = False
                out = make_out(count, dtype)
                pg.all_reduce(send, out=out)
                expect_same(out, reduce_ref(inputs, "SUM"), f"all_reduce {case}")
                if dtype != np.int64:
                    pg.all_reduce(send, ReduceOp.AVERAGE, out=out, prescale_factor=2.0)
                    expect_same(out, reduce_ref(inputs, "AVERAGE", 2.0), f"scaled all_reduce {case}")
                for dst in (pg.ranks()[0], pg.ranks()[-1]):
                    out = make_out(count, dtype)
                    out[...] = 7
                    pg.reduce(send, dst, ReduceOp.MAX if dtype != np.complex128 else None, out=out)
                    op = "MAX" if dtype != np.complex128 else "SUM"
                    want = reduce_ref(inputs, op) if pg.rank() == dst else np.full(count, 7, dtype)
                    expect_same(out, want, f"reduce {case} dst {dst}")
                expect_same(send, inputs[me], f"the input of {case}")
                out = make_out(count, dtype)
                if pg.all_reduce_tensor(send, out=out) is not out:
                    raise AssertionError("all_reduce_tensor(out=) returned another array")
                expect_same(out, reduce_ref(inputs, "SUM"), f"all_reduce_tensor {case}")
                gathered = make_out((n, count), dtype)
                if pg.all_gather_tensor(send, out=gathered) is not gathered:
                    raise AssertionError("all_gather_tensor(out=) returned another array")
                expect_same(gathered, inputs, f"all_gather_tensor {case}")
                chunks = all_inputs(n, case + "-rs", (n, count), dtype)
                mine = make_out(count, dtype)
                if pg.reduce_scatter_tensor(chunks[me], out=mine) is not mine:
                    raise AssertionError("reduce_scatter_tensor(out=) returned another array")
                expect_same(mine, reduce_ref(chunks, "SUM")[me], f"reduce_scatter_tensor {case}")
    return []


def check_new_mistakes(pg: Any) -> list[str]:
    """The op/dtype pairs the table refuses, factors on integers, and out= buffers that do not fit: a
    TypeError or ValueError on every rank, the buffers untouched, the core's message in every world."""
    n, me = pg.size(), pg.rank()
    pairs = [(d, op) for d in [*NEW_DTYPES, np.bool_, np.float32] for op in OP_NAMES + BITWISE]
    messages = []
    for dtype, op in filter(lambda p: not allowed(p[1], p[0]), pairs):
        buf = all_inputs(n, "refused", (5,), dtype)[me % n]
        before = buf.copy()
        messages.append(raises(TypeError, pg.all_reduce, buf, getattr(ReduceOp, op), match="not defined for"))
        expect_same(buf, before, f"refused {op} on {np.dtype(dtype).name}")
    ints = np.ones(4, np.int32)
    mistakes: list[tuple[type[BaseException], Callable[[], object]]] = [
        (TypeError, lambda: pg.all_reduce(ints, prescale_factor=2.0)),
        (TypeError, lambda: pg.reduce(ints, me, postscale_factor=0.5)),
        (ValueError, lambda: pg.all_reduce(np.ones(4), out=np.empty(3))),
        (ValueError, lambda: pg.all_reduce(np.ones(4), out=np.empty(4, np.float32))),
        (ValueError, lambda: pg.reduce(np.ones(4), me, out=np.empty(5))),
        (ValueError, lambda: pg.all_gather_tensor(np.ones(4), out=np.empty(4 * n + 1))),
    ]
    for exc_type, make in mistakes:
        messages.append(
            f"{exc_type.__name__}: " + raises(exc_type, make).replace(f"rank {me} ", "rank <me> ")
        )
    return messages


# Issue 26's three refused reductions, and one more of every other collective that takes an op (in and
# out of place, queued too): (collective, dtype, op, elements per member part).
REFUSED = [
    ("reduce_scatter", np.complex128, "MAX", 3),
    ("reduce", np.float16, "BAND", 8),
    ("reduce_scatter_v", np.float32, "BAND", 3),
    ("all_reduce", np.complex64, "MIN", 4096 * 4 + 3),
    ("all_reduce out=", np.float64, "BXOR", 7),
    ("reduce out=", np.int32, "AVERAGE", 5),
    ("all_reduce async", np.float16, "BOR", 1023),
    ("reduce_scatter", np.float32, "BXOR", 4096),
]


def refused_once(pg: Any, kind: str, dtype: Any, op: str, count: int, case: str) -> str:
    """Call `kind` with `op`, which its dtype does not take: a TypeError, no buffer changed; then the same
    call with SUM gives the reference result. Returns the TypeError's message."""
    n, me, root = pg.size(), pg.group_rank(pg.rank()), pg.ranks()[-1]
    inputs = all_inputs(n, case, (n * count,), dtype)
    reduced, mine = reduce_ref(inputs, "SUM"), inputs[me].copy()
    part = np.split(reduced, n)[me]
    recv = np.zeros(count if kind.startswith("reduce_scatter") else n * count, dtype)
    at_root = pg.rank() == root
    # The call, its buffers, and what they hold after the same call with SUM.
    calls: dict[str, tuple[Callable[[Any], object], list[np.ndarray], list[np.ndarray]]] = {
        "reduce_scatter": (lambda op: pg.reduce_scatter(mine, recv, op), [mine, recv], [inputs[me], part]),
        "reduce": (lambda op: pg.reduce(mine, root, op), [mine], [reduced if at_root else inputs[me]]),
        "reduce_scatter_v": (
            lambda op: pg.reduce_scatter_v(mine, recv, [count] * n, op),
            [mine, recv],
            [inputs[me], part],
        ),
        "all_reduce": (lambda op: pg.all_reduce(mine, op), [mine], [reduced]),
        "all_reduce out=": (
            lambda op: pg.all_reduce(mine, op, out=recv),
            [mine, recv],
            [inputs[me], reduced],
        ),
        "reduce out=": (
            lambda op: pg.reduce(mine, root, op, out=recv),
            [mine, recv],
            [inputs[me], reduced if at_root else np.zeros_like(recv)],
        ),
        "all_reduce async": (
            lambda op: started(pg.all_reduce(mine, op, async_op=True)).wait(),
            [mine],
            [reduced],
        ),
    }
    call, bufs, summed = calls[kind]
    before = [b.copy() for b in bufs]
    message = raises(TypeError, call, getattr(ReduceOp, op), match="is not defined for")
    for b, was in zip(bufs, before, strict=True):
        expect_same(b, was, f"{case}: a buffer of the refused call")
    call(ReduceOp.SUM)
    for b, want in zip(bufs, summed, strict=True):
        expect_same(b, want, f"{case}: the same call with SUM after the refusal")
    return message


def check_refused_reductions(pg: Any) -> list[str]:
    """A reduction the op/dtype table refuses, asked by every rank alike (`REFUSED`): a TypeError on every
    rank, nothing moved, and the group goes on. Several rounds, as a refusal that ended the world only at
    times would show."""
    messages = []
    for trial in range(5):
        for kind, dtype, op, count in REFUSED:
            case = f"{kind} {op} of {np.dtype(dtype).name}"
            message = refused_once(pg, kind, dtype, op, count, f"{case}, round {trial}")
            if trial == 0:
                messages.append(f"{case}: {message}")
    return messages


# --- all_to_all and the collectives with per-member sizes ---------------------------------------------


def placed(pg: Any, arr: np.ndarray, segment: bool) -> np.ndarray:
    """`arr`, or a copy in the group's own memory (`pg.empty`: a segment array in the shm world)."""
    if not segment:
        return arr.copy()
    out = pg.empty(arr.shape, arr.dtype)
    out[...] = arr
    return out


def split_matrix(n: int, case: int) -> np.ndarray:
    """rows[j][i]: how many rows member j sends member i (zeros included, never all zero)."""
    return np.array([[(3 * j + 5 * i + case) % 4 for i in range(n)] for j in range(n)]) + (case == 0)


def check_all_to_all(pg: Any) -> list[str]:
    """all_to_all (equal parts) and all_to_all_single (equal and uneven splits, 1-D and 2-D), every dtype
    and odd size, ordinary and `pg.empty` arrays, against numpy's own slicing."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for segment in (False, True):
        for dtype in dtypes(pg):
            for count in sizes(n):
                case = f"a2a-{np.dtype(dtype).name}-{count}-{segment}"
                inputs = all_inputs(n, case, (n * count,), dtype)
                recv = placed(pg, np.zeros(n * count, dtype), segment)
                pg.all_to_all(placed(pg, inputs[me], segment), recv)
                expected = np.concatenate([inputs[j].reshape(n, count)[me] for j in range(n)])
                expect_same(recv, expected, f"all_to_all {case}")
                recv = placed(pg, np.zeros(n * count, dtype), segment)
                pg.all_to_all_single(placed(pg, inputs[me], segment), recv)
                expect_same(recv, expected, f"all_to_all_single equal {case}")
        # Rows of one element (1-D: splits count elements), of three, and large 1-D pieces (the last
        # ones longer than a pipeline round of the shm world: several rounds).
        for case, width, scale in ((0, 0, 1), (1, 3, 1), (2, 0, 2579), (3, 0, 100_003)):
            rows = split_matrix(n, case) * scale

            def rows_of(j: int, rows: np.ndarray = rows, width: int = width, case: int = case) -> np.ndarray:
                shape = (int(rows[j].sum()), width) if width else (int(rows[j].sum()),)
                return small_values(j, f"a2av-{case}", shape, np.float32)

            at = [np.cumsum([0, *rows[j]]) for j in range(n)]
            expected = np.concatenate([rows_of(j)[at[j][me] : at[j][me + 1]] for j in range(n)])
            recv = placed(pg, np.zeros_like(expected), segment)
            outs, ins = [int(r) for r in rows[:, me]], [int(r) for r in rows[me]]
            work = pg.all_to_all_single(placed(pg, rows_of(me), segment), recv, outs, ins, async_op=True)
            started(work).wait()
            expect_same(recv, expected, f"all_to_all_single splits {case} {segment}")
    return []


def check_uneven(pg: Any) -> list[str]:
    """all_gather_v, gather_v, scatter_v and reduce_scatter_v: uneven counts (zeros included), every dtype
    and op, ordinary and `pg.empty` arrays, against numpy's concatenation and the reference reduce."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    for segment in (False, True):
        # The last case's pieces are longer than a pipeline round of the shm world: several rounds.
        for case, scale in ((0, 1), (1, 1), (2, 2500), (3, 300_007)):
            counts = [int(c) for c in split_matrix(n, case)[0] * scale]
            total = sum(counts)
            at = np.cumsum([0, *counts])
            for dtype in dtypes(pg) if case < 3 else [np.float32]:
                name = f"v-{case}-{np.dtype(dtype).name}-{segment}"
                inputs = all_inputs(n, name, (total,), dtype)
                pieces = [inputs[j][: counts[j]] for j in range(n)]
                recv = placed(pg, np.zeros(total, dtype), segment)
                pg.all_gather_v(placed(pg, pieces[me], segment), recv, counts)
                expect_same(recv, np.concatenate(pieces), f"all_gather_v {name}")
                for root in pg.ranks():
                    into = placed(pg, np.zeros(total, dtype), segment) if pg.rank() == root else None
                    pg.gather_v(placed(pg, pieces[me], segment), into, counts, root)
                    if into is not None:
                        expect_same(into, np.concatenate(pieces), f"gather_v {name} dst {root}")
                    out = placed(pg, np.zeros(counts[me], dtype), segment)
                    whole = inputs[pg.group_rank(root)]
                    pg.scatter_v(placed(pg, whole, segment) if pg.rank() == root else None, out, counts, root)
                    expect_same(out, whole[at[me] : at[me + 1]], f"scatter_v {name} src {root}")
                for op in OP_NAMES if case < 3 else ["SUM"]:
                    if op == "AVERAGE" and dtype not in FLOATS:
                        continue
                    values = all_inputs(n, f"{name}-{op}", (total,), dtype, op)
                    out = placed(pg, np.zeros(counts[me], dtype), segment)
                    pg.reduce_scatter_v(placed(pg, values[me], segment), out, counts, getattr(ReduceOp, op))
                    want = reduce_ref(values, op)[at[me] : at[me + 1]]
                    expect_same(out, want, f"reduce_scatter_v {name} {op}")
    return []


def check_split_mismatch(pg: Any) -> list[str]:
    """Split sizes that disagree fail every rank before any byte moves, naming the ranks: the same
    message on every rank and in every world. Every rank expects one element more from the next rank
    than that rank sends it."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    send, recv = np.ones(n, np.float32), np.ones(n + 1, np.float32)
    outs = [2 if i == (me + 1) % n else 1 for i in range(n)]
    message = raises(CollectiveMismatchError, pg.all_to_all_single, send, recv, outs, [1] * n)
    expect_same(recv, np.ones(n + 1, np.float32), "the buffer of a mismatched all_to_all_single")
    return [message]


def check_pairwise_mistakes(pg: Any) -> list[str]:
    """Argument mistakes of all_to_all and the collectives with per-member sizes, made alike on every
    rank: the core's exception and message in every world (as `check_argument_mistakes`)."""
    n, me = pg.size(), pg.rank()
    f32 = np.zeros
    mistakes: list[tuple[str, Callable[[], object]]] = [
        ("a2a indivisible", lambda: pg.all_to_all(f32(n * 3 + 1, np.float32), f32(n * 3 + 1, np.float32))),
        ("a2a recv size", lambda: pg.all_to_all(f32(n * 3, np.float32), f32(n * 3 + 1, np.float32))),
        ("a2a dtype", lambda: pg.all_to_all(f32(n, np.float32), f32(n, np.float64))),
        ("a2av rows", lambda: pg.all_to_all_single(f32((n + 1, 2), np.float32), f32((n + 1, 2), np.float32))),
        ("a2av entries", lambda: pg.all_to_all_single(f32(n, np.float32), f32(n, np.float32), [n], [n])),
        (
            "a2av sum",
            lambda: pg.all_to_all_single(f32(n, np.float32), f32(n, np.float32), [1] * n, [2] * n),
        ),
        ("agv entries", lambda: pg.all_gather_v(f32(1, np.float32), f32(1, np.float32), [1])),
        ("agv send", lambda: pg.all_gather_v(f32(2, np.float32), f32(n, np.float32), [1] * n)),
        ("gv root recv", lambda: pg.gather_v(f32(1, np.float32), None, [1] * n, me)),
        ("sv root send", lambda: pg.scatter_v(None, f32(1, np.float32), [1] * n, me)),
        (
            "rsv AVERAGE of integers",
            lambda: pg.reduce_scatter_v(f32(n, np.int32), f32(1, np.int32), [1] * n, ReduceOp.AVERAGE),
        ),
        ("rsv recv", lambda: pg.reduce_scatter_v(f32(n, np.float32), f32(2, np.float32), [1] * n)),
    ]
    messages = []
    for name, make in mistakes:
        try:
            make()
        except (TypeError, ValueError) as exc:
            text = str(exc).replace(f"rank {me} ", "rank <me> ")
            messages.append(f"{name}: {type(exc).__name__}: {text}")
        else:
            raise AssertionError(f"{name}: no error")
    return messages


def check_counts_mismatch(pg: Any) -> list[str]:
    """Counts with the same sum that differ between ranks (rank 0 moves one element from the last
    member to itself): a mismatch naming them, on every rank, before any byte moves."""
    n, me = pg.size(), pg.group_rank(pg.rank())
    counts = [2, *[1] * (n - 2), 0] if me == 0 else [1] * n
    recv = np.ones(n, np.float32)
    message = raises(CollectiveMismatchError, pg.all_gather_v, np.zeros(counts[me], np.float32), recv, counts)
    expect_same(recv, np.ones(n, np.float32), "the buffer of a mismatched all_gather_v")
    return [message]


CHECKS: dict[str, Callable[[Any], list[str]]] = {
    "reductions": check_reductions,
    "movers": check_movers,
    "any_source": check_any_source,
    "tensor_variants": check_tensor_variants,
    "random_floats": check_random_floats,
    "offset_views": check_offset_views,
    "mismatch_message": check_mismatch_message,
    "new_dtypes_and_ops": check_new_dtypes_and_ops,
    "scaling": check_scaling,
    "out_of_place": check_out_of_place,
    "refused_reductions": check_refused_reductions,
    # all_to_all and the collectives with per-member sizes
    "all_to_all": check_all_to_all,
    "uneven": check_uneven,
    "split_mismatch": check_split_mismatch,
    "counts_mismatch": check_counts_mismatch,
}
# Checks of a world's errors, compared across worlds (tests/test_conformance.py).
ERROR_CHECKS: dict[str, Callable[[Any], list[str]]] = {
    "argument_mistakes": check_argument_mistakes,
    "new_mistakes": check_new_mistakes,
    "pairwise_mistakes": check_pairwise_mistakes,
}


# --- Objects (the restricted codec, never pickle) and monitored_barrier ----------------------------------


def same_object(a: Any, b: Any) -> bool:
    """`a` and `b` are the same plain object: the same types all the way down, floats and arrays bit for
    bit (NaN included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_object(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_object(a[k], b[k]) for k in a)
    return bool(a == b)


def sample_object(rank: int) -> Any:
    """A different object of every carried type per rank, of a size that grows with the rank."""
    arrays = [np.arange(rank * 5 + 3, dtype=d).reshape(-1, 1) for d in dtypes_for_objects()]
    return {
        "rank": rank,
        "flags": [None, True, False],
        "ints": (0, -rank, 2**70 + rank, -(2**65)),
        "floats": [0.1 * rank, -0.0, float("inf"), float("nan")],
        "text": "héllo ✓" * rank,
        "bytes": bytes(range(rank * 7 % 256)),
        "nested": {"deeper": [(rank, [rank] * rank)], "empty": {}},
        "arrays": arrays,
        "bool": np.array([rank % 2 == 0, True]),
    }


def dtypes_for_objects() -> list[Any]:
    return [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.complex128]


def expect_object(actual: Any, expected: Any, what: str) -> None:
    if not same_object(actual, expected):
        raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")


def check_objects(pg: Any) -> list[str]:
    """Every object collective from and to every root against the objects themselves; a rank whose
    object cannot be encoded, members that disagree on the root, or a payload over a member's max_bytes
    fail every rank alike (the group stays usable); monitored_barrier with everyone there."""
    n, me, ranks = pg.size(), pg.rank(), pg.ranks()
    index = pg.group_rank(me)
    objs = [sample_object(r) for r in ranks]
    gathered = ad.all_gather_object(objs[index], pg)
    expect_object(gathered, objs, "all_gather_object")
    for src in ranks:
        got = ad.broadcast_object(objs[index] if me == src else None, src, pg)
        expect_object(got, objs[pg.group_rank(src)], f"broadcast_object src {src}")
    for dst in ranks:
        got = ad.gather_object(objs[index], dst, pg)
        expect_object(got, objs if me == dst else None, f"gather_object dst {dst}")
    for src in ranks:
        got = ad.scatter_object(objs if me == src else None, src, pg)
        expect_object(got, objs[index], f"scatter_object src {src}")
    if n > 1:
        # A ring; even members send first, so the blocking sends always find their receiver.
        nxt, prev = ranks[(index + 1) % n], ranks[(index - 1) % n]
        for step in (0, 1):
            if (index + step) % 2 == 0:
                ad.send_object(objs[index], nxt, pg, tag=7)
            else:
                expect_object(ad.recv_object(prev, pg, tag=7), objs[(index - 1) % n], "recv_object")

    # The last member's object cannot be encoded: every member raises TypeError, nothing moves.
    bad = {"ok": 1, "oops": [1, {2}]} if index == n - 1 else "fine"
    message = raises(TypeError, ad.all_gather_object, bad, pg)
    want = "obj['oops'][1] is a set" if index == n - 1 else f"rank(s) [{ranks[-1]}] raised TypeError"
    assert want in message, message
    # The members disagree on the root.
    if n > 1:
        raises(CollectiveMismatchError, ad.broadcast_object, "x", me, pg, match="disagree on the root")
    if n > 1:
        # The last member's payload is larger than the first member allows.
        obj, limit = ("y" * 100 if index == n - 1 else "y"), (64 if index == 0 else 1 << 20)
        gather = lambda: ad.gather_object(obj, ranks[0], pg, max_bytes=limit)  # noqa: E731
        raises(ValueError, gather, match=f"the payload of rank {ranks[-1]} (113 bytes) exceeds max_bytes=64")
    # Still in step: the group works after each refusal.
    expect_object(ad.all_gather_object(index, pg), list(range(n)), "all_gather_object after the errors")
    pg.monitored_barrier(30, True)
    return [hashlib.sha256(encode(gathered)).hexdigest()[:16]]


CHECKS["objects"] = check_objects

# Checks that abort the world they run in (each ends with a mismatch on purpose): each needs a world of
# its own.
ABORTING = {"mismatch_message", "scaling", "split_mismatch", "counts_mismatch", "objects"}


def run_checks(pg: Any, names: list[str]) -> list[list[str]]:
    """The checks `names` one after another on one group, as a job makes its calls; each one's digests."""
    return [(CHECKS | ERROR_CHECKS)[name](pg) for name in names]
