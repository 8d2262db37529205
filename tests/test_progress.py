"""The progress bar of long runs (`axonml_distributed.progress`), the benchmarks' and the demo's: tqdm on
stderr, only when it is a terminal; what is printed meanwhile goes above it, whole lines."""

from __future__ import annotations

import sys

import pytest

from axonml_distributed.progress import progress, write_above


class Stderr:
    """A stderr that is a terminal or not, keeping what was written."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.text = ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_the_progress_bar_shows_on_a_terminal_only(monkeypatch, capsys, tty) -> None:
    err = Stderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    with progress(3, "bench") as bar:
        print("size | time")
        print("8 B", end="")  # a line printed in parts reaches stdout whole, and the last one at the end
        print(" | 1.0 us", flush=True)
        bar.update(3)
        print("done", end="")
    assert ("bench:" in err.text and "0/3" in err.text) == tty
    if tty:  # the bar is cleared before each line and drawn again after it
        assert err.text.count("bench:") >= 3
    assert capsys.readouterr().out == "size | time\n8 B | 1.0 us\ndone"


def test_a_bar_not_enabled_shows_nowhere_and_lines_for_stderr_still_go_there(monkeypatch, capsys) -> None:
    err = Stderr(tty=True)
    monkeypatch.setattr(sys, "stderr", err)
    with progress(2, "quiet", enabled=False) as bar:
        bar.set_description("still quiet")
        bar.update(2)
        print("table")
        write_above("epoch 1")
    assert err.text == "epoch 1\n"
    assert capsys.readouterr().out == "table\n"


def test_a_line_for_stderr_goes_above_the_bar(monkeypatch) -> None:
    err = Stderr(tty=True)
    monkeypatch.setattr(sys, "stderr", err)
    with progress(2, "run") as bar:
        bar.update(1)
        write_above("epoch 1  loss 0.5")
        shown = err.text
    line = shown.index("epoch 1  loss 0.5\n")
    assert "run:" in shown[:line] and "run:" in shown[line:]  # drawn before, cleared, drawn again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tty", [True, False])
def test_the_demo_shows_its_bar_on_a_terminal_and_a_line_per_epoch_always(monkeypatch, capsys, tty) -> None:
    pytest.importorskip("sklearn")
    from axonml_distributed import demo

    err = Stderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert demo.main(["--epochs", "2", "--world-size", "2", "--batch-size", "128"]) == 0
    assert "test accuracy" in capsys.readouterr().out
    # Rank 0's per-epoch lines, and only its own (the other rank shows nothing).
    lines = [line.split("\r")[-1] for line in err.text.split("\n") if "loss" in line]
    assert [line.split()[:2] for line in lines] == [["epoch", "1/2"], ["epoch", "2/2"]]
    # tqdm's bar over every step (6 per epoch: 1438 digits over 2 ranks in batches of 128), titled by
    # the epoch, on a terminal; nothing but the lines otherwise.
    assert ("epoch 2/2:" in err.text and "12/12" in err.text) == tty
    assert ("\r" in err.text) == tty
