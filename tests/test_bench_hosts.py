"""The several-hosts bench (python -m axonml_distributed.bench --hosts 2) and its cost model: on simulated
hosts it reports every row for gloo and MPICH, and names a contender it could not measure; the model's
formulas against the link traffic counted by hand, and its fit against known parameters. Timings are
never asserted."""

from __future__ import annotations

import pytest

from axonml_distributed.bench import cost_model, hosts
from axonml_distributed.bench.cost_model import Level, Model
from mpi_run import needs_mpi, open_mpi
from simhosts_fixture import needs_simhosts

MiB = 1 << 20


@needs_simhosts
@needs_mpi
@pytest.mark.timeout(60)
def test_the_bench_reports_every_row_for_gloo_and_mpich_on_simulated_hosts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    if open_mpi():
        pytest.skip("the bench launches MPICH's hydra")
    # One rank per host: on a loaded 2-core machine, starting torch in more processes takes most of a minute.
    args = ["--hosts", "2", "--ranks-per-host", "1", "--sizes", "4096,65536", "--contenders", "gloo,mpi"]
    args += ["--models", "toy", "--steps", "1", "--max-iters", "5", "--timeout", "45"]
    assert hosts.main(args) == 0
    out = capsys.readouterr().out
    assert "2 simulated hosts x 1 rank, each link 10gbit (tbf)" in out
    for size in ("4 KiB", "64 KiB"):
        row = next(line for line in out.splitlines() if line.strip().startswith(size)).split("|")
        flat_gloo, axonml, flat_mpich, axonml_mpi = (cell.strip() for cell in row[1:5])
        assert flat_gloo.endswith("s") and flat_mpich.endswith("s") and axonml_mpi.endswith("s"), row
        assert axonml == "-", row
    toy = next(line for line in out.splitlines() if line.strip().startswith("toy")).split("|")
    assert toy[1].strip().endswith("s") and toy[2].strip() == "-", toy
    assert "axonml not run (--contenders)" in out
    assert "not measured" not in out, out


def test_a_contender_that_failed_is_named_and_the_others_still_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = hosts.parse(["--hosts", "2", "--sizes", "4096", "--models", "toy"])
    results = {"gloo/all_reduce 4096": 2e-3, "mpi/mpich 4096": 1e-4, "gloo/ddp toy": 0.01}
    hosts._report(args, results, {"axonml": "DistributedError: one host only"}, [1.0])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("4 KiB"))
    assert [c.strip() for c in row.split("|")[1:5]] == ["2.00 ms", "-", "100 us", "-"]
    assert "axonml not measured: DistributedError: one host only" in out


def test_at_2_hosts_x_2_ranks_a_flat_ring_moves_1_5x_the_bytes_of_the_hierarchy_over_each_link() -> None:
    # Issue 30: a flat ring puts 96 MiB on each host's link for a 64 MiB all_reduce, two levels 64 MiB.
    # Only the link costs here (1 s per byte, no latency, free shared memory): times are bytes.
    links_only = Model(host=Level(0.0, 0.0), net=Level(0.0, 1.0))
    assert links_only.flat(64 * MiB, 2, 2) == 96 * MiB
    assert links_only.hierarchical(64 * MiB, 2, 2) == 64 * MiB
    # A ring over N ranks takes 2(N-1) steps: latency alone, 8 hosts x 8 ranks against 8 hosts.
    latency_only = Model(host=Level(0.0, 0.0), net=Level(1.0, 0.0))
    assert latency_only.flat(1, 8, 8) == 2 * 63 and latency_only.hierarchical(1, 8, 8) == 2 * 7
    # Shared memory only: a reduce-scatter and an all-gather, each (p-1)/p of the message per rank.
    host_only = Model(host=Level(0.0, 1.0), net=Level(0.0, 0.0))
    assert host_only.hierarchical(8 * MiB, 2, 8) == 2 * 7 * MiB
    assert host_only.pipelined(8 * MiB, 2, 8) == 2 * 7 * MiB


def test_the_fit_recovers_the_parameters_that_made_the_times() -> None:
    sizes = [4096, 65536, MiB, 16 * MiB, 64 * MiB]
    true = Model(host=Level(5e-6, 1 / 8e9), net=Level(80e-6, 1 / 1.25e9), flat_step=Level(1e-4, 1 / 0.5e9))
    results = {}
    for s in sizes:
        results[f"in-host/reduce_scatter {s}"] = true.in_host(s, 2)
        results[f"in-host/all_gather {s}"] = true.in_host(s, 2)
        results[f"gloo/shards {s}"] = true.across(s, 2)
        results[f"gloo/all_reduce {s}"] = true.flat_measured(s, 2, 2)
    got = cost_model.fit(results, sizes, hosts=2, p=2)
    assert got.flat_step is not None and true.flat_step is not None
    for fitted, want in ((got.host, true.host), (got.net, true.net), (got.flat_step, true.flat_step)):
        assert fitted.alpha == pytest.approx(want.alpha, rel=1e-6)
        assert fitted.beta == pytest.approx(want.beta, rel=1e-6)


def test_a_term_that_would_fit_negative_is_held_at_zero() -> None:
    # Times that fall with size beyond what latency explains: no negative bandwidth cost.
    level = cost_model.fit_level([1, 1, 1], [1e3, 1e6, 1e7], [1e-3, 1e-3, 0.9e-3])
    assert level.beta == 0.0 and level.alpha > 0
