"""The native module as Python sees it: the hand-written `_core.pyi` agrees with it, and the tables and
checks it exports for the backends written in Python are the core's (each compared with what a native
collective does)."""

import importlib.machinery
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axonml_distributed
from axonml_distributed import _core
from axonml_distributed._core import ProcessGroup, ReduceOp, ShmBackend, ThreadBackend

pytestmark = pytest.mark.timeout(120)


@pytest.mark.timeout(300)  # mypy analyses numpy's stubs from scratch: a minute on a loaded 2-core machine
def test_stub_matches_the_native_module(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    # The stub alone (with the exceptions it names), under an empty package: otherwise mypy also analyses
    # the package's Python modules and, through them, all of torch (45 s instead of 8).
    stubs = tmp_path / "axonml_distributed"
    stubs.mkdir()
    (stubs / "__init__.pyi").touch()
    for name in ["_core.pyi", "exceptions.py"]:
        shutil.copy(Path(_core.__file__).with_name(name), stubs)
    run = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "axonml_distributed._core"],
        capture_output=True,
        text=True,
        env=dict(os.environ, MYPYPATH=str(tmp_path)),
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_native_module_is_the_stable_abi_build() -> None:
    # One wheel serves every Python from 3.10: the build names its file with the stable-ABI suffix. A
    # build for one version, left beside it in an editable checkout, would be imported first and hide it.
    suffix = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if ".abi3." in s)
    assert Path(_core.__file__).name == "_core" + suffix


