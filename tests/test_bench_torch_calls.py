"""The torch call bench (python -m axonml_distributed.bench --torch-calls): its floor backend does
nothing, and its tables show each build's overhead over the floor and the native call. Figures are
never asserted."""

from __future__ import annotations

import pytest

from axonml_distributed import bench
from axonml_distributed.bench import torch_calls

torch = pytest.importorskip("torch")


def test_the_table_shows_the_overhead_over_floor_and_native(capsys: pytest.CaptureFixture[str]) -> None:
    per = {"axonml": [5e-6, 9e-6], "floor": [1.5e-6, 1.5e-6], "native": [2e-6, 6e-6]}
    results = {"this": {"median": {"blocking": per, "async": per}}, "base": {"median": {"blocking": per}}}
    torch_calls.report(2, [4, 4096], results, [0.5, 1.5])
    out = capsys.readouterr().out
    assert "load average during the runs 0.50..1.50" in out
    rows = [line for line in out.splitlines() if line.strip().startswith("4 KiB")]
    assert len(rows) == 8  # both builds, both modes, both statistics
    assert "fastest block" in out
    assert rows[0].split("|")[1].strip() == "this"
    assert [c.strip() for c in rows[0].split("|")[2:6]] == ["9.00 us", "1.50 us", "6.00 us", "1.50 us"]
    assert "n/a" in rows[3]  # the base build measured no async call: said so


@pytest.mark.timeout(300)
def test_the_bench_runs_both_modes_at_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--torch-calls", "--sizes", "4", "--repeat", "1", "--blocks", "2", "--calls", "5"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    for mode in ("blocking: dist.all_reduce(t)", "async: dist.all_reduce(t, async_op=True).wait()"):
        assert mode in out
    rows = [line for line in out.splitlines() if line.strip().startswith("4 B")]
    assert len(rows) == 4 and all("n/a" not in r for r in rows), out


def test_the_floor_backend_does_nothing_and_finishes_at_once() -> None:
    import torch.distributed as dist

    from axonml_distributed.bench.torch_calls_worker import FLOOR, FloorWork, register_floor

    register_floor()
    register_floor()  # once per process: torch refuses a name registered twice
    dist.init_process_group(FLOOR, store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        assert dist.all_reduce(t) is None
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, FloorWork) and work.is_completed() and work.wait()
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
