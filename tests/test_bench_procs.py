"""The multi-process bench runs the bulk collectives and names every figure it could not measure."""

from __future__ import annotations

import pytest

from axonml_distributed import bench
from axonml_distributed.bench import procs
from mpi_run import needs_mpi


@pytest.mark.timeout(300)
def test_the_bench_prints_ours_and_says_which_peers_it_could_not_measure(capsys, monkeypatch):
    # No MPI can be found: the bench must say so instead of dropping the column silently.
    monkeypatch.setattr(procs, "find_mpiexec", lambda: None)
    args = ["--sizes", "262144", "--colls", "broadcast,all_gather", "--repeat", "1", "--peers", "mpi"]
    assert procs.main(args) == 0
    out, err = capsys.readouterr()
    assert "MPI not measured: mpiexec" in err
    for coll in ("broadcast", "all_gather"):
        assert f"float32 {coll}, 2 ranks (quiet)" in out
    assert "256 KiB" in out and "shm-segment" in out
    assert "numpy copy" in out and "bound" not in out  # the copy is shown; no peer to bound


def test_the_copy_bound_is_each_peers_time_over_the_copy(capsys):
    res = {
        "shm": {"broadcast": [2e-3]},
        "mpi4py MPICH": {"broadcast": [3e-3]},
        procs.COPY: {"broadcast": [1.5e-3]},
    }
    procs._table(2, [1 << 20], "broadcast", "quiet", 1, res, {})
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.rstrip().endswith("1.50x |                2.00x"), row  # MPICH over ours, MPICH over the copy


def test_the_copy_bound_counts_what_each_rank_must_write_into_its_output():
    from axonml_distributed.bench.procs_worker import copy_bytes

    mib = 1 << 20
    # 4 ranks: an all_reduce brings in 2 x 3/4 of the message (reduce-scatter and all-gather), a
    # reduce_scatter the 3 peers' quarters, a broadcast everything but on its root, and an out-of-place
    # all_gather fills its whole output, its own quarter included.
    assert copy_bytes("all_reduce", 64 * mib, 4, 1) == 96 * mib
    assert copy_bytes("reduce_scatter", 64 * mib, 4, 1) == 48 * mib
    assert [copy_bytes("broadcast", 64 * mib, 4, r) for r in range(4)] == [0] + [64 * mib] * 3
    assert copy_bytes("all_gather", 64 * mib, 4, 3) == 64 * mib


def test_the_copy_bound_copies_between_arrays_that_start_on_a_page():
    from axonml_distributed.bench.procs_worker import page_aligned

    for count in (1, 1000, 65536):
        a = page_aligned(count)
        assert a.ctypes.data % 4096 == 0 and a.size == count and a.dtype == "float32"


@needs_mpi
@pytest.mark.timeout(300)
def test_all_to_all_and_all_gather_v_run_against_mpich(capsys):
    # `bench --collectives`: each result is checked in the worker before it is timed (a wrong one ends it).
    assert bench.main(["--collectives", "--ranks", "2", "--sizes", "262144", "--repeat", "1"]) == 0
    out, err = capsys.readouterr()
    for coll in ("all_to_all", "all_gather_v", "all_gather"):
        table = out.partition(f"float32 {coll}, 2 ranks (quiet)")[2].partition("float32 ")[0]
        assert "mpi4py MPICH / shm" in table and "256 KiB" in table, (coll, out, err)
        assert "nan" not in table, table
