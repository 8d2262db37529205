"""The cost model of all_reduce over several hosts: a latency and a bandwidth term per level, fitted to
`bench.hosts --fit`'s measurements, predicting larger jobs for a hierarchical all_reduce against a flat
ring.

H hosts, p ranks per host, N = H p ranks, S bytes per rank (the message). Each level costs alpha per
step (latency, s) and beta per byte (s/B):

    in host (shared memory), reduce-scatter or all-gather:   T_host = a_s + b_s S (p-1)/p
    across hosts, the p shard rings at once over one link:   T_net  = 2(H-1) a_n + 2(H-1)/H S b_n
    hierarchical = 2 T_host + T_net            (levels one after another)
    pipelined    = max(2 T_host, T_net)        (levels overlapped chunk by chunk, the fill ignored)
    flat ring    = 2(N-1) a_n + 2(N-1)/N S b_n
    flat, as measured = 2(N-1) a_f + 2(N-1)/N S b_f   (a_f, b_f fitted to flat gloo's own all_reduce)

Assumptions: both levels run rings (gloo's all_reduce is a ring; MPICH would use recursive halving and
doubling, with 2 log2(N) latency steps); ranks are numbered host by host, so a flat ring crosses each
host's link once and every step waits for its slowest, cross-host, edge; the p shard rings share their
host's link, so b_n is seconds per byte of one host's link; an in-host step is one synchronisation of
shared memory whatever p, and b_s (each rank's memory traffic) does not grow with p, i.e. the host's
memory bandwidth is not saturated (optimistic at p = 8); all per-call overhead is counted as per-step
latency. Fitted by least squares on relative error, each parameter kept >= 0: a_s, b_s to the shm
reduce_scatter and all_gather on one host, a_n, b_n to the shard all_reduces across H hosts, a_f, b_f to
flat gloo's all_reduce over all H p ranks (the flat ring's step as it was measured, in-host TCP edges
and all: where it differs from the a_n, b_n ring, the link is not what bounds the flat ring). On
simulated hosts every host shares the machine's cores, so the betas hold the CPU cost of moving bytes
through TCP as well as the link's rate.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PREDICT_HOSTS = (8, 64, 1000)
PREDICT_PER_HOST = 8
PREDICT_BYTES = 100_000_000  # 100 MB of float32 gradients


@dataclass(frozen=True)
class Level:
    alpha: float  # seconds per step
    beta: float  # seconds per byte


@dataclass(frozen=True)
class Model:
    host: Level
    net: Level
    flat_step: Level | None = None  # a flat ring's step as measured (flat gloo), when it was

    def in_host(self, size: float, p: int) -> float:
        """A reduce-scatter or an all-gather of `size` bytes among `p` ranks of one host."""
        return self.host.alpha + self.host.beta * size * (p - 1) / p if p > 1 else 0.0

    def across(self, size: float, hosts: int) -> float:
        """The p shard rings of a `size`-byte message over `hosts` hosts, at once."""
        return 2 * (hosts - 1) * (self.net.alpha + self.net.beta * size / hosts)

    def hierarchical(self, size: float, hosts: int, p: int) -> float:
        return 2 * self.in_host(size, p) + self.across(size, hosts)

    def pipelined(self, size: float, hosts: int, p: int) -> float:
        return max(2 * self.in_host(size, p), self.across(size, hosts))

    def flat(self, size: float, hosts: int, p: int, step: Level | None = None) -> float:
        """A ring over all ranks, each step the cross-host edge's (or `step`'s)."""
        n, step = hosts * p, step or self.net
        return 2 * (n - 1) * (step.alpha + step.beta * size / n)

    def flat_measured(self, size: float, hosts: int, p: int) -> float | None:
        return None if self.flat_step is None else self.flat(size, hosts, p, self.flat_step)


def fit_level(steps: list[float], nbytes: list[float], seconds: list[float]) -> Level:
    """alpha, beta >= 0 minimising the relative error of steps * alpha + nbytes * beta against seconds."""
    t = np.asarray(seconds, float)
    a = np.column_stack([np.asarray(steps, float), np.asarray(nbytes, float)]) / t[:, None]
    ones = np.ones_like(t)
    alpha, beta = np.linalg.lstsq(a, ones, rcond=None)[0]
    if alpha < 0 or beta < 0:  # one term explains nothing here: fit the other alone
        keep = 1 if alpha < 0 else 0
        only = float(np.linalg.lstsq(a[:, keep : keep + 1], ones, rcond=None)[0][0])
        alpha, beta = (0.0, only) if keep == 1 else (only, 0.0)
    return Level(float(alpha), float(beta))


def fit(results: dict[str, float], sizes: list[int], hosts: int, p: int) -> Model:
    """The model from `bench.hosts --fit`'s figures (keys ``in-host/<coll> S`` and ``gloo/shards S``)."""
    steps, nbytes, seconds = [], [], []
    for coll in ("reduce_scatter", "all_gather"):
        for s in sizes:
            if (t := results.get(f"in-host/{coll} {s}")) is not None:
                steps.append(1.0)
                nbytes.append(s * (p - 1) / p)
                seconds.append(t)
    if not seconds:
        raise ValueError("no in-host figures to fit")
    host = fit_level(steps, nbytes, seconds)
    net = _fit_ring(results, "gloo/shards", sizes, hosts)
    if net is None:
        raise ValueError("no cross-host figures to fit")
    return Model(host, net, _fit_ring(results, "gloo/all_reduce", sizes, hosts * p))


