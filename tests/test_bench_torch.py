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
    assert "axonml backend not measured" not in out and "not meas." not in out
    assert "dist.all_reduce 8 B: gloo 100.0 us, axonml 10.0 us, axonml/gloo 0.10x" in out
    assert "axonml/gloo 0.10x" in out and "failed" in out  # the 64 MiB figures are missing: said so


def test_the_bench_command_has_the_torch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(bench_torch, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["--torch", "--ranks", "2", "--autocast", "bf16"]) == 0
    assert seen == [["--torch", "--ranks", "2", "--autocast", "bf16"]]


BF16 = {
    **RESULTS,
    "local/toy": 5e-4,
    "ours/toy bf16": 1.2e-3,
    "local/toy bf16": 1e-3,
    "axonml/toy bf16": 1.1e-3,
    "ours/toy bf16/compute": 1.05e-3,
    "ours/toy bf16/visible": 1e-4,
    "ours/toy bf16/overlapped": 3e-5,
    "local/toy bf16/fwd_bwd": 9e-4,
}


def test_bf16_rows_follow_the_float32_ones_with_ratios_to_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench_torch._report(2, BF16, [1.0], None)
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith(("toy", "resnet18"))]
    # Three tables (times, against the floor, the breakdown), each with the float32 rows then bf16's.
    assert [r[0].strip() for r in rows] == ["toy", "resnet18", "toy bf16"] * 3
    floor = {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[3:6]}
    assert floor["toy"] == ["500.0 us", "8.00x", "2.00x", "4.00x", "-"]
    assert floor["toy bf16"] == ["1.00 ms", "-", "1.20x", "-", "1.10x"]
    assert floor["resnet18"][0] == "failed"  # no floor measured: said so
    # 0.2 ms above the floor: 0.15 ms more compute than the floor's forward and backward, 0.1 ms visible
    # sync, and 0.05 ms less elsewhere.
    breakdown = [c.strip() for c in rows[8][1:]]
    assert breakdown == ["1.20 ms", "1.00 ms", "+200.0 us", "+150.0 us", "100.0 us", "-50.0 us", "30.0 us"]
    assert "target <= 1.05x" in out


def test_rows_asked_for_and_not_measured_are_said_to_have_failed(capsys: pytest.CaptureFixture[str]) -> None:
    bench_torch._report(2, {}, [1.0], None, ["toy bf16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("toy bf16")]
    assert len(rows) == 3 and all("failed" in r for r in rows)


def test_an_unknown_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_torch.main(["--models", "toy,vgg"])
    assert "no model vgg" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_the_bench_runs_the_toy_model_in_both_precisions(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    args = [
        "--torch",
        "--models",
        "toy",
        "--autocast",
        "both",
        "--steps",
        "1",
        "--repeat",
        "1",
        "--ranks",
        "2",
    ]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith("toy")]
    assert [r[0].strip() for r in rows] == ["toy", "toy bf16"] * 3
    # Every contender measured in both precisions (none failed), and our DDP's breakdown filled in.
    assert all("failed" not in "|".join(r) for r in rows), out
    assert all(c.strip() not in ("", "-") for c in rows[4][1:] + rows[5][1:]), out