def test_the_native_module_imports_only_stable_abi_symbols() -> None:
    # The file name is the build's claim; what the binary links against is the fact: every C-API function
    # or object it takes from Python is in CPython's list of the stable ABI (its own test suite's table).
    from test.test_stable_abi_ctypes import SYMBOL_NAMES  # CPython's own table (its test package)

    stable = set(SYMBOL_NAMES)
    nm = shutil.which("nm")
    assert nm is not None, "binutils' nm (which the Rust build's linker comes with)"
    listing = subprocess.run([nm, "-D", "--undefined-only", _core.__file__], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    imported = {line.split()[-1].split("@")[0] for line in listing.stdout.splitlines() if line.strip()}
    python_api = {s for s in imported if s.startswith(("Py", "_Py"))}
    assert python_api, listing.stdout  # the listing was read
    assert python_api - stable == set()


def on_threads(n: int, fn: Any) -> list[Any]:
    """`fn(group)` on every rank of a thread world; what each returned or raised."""
    groups = [ProcessGroup(b) for b in ThreadBackend.create_world(n, timeout=30)]
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(groups[r])
        except Exception as e:  # noqa: BLE001 - the outcome is what the test looks at
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_op_codes_are_the_members_codes() -> None:
    names = [n for n in dir(ReduceOp) if n.isupper() and n != "AVG"]
    assert sorted(_core.OP_CODES) == sorted(names)
    for name, code in _core.OP_CODES.items():
        member = getattr(ReduceOp, name)
        assert int(member) == code and member == code and hash(member) == hash(code)
        assert repr(member) == f"ReduceOp.{name}"
    assert ReduceOp.AVG is ReduceOp.AVERAGE
    assert len(set(_core.OP_CODES.values())) == len(_core.OP_CODES)
    assert ReduceOp.SUM != ReduceOp.MAX


def test_dtype_and_kind_tables_name_every_collective_and_dtype() -> None:
    ints = {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}
    floats = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
    assert ints | floats | {"bool"} == set(_core.DTYPE_CODES)
    assert set(_core.KIND_CODES) == {
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "gather",
        "scatter",
        "reduce",
        "barrier",
        "all_to_all",
        "all_to_all_single",
        "all_gather_v",
        "gather_v",
        "scatter_v",
        "reduce_scatter_v",
    }
    for table in (_core.DTYPE_CODES, _core.KIND_CODES):
        assert len(set(table.values())) == len(table)


def test_check_op_refuses_what_a_collective_refuses_with_its_message() -> None:
    pg = ProcessGroup(ThreadBackend.single())
    with pytest.raises(TypeError) as native:
        pg.all_reduce(np.zeros(3, np.int32), ReduceOp.AVERAGE)
    with pytest.raises(TypeError) as exported:
        _core.check_op(ReduceOp.AVERAGE, np.dtype(np.int32))
    assert str(exported.value) == str(native.value)
    with pytest.raises(TypeError, match="AVERAGE"):
        _core.check_op("avg", "int64")
    assert _core.check_op("sum", np.int32) == int(ReduceOp.SUM)
    assert _core.check_op(ReduceOp.AVERAGE, "bfloat16") == _core.OP_CODES["AVERAGE"]
    with pytest.raises(ValueError) as native_name:
        pg.all_reduce(np.zeros(3, np.float32), "median")
    with pytest.raises(ValueError) as exported_name:
        _core.check_op("median", "float32")
    assert str(exported_name.value) == str(native_name.value)
    with pytest.raises(TypeError) as native_dtype:
        pg.all_reduce(np.zeros(3, np.longdouble))
    with pytest.raises(TypeError) as exported_dtype:
        _core.check_op("sum", np.longdouble)
    assert str(exported_dtype.value).split(" has ")[1] == str(native_dtype.value).split(" has ")[1]


@pytest.mark.parametrize("ranks", [[], [0, 3], [1, 1], [2, 0, 2]])
def test_validate_ranks_refuses_what_a_group_refuses_with_its_message(ranks: list[int]) -> None:
    world = ThreadBackend.create_world(3)
    with pytest.raises(ValueError) as native:
        ProcessGroup(world[0], ranks)
    with pytest.raises(ValueError) as exported:
        _core.validate_ranks(ranks, 3)
    assert str(exported.value) == str(native.value)
    assert _core.validate_ranks([2, 0], 3) == [0, 2]


@pytest.mark.parametrize("case", ["kind", "root", "dtype", "count", "op", "scale"])
def test_describe_mismatch_is_the_thread_worlds_message(case: str) -> None:
    k, d, o = _core.KIND_CODES, _core.DTYPE_CODES, _core.OP_CODES
    x = np.ones(4, np.float32)
    calls = {
        "kind": (
            (
                lambda pg: pg.all_reduce(x.copy()),
                (1, k["all_reduce"], d["float32"], 4, -1, o["SUM"], 1.0, 1.0),
            ),
            (lambda pg: pg.broadcast(x.copy(), 0), (1, k["broadcast"], d["float32"], 4, 0, -1, 1.0, 1.0)),
        ),
        "root": (
            (lambda pg: pg.broadcast(x.copy(), 0), (1, k["broadcast"], d["float32"], 4, 0, -1, 1.0, 1.0)),
            (lambda pg: pg.broadcast(x.copy(), 1), (1, k["broadcast"], d["float32"], 4, 1, -1, 1.0, 1.0)),
        ),
        "dtype": (
            (
                lambda pg: pg.all_reduce(x.copy()),
                (1, k["all_reduce"], d["float32"], 4, -1, o["SUM"], 1.0, 1.0),
            ),
            (
                lambda pg: pg.all_reduce(np.ones(4)),
                (1, k["all_reduce"], d["float64"], 4, -1, o["SUM"], 1.0, 1.0),
            ),
        ),
        "count": (
            (lambda pg: pg.barrier(), (1, k["barrier"], -1, 0, -1, -1, 1.0, 1.0)),
            (lambda pg: pg.barrier(), (1, k["barrier"], -1, 0, -1, -1, 1.0, 1.0)),
            (
                lambda pg: pg.all_reduce(x[:3].copy()),
                (2, k["all_reduce"], d["float32"], 3, -1, o["SUM"], 1.0, 1.0),
            ),
            (
                lambda pg: pg.all_reduce(x.copy()),
                (2, k["all_reduce"], d["float32"], 4, -1, o["SUM"], 1.0, 1.0),
            ),
        ),
        "scale": (
            (
                lambda pg: pg.all_reduce(x.copy()),
                (1, k["all_reduce"], d["float32"], 4, -1, o["SUM"], 1.0, 1.0),
            ),
            (
                lambda pg: pg.all_reduce(x.copy(), postscale_factor=0.5),
                (1, k["all_reduce"], d["float32"], 4, -1, o["SUM"], 1.0, 0.5),
            ),
        ),
        "op": (
            (
                lambda pg: pg.all_reduce(x.copy(), "max"),
                (1, k["all_reduce"], d["float32"], 4, -1, o["MAX"], 1.0, 1.0),
            ),
            (
                lambda pg: pg.all_reduce(x.copy(), "min"),
                (1, k["all_reduce"], d["float32"], 4, -1, o["MIN"], 1.0, 1.0),
            ),
        ),
    }[case]
    steps = [calls[i : i + 2] for i in range(0, len(calls), 2)]

    def fn(pg: ProcessGroup) -> None:
        for step in steps:
            step[pg.rank()][0](pg)

    errors = on_threads(2, fn)
    assert all(isinstance(e, _core.CollectiveMismatchError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    last = steps[-1]
    exported = _core.mismatch_error([last[0][1], last[1][1]], [0, 1])
    assert type(exported) is type(errors[0]) and str(exported) == str(errors[0])
    assert vars(exported) == vars(errors[0])  # the same facts
    assert _core.mismatch_error([last[0][1], last[0][1]], [0, 1]) is None


def test_a_group_in_check_mode_returns_the_signature_fields_and_runs_nothing() -> None:
    d, o = _core.DTYPE_CODES, _core.OP_CODES
    check = ProcessGroup.call_check([0, 2], 2, 3)
    x = np.arange(4, dtype=np.float32)
    one = np.empty(1, np.float32)
    assert check.all_reduce(x, "max") == (d["float32"], 4, -1, o["MAX"], None)
    assert check.all_reduce(x, out=np.empty(4, np.float32), postscale_factor=0.5)[3] == o["SUM"]
    assert check.broadcast(x, 2) == (d["float32"], 4, 1, -1, None)  # the root as a group index
    assert check.broadcast(x) == (d["float32"], 4, 0, -1, None)  # default: the group's first rank
    assert check.reduce_scatter(x, np.empty(2, np.float32)) == (d["float32"], 2, -1, o["SUM"], None)
    assert check.gather_v(x[:1], None, [3, 1], 0) == (d["float32"], 4, 0, -1, [3, 1])
    assert check.all_to_all_single(x, x.copy(), [1, 3], [3, 1]) == (d["float32"], 0, -1, -1, [3, 1, 1, 3])
    assert check.reduce_scatter_v(x, one, [3, 1], "min") == (d["float32"], 4, -1, o["MIN"], [3, 1])
    assert check.barrier() == check.monitored_barrier(1.0) == (-1, 0, -1, -1, None)
    assert check.send(x, 0) == check.recv(x, 0) == check.recv_any(x) == (d["float32"], 4, -1, -1, None)
    np.testing.assert_array_equal(x, np.arange(4))  # a broadcast from rank 0 would have written it
    assert (check.rank(), check.ranks(), check.group_rank(2)) == (2, [0, 2], 1)
    with pytest.raises(ValueError, match="check mode"):
        check.new_group([2])


@pytest.mark.parametrize(
    "call",
    [
        lambda pg: pg.all_reduce(np.zeros(3, np.int32), "avg"),
        lambda pg: pg.all_reduce(np.zeros(3, np.float32), "median"),
        lambda pg: pg.all_gather(np.zeros(2, np.float32), np.zeros(3, np.float32)),
        lambda pg: pg.all_gather_v(np.zeros(2, np.float32), np.zeros(2, np.float32), [2, 0]),
        lambda pg: pg.broadcast(np.zeros(2, np.float32), 1),
        lambda pg: pg.send(np.zeros(2, np.float32), 0),
        lambda pg: pg.recv_any(np.zeros(2, np.float32)),
    ],
)
def test_a_group_in_check_mode_refuses_what_a_group_refuses_with_its_message(call: Any) -> None:
    with pytest.raises((TypeError, ValueError)) as native:
        call(ProcessGroup(ThreadBackend.single()))
    with pytest.raises((TypeError, ValueError)) as checked:
        call(ProcessGroup.call_check([0], 0, 1))
    assert type(checked.value) is type(native.value) and str(checked.value) == str(native.value)


def test_mismatch_error_names_a_member_that_entered_no_call() -> None:
    sig = (3, _core.KIND_CODES["barrier"], -1, 0, -1, -1, 1.0, 1.0)
    err = _core.mismatch_error([sig, None, sig], [0, 2, 5])
    assert isinstance(err, _core.CollectiveMismatchError)
    text = str(err)
    assert "group [0, 2, 5]" in text and "rank(s) [2] entered no call" in text
    assert (err.ranks, err.seq, err.group) == ((2,), 3, (0, 2, 5))
    assert err.calls == {0: "barrier(#3)", 5: "barrier(#3)"}
    assert _core.mismatch_error([None, None], [0, 1]) is None
    with pytest.raises(ValueError, match="kind code"):
        _core.mismatch_error([(1, 99, -1, 0, -1, -1, 1.0, 1.0)], [0])
    with pytest.raises(ValueError, match="one \\(or None\\) per member"):
        _core.mismatch_error([sig], [0, 1])


def test_segment_facts_match_a_real_segment() -> None:
    from shm_run import DictStore

    heads: list[bytes] = []

    def on_set(key: str, value: bytes) -> None:
        # Rank 0 hands out the segment it created: read its header while the name still exists.
        at = value.find(b"/axonml-")
        if key == "axonml/verdict" and at >= 0:
            name = value[at:].split(b" ")[0].decode()
            assert name.startswith(f"{_core.SEGMENT_PREFIX}{os.geteuid()}-")
            with open("/dev/shm" + name, "rb") as f:
                heads.append(f.read(64))

    store = DictStore(on_set)
    threads = [
        threading.Thread(target=ShmBackend.join, args=(store, r, 2), kwargs={"timeout": 30, "arena_bytes": 0})
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (head,) = heads

    def field(name: str) -> int:
        offset, size = _core.SEGMENT_HEADER[name]
        return int.from_bytes(head[offset : offset + size], "little")

    assert field("magic") == _core.SEGMENT_MAGIC == struct.unpack("<Q", b"AXONSHM1")[0]
    assert field("version") == _core.SEGMENT_VERSION
    assert field("world") == 2
    assert field("uid") == os.geteuid()
    assert field("creator") == os.getpid()


def test_thread_backend_is_the_thread_world_and_the_mock_names_are_gone() -> None:
    assert ThreadBackend.single().name() == "threads"
    # The world of one rank is `ProcessGroup(ThreadBackend.single())`; the names from when the in-process
    # world only pretended to communicate mean nothing now.
    assert not hasattr(_core, "MockBackend") and not hasattr(axonml_distributed, "MockBackend")
    assert not hasattr(ProcessGroup, "mock") and not hasattr(_core.World, "mock")


def test_sync_all_without_a_group_calls_the_source_handed_down() -> None:
    from axonml_distributed._core import GradientSynchronizer, GradSyncStrategy
    from axonml_distributed.init import get_default_group

    native = ProcessGroup(ThreadBackend.single())
    ops: list[Any] = []

    class PythonGroup:  # a group written in Python (as MPI's): reduced bucket by bucket
        def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> None:
            ops.append(op)
            native.all_reduce(buf, op)

    sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, 4)
    _core.set_default_group_source(PythonGroup)
    try:
        g = np.arange(3, dtype=np.float32)
        sync.prepare(1)
        sync.add_gradient(0, g)
        sync.sync_all()
    finally:
        _core.set_default_group_source(get_default_group)
    assert ops == [ReduceOp.AVERAGE] and type(ops[0]) is ReduceOp
    np.testing.assert_array_equal(g, np.arange(3, dtype=np.float32))