def _fit_ring(results: dict[str, float], key: str, sizes: list[int], n: int) -> Level | None:
    """A ring's step over `n` members from the all_reduce figures ``<key> S``: 2(n-1) steps of S/n."""
    points = [(s, results[f"{key} {s}"]) for s in sizes if f"{key} {s}" in results]
    if not points:
        return None
    steps = [2.0 * (n - 1)] * len(points)
    return fit_level(steps, [2.0 * (n - 1) / n * s for s, _ in points], [t for _, t in points])


def _t(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _level(name: str, sub: str, level: Level) -> None:
    rate = f"{1 / level.beta / 1e9:.2f} GB/s" if level.beta else "no bandwidth cost"
    print(f"  {name + ':':<30} alpha_{sub} = {_t(level.alpha)}, beta_{sub} = {level.beta:.3e} s/B ({rate})")


def report(args: argparse.Namespace, results: dict[str, float], plot: Path | None) -> Model | None:
    """Fit, print the parameters, the model against the measurements and the predictions; draw them."""
    hosts, p, sizes = args.hosts, args.ranks_per_host, args.sizes
    try:
        model = fit(results, sizes, hosts, p)
    except ValueError as e:
        print(f"\ncost model not fitted: {e}")
        return None
    print("\ncost model (bench.cost_model): alpha per step, beta per byte, fitted per level")
    _level(f"in host (shm, 1 host x {p})", "s", model.host)
    _level(f"across hosts ({hosts} hosts)", "n", model.net)
    if model.flat_step is not None:
        _level(f"flat gloo's ring ({hosts * p} ranks)", "f", model.flat_step)
    print(f"model against the measurements, {hosts} hosts x {p} ranks:")
    print(f"{'size':>10} | {'shards':>19} | {'flat gloo':>19} | {'axonml':>29}")
    pair = f"{'meas.':>9} {'model':>9}"
    print(f"{'':>10} | {pair} | {pair} | {'meas.':>9} {'seq.':>9} {'pipe.':>9}")
    for s in sizes:
        cells = []
        for key, pred in (
            ("gloo/shards", [model.across(s, hosts)]),
            ("gloo/all_reduce", [model.flat(s, hosts, p)]),
            ("axonml/all_reduce", [model.hierarchical(s, hosts, p), model.pipelined(s, hosts, p)]),
        ):
            got = results.get(f"{key} {s}")
            cells.append(" ".join([f"{'-' if got is None else _t(got):>9}", *(f"{_t(x):>9}" for x in pred)]))
        print(f"{s:>10} | " + " | ".join(cells))
    print(f"predicted: {PREDICT_BYTES / 1e6:g} MB all_reduce, {PREDICT_PER_HOST} ranks per host", end="")
    print("; x = flat / hierarchical")
    head = ["hosts", "flat ring", "flat, as meas.", "hier. seq.", "pipelined", "flat/seq.", "flat/pipe."]
    head += ["as meas./pipe."]
    print(" | ".join(f"{h:>14}" for h in head))
    for hh in PREDICT_HOSTS:
        f = model.flat(PREDICT_BYTES, hh, PREDICT_PER_HOST)
        m = model.flat_measured(PREDICT_BYTES, hh, PREDICT_PER_HOST)
        q = model.hierarchical(PREDICT_BYTES, hh, PREDICT_PER_HOST)
        r = model.pipelined(PREDICT_BYTES, hh, PREDICT_PER_HOST)
        cells = [str(hh), _t(f), "-" if m is None else _t(m), _t(q), _t(r), f"{f / q:.2f}x", f"{f / r:.2f}x"]
        cells.append("-" if m is None else f"{m / r:.2f}x")
        print(" | ".join(f"{c:>14}" for c in cells))
    if plot is not None:
        draw(model, plot)
        print(f"chart: {plot}")
    return model


def draw(model: Model, path: Path) -> None:
    from axonml_distributed.bench import plot

    hosts = np.unique(np.geomspace(2, 1000, 60).astype(int))
    p, s = PREDICT_PER_HOST, PREDICT_BYTES
    fig, axes = plot.subplots(1, 1, 7, 4.5)
    ax = axes[0][0]
    curves: tuple[tuple[str, Any, str], ...] = (
        ("flat ring over all ranks", model.flat, "-"),
        ("flat ring, step as flat gloo measured", model.flat_measured, "-."),
        ("hierarchical, levels in turn", model.hierarchical, "--"),
        ("hierarchical, levels overlapped", model.pipelined, ":"),
    )
    for label, f, style in curves:
        if f(s, 2, p) is None:
            continue
        ax.plot(hosts, [f(s, int(h), p) for h in hosts], style, label=label)
        ax.plot(PREDICT_HOSTS, [f(s, h, p) for h in PREDICT_HOSTS], "o", color=ax.lines[-1].get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"hosts ({p} ranks each)")
    ax.set_ylabel("all_reduce time (s)")
    ax.set_title(f"{s / 1e6:g} MB all_reduce: the cost model fitted on simulated hosts")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    plot.save(fig, path)
