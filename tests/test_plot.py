"""The charts: the bench's --plot (bus bandwidth and latency against size, ours and each peer of the run)
and the demo's --plot (loss, accuracy, scaling). Each chart is read back as a PNG, and its series are
checked on the figure against figures computed here from the run's own records (its --json output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axonml_distributed import bench
from axonml_distributed.bench import common, peers, plot, torch_calls
from mpi_run import needs_mpi

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def nccl_busbw(coll: str, n: int, nbytes: int, seconds: float) -> float:
    """GB/s as nccl-tests count it, written out here rather than taken from the bench."""
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "all_gather": (n - 1) / n}[coll]
    return nbytes / seconds * factor / 1e9


def read_png(path: Path, fig: Any) -> None:
    """A PNG whose pixel size is the figure's at the resolution it is saved at."""
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()  # decodes the whole image: a truncated file fails here
        width, height = fig.get_size_inches() * plot.DPI
        assert image.size == (round(width), round(height))


def panels(fig: Any) -> dict[str, Any]:
    """The figure's axes by title."""
    return {ax.get_title(): ax for ax in fig.axes}


def series(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def last_json(out: str) -> Any:
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the bench draws, kept as they were saved."""
    figures: list[Any] = []
    draw = plot.draw_sweep

    def keep(*args: Any) -> Any:
        figures.append(draw(*args))
        return figures[-1]

    monkeypatch.setattr(plot, "draw_sweep", keep)
    return figures


def check_sweep(fig: Any, coll: str, n: int, label: str, sizes: list[int], seconds: list[float]) -> None:
    """The curve `label` of (coll, n): x the sizes run, y busbw computed here and the time in us."""
    by_title = panels(fig)
    bw = series(by_title[f"float32 {coll}, {n} ranks: bus bandwidth"])
    lat = series(by_title[f"float32 {coll}, {n} ranks: latency"])
    want = [nccl_busbw(coll, n, s, t) for s, t in zip(sizes, seconds, strict=True)]
    assert bw[label][0] == sizes and lat[label][0] == sizes
    np.testing.assert_allclose(bw[label][1], want, rtol=1e-12)
    np.testing.assert_allclose(lat[label][1], np.array(seconds) * 1e6, rtol=1e-12)


@pytest.mark.timeout(120)
def test_the_threads_bench_draws_ours_and_the_copy_bound(tmp_path, capsys, drawn) -> None:
    png = tmp_path / "charts" / "threads.png"
    args = ["--ranks", "2,3", "--sizes", "1024,65536", "--ddp-params", "0", "--json", "--plot", str(png)]
    assert bench.main(args) == 0
    report = last_json(capsys.readouterr().out)
    (fig,) = drawn
    read_png(png, fig)
    traffic = report["copy_traffic_gbps"] * 1e9
    for n in (2, 3):
        rows = [r for r in report["all_reduce"] if r["ranks"] == n]
        sizes = [r["bytes"] for r in rows]
        assert sizes == [1024, 65536]
        check_sweep(fig, "all_reduce", n, "axonml (threads)", sizes, [r["seconds"] for r in rows])
        bound = [2 * n * s / traffic for s in sizes]  # every byte read and written once by each rank
        check_sweep(fig, "all_reduce", n, "memory-traffic bound (numpy copy)", sizes, bound)
    assert len(fig.axes) == 4  # one row per world size, nothing else


@pytest.mark.timeout(240)
def test_the_shm_bench_draws_ours_and_each_peer_it_measured(tmp_path, capsys, drawn) -> None:
    png = tmp_path / "shm.png"
    args = ["--backend", "shm", "--ranks", "2", "--sizes", "4096,65536", "--colls", "all_reduce,broadcast"]
    assert bench.main([*args, "--repeat", "1", "--peers", "mpi", "--json", "--plot", str(png)]) == 0
    report = last_json(capsys.readouterr().out)
    (fig,) = drawn
    read_png(png, fig)
    results = report["results"]["2"]
    # Ours on ordinary arrays and in the segment, the copy bound, and MPICH when it could run here.
    assert {"shm", "shm-segment", procs_copy()} <= set(results)
    for coll in ("all_reduce", "broadcast"):
        bw = series(panels(fig)[f"float32 {coll}, 2 ranks: bus bandwidth"])
        assert set(bw) == set(results)
        for label, per in results.items():
            check_sweep(fig, coll, 2, label, report["sizes"], per[coll])


def procs_copy() -> str:
    from axonml_distributed.bench.procs_worker import COPY

    return COPY


@needs_mpi
@pytest.mark.timeout(180)
def test_the_mpi_bench_draws_mpi4py_and_ours(tmp_path, capsys, drawn) -> None:
    png = tmp_path / "mpi.png"
    args = ["--backend", "mpi", "--ranks", "2", "--sizes", "8,4096", "--json", "--plot", str(png)]
    assert bench.main(args) == 0
    rows = last_json(capsys.readouterr().out)["all_reduce"]
    (fig,) = drawn
    read_png(png, fig)
    sizes = [r["bytes"] for r in rows]
    assert sizes == [8, 4096]
    for key, label in [
        ("raw", "mpi4py Allreduce"),
        ("checked", "axonml MPI, signature check on"),
        ("unchecked", "axonml MPI, signature check off"),
    ]:
        check_sweep(fig, "all_reduce", 2, label, sizes, [r[f"{key}_s"] for r in rows])


def test_the_peers_chart_has_a_row_per_dtype_and_leaves_out_what_a_peer_skipped(tmp_path) -> None:
    # The worker's result as it prints it: vLLM refused bfloat16, so it has no bfloat16 curve.
    result = {
        "ranks": 2,
        "median_s": {
            "float32/4096": {"axonml": 2e-5, "native": 1e-5, "vllm": 3e-5},
            "float32/65536": {"axonml": 4e-5, "native": 3e-5, "vllm": 5e-5},
            "bfloat16/4096": {"axonml": 2.5e-5, "native": 1.5e-5},
        },
    }
    fig = plot.draw_sweep(peers.curves({"2": result}), tmp_path / "peers.png", "peers")
    read_png(tmp_path / "peers.png", fig)
    f32 = series(panels(fig)["float32 all_reduce, 2 ranks: bus bandwidth"])
    bf16 = series(panels(fig)["bfloat16 all_reduce, 2 ranks: bus bandwidth"])
    assert set(f32) == {"axonml", "native", "vllm"} and set(bf16) == {"axonml", "native"}
    assert f32["vllm"][0] == [4096, 65536]
    np.testing.assert_allclose(f32["vllm"][1], [4096 / 3e-5 / 1e9, 65536 / 5e-5 / 1e9])  # 2(n-1)/n = 1
    np.testing.assert_allclose(bf16["native"][1], [4096 / 1.5e-5 / 1e9])


def test_the_torch_calls_chart_has_a_row_per_mode(tmp_path) -> None:
    sizes = [4, 4096]
    per = {"axonml": [4e-6, 5e-6], "floor": [1e-6, 1e-6], "native": [2e-6, 3e-6]}
    results = {"this": {"median": {"blocking": per, "async": per}, "best": {"blocking": per}}}
    fig = plot.draw_sweep(torch_calls.curves(4, sizes, results), tmp_path / "calls.png", "calls")
    read_png(tmp_path / "calls.png", fig)
    for mode in ("blocking", "async"):
        lat = series(panels(fig)[f"float32 all_reduce, 4 ranks, {mode}: latency"])
        assert set(lat) == {"axonml", "floor", "native"}
        np.testing.assert_allclose(lat["floor"][1], [1.0, 1.0])
    assert len(fig.axes) == 4  # the median blocks only


def test_bus_bandwidth_follows_nccl_tests() -> None:
    for coll, n in [("all_reduce", 2), ("all_reduce", 4), ("broadcast", 3), ("all_gather", 4)]:
        curve = common.Curve("x", "ours", coll, n, [1 << 20], [1e-3])
        assert curve.busbw_gbps() == pytest.approx([nccl_busbw(coll, n, 1 << 20, 1e-3)])
    assert common.busbw_factor("reduce_scatter", 4) == 0.75


def test_plot_is_refused_for_a_run_without_a_size_sweep(capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--torch", "--plot", "x.png"])
    assert "--plot draws a sweep of message sizes" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_missing_matplotlib_is_said_before_the_run() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from axonml_distributed.bench import main\n"
        "main(['--ranks', '2', '--sizes', '8', '--ddp-params', '0', '--plot', 'x.png'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0
    assert 'pip install "axonml-distributed[plot]"' in proc.stderr
    assert "all_reduce float32" not in proc.stdout  # nothing was run


@pytest.mark.timeout(120)
def test_the_bench_writes_no_bar_when_stderr_is_not_a_terminal() -> None:
    cmd = [sys.executable, "-m", "axonml_distributed.bench", "--ranks", "2", "--sizes", "8,1024"]
    proc = subprocess.run([*cmd, "--ddp-params", "0"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# --- the demo -------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_demo_draws_loss_accuracy_and_scaling(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("sklearn")
    from axonml_distributed import demo
    from axonml_distributed.demo import chart

    figures: list[Any] = []
    draw = chart.draw
    monkeypatch.setattr(chart, "draw", lambda summary, path: figures.append(draw(summary, path)))
    png = tmp_path / "demo.png"
    assert demo.main(["--epochs", "3", "--world-size", "2", "--json", "--scaling", "--plot", str(png)]) == 0
    summary = last_json(capsys.readouterr().out)
    (fig,) = figures
    read_png(png, fig)
    by_title = panels(fig)
    epochs = [1, 2, 3]
    loss = series(by_title["loss per epoch"])["train loss"]
    acc = series(by_title["accuracy per epoch"])
    assert loss[0] == epochs and acc["train accuracy"][0] == epochs
    np.testing.assert_allclose(loss[1], summary["loss_per_epoch"])
    np.testing.assert_allclose(acc["train accuracy"][1], summary["accuracy_per_epoch"])
    # The last epoch's figures are the summary's final ones, computed after the loop.
    assert summary["loss_per_epoch"][-1] == pytest.approx(summary["train_loss"])
    assert summary["accuracy_per_epoch"][-1] == pytest.approx(summary["train_accuracy"])
    assert summary["loss_per_epoch"][0] > summary["loss_per_epoch"][-1]
    (scaling,) = [ax for title, ax in by_title.items() if title.startswith("throughput")]
    rates = [r["samples_per_sec"] for r in summary["scaling"]]
    assert [r["ranks"] for r in summary["scaling"]] == [1, 2, 4]
    measured = series(scaling)["measured"]
    assert measured[0] == [1, 2, 4]
    np.testing.assert_allclose(measured[1], rates)
    np.testing.assert_allclose(series(scaling)["linear from 1 rank"][1], [rates[0] * n for n in (1, 2, 4)])


@pytest.mark.timeout(120)
def test_the_demo_without_scaling_draws_two_panels_and_prints_no_table(tmp_path) -> None:
    pytest.importorskip("sklearn")
    png = tmp_path / "demo.png"
    cmd = [sys.executable, "-m", "axonml_distributed.demo", "--epochs", "2", "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert f"chart: {png}" in proc.stderr and "scaling" not in proc.stdout
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] < image.size[1] * 3  # two panels wide, not three


def test_scaling_needs_the_in_process_world(capsys) -> None:
    from axonml_distributed.demo import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--backend", "shm", "--scaling"])
    assert "--scaling measures in-process worlds" in capsys.readouterr().err
