"""The torch DDP bench's table (python -m axonml_distributed.bench --torch): every column shown, a
contender that cannot run said so plainly. Figures are never asserted; the bench itself is run by hand."""

from __future__ import annotations

import pytest

from axonml_distributed import bench
from axonml_distributed.bench import torch_ddp as bench_torch

RESULTS = {
    "gloo/toy": 4e-3,
    "ours/toy": 1e-3,
    "explicit/toy": 2e-3,
    "gloo/resnet18": 0.5,
    "ours/resnet18": 0.25,
    "explicit/resnet18": 0.5,
}


def test_the_table_shows_ratios_and_targets(capsys: pytest.CaptureFixture[str]) -> None:
    bench_torch._report(2, RESULTS, [1.0, 2.0], "import axonml_distributed.torch failed: no such module")
    out = capsys.readouterr().out
    assert "load average during the runs 1.00..2.00" in out
    toy = next(line for line in out.splitlines() if line.strip().startswith("toy"))
    assert "0.25x" in toy and "<= 0.5x" in toy and "0.50x" in toy and "not meas." in toy
    assert "failed" in toy  # no local figure: said so
    assert "axonml backend not measured: import axonml_distributed.torch failed: no such module" in out


def test_the_local_floor_is_shown_against_gloo(capsys: pytest.CaptureFixture[str]) -> None:
    bench_torch._report(2, {**RESULTS, "local/resnet18": 0.45}, [1.0], None)
    resnet = next(
        line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("resnet18")
    )
    assert resnet.rstrip().endswith("450.00 ms |      0.90x"), resnet


def test_the_axonml_backend_columns_when_measured(capsys: pytest.CaptureFixture[str]) -> None:
    measured = {**RESULTS, "axonml/toy": 2e-3, "axonml/resnet18": 0.4}
    measured |= {"gloo/all_reduce 8": 1e-4, "axonml/all_reduce 8": 1e-5}
    bench_torch._report(4, measured, [0.5], None)
    out = capsys.readouterr().out
    assert "not measured" not in out
    assert "dist.all_reduce 8 B: gloo 100.0 us, axonml 10.0 us, axonml/gloo 0.10x" in out
    assert "axonml/gloo 0.10x" in out and "failed" in out  # the 64 MiB figures are missing: said so


def test_the_bench_command_has_the_torch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(bench_torch, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["--torch", "--ranks", "2"]) == 0
    assert seen == [["--torch", "--ranks", "2"]]
