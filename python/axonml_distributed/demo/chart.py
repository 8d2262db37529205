"""The demo's ``--plot``: one PNG with loss and accuracy per epoch side by side and, after ``--scaling``,
a third panel of samples per second against ranks beside linear scaling from 1 rank (bench.plot's
matplotlib helpers, the ``plot`` extra)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from axonml_distributed.bench import plot


def figure(summary: dict[str, Any]) -> Any:
    scaling = summary.get("scaling")
    fig, axes = plot.subplots(1, 3 if scaling else 2, 4.6, 3.6)
    loss_ax, acc_ax = axes[0][0], axes[0][1]
    epochs = list(range(1, len(summary["loss_per_epoch"]) + 1))
    loss_ax.plot(epochs, summary["loss_per_epoch"], marker="o", ms=3, label="train loss")
    loss_ax.set_yscale("log")
    loss_ax.set_title("loss per epoch")
    loss_ax.set_ylabel("cross-entropy (all ranks)")
    acc_ax.plot(epochs, summary["accuracy_per_epoch"], marker="o", ms=3, label="train accuracy")
    test = summary["test_accuracy"]
    acc_ax.axhline(test, color="gray", linestyle="--", label=f"test accuracy, end ({test:.1%})")
    acc_ax.set_title("accuracy per epoch")
    acc_ax.set_ylabel("accuracy")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if scaling:
        ax = axes[0][2]
        ranks = [r["ranks"] for r in scaling]
        rates = [r["samples_per_sec"] for r in scaling]
        ax.plot(ranks, rates, marker="o", label="measured")
        ax.plot(
            ranks, [rates[0] * n / ranks[0] for n in ranks], "--", color="gray", label="linear from 1 rank"
        )
        ax.set_xticks(ranks)
        ax.set_title(f"throughput (in-process world, {os.cpu_count()} cores)")
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples per second")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    world = f"{summary['world_size']} ranks ({summary['backend']}), batch {summary['batch_size']} per rank"
    fig.suptitle(f"axonml-demo: an MLP on the digits, {world}", fontsize="medium")
    return fig


def draw(summary: dict[str, Any], path: Path) -> Any:
    """The demo's chart (see `figure`) written to `path`; returns the figure."""
    fig = figure(summary)
    plot.save(fig, path)
    return fig
