"""``ddp.stats()``: each step's compute, visible and overlapped sync, bytes and buckets, for the numpy DDP
and the DDP on torch modules, in the thread world and the shm world.

Counts are checked against the model (bytes of its parameters, one bucket per parameter, the steps
taken); times only for their structure, against the step's interval the test reads around each step on
the engine's own clock (`_core.wall_ns`): nothing is timed against a ratio.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed._core import wall_ns
from axonml_distributed.ddp_stats import DDPStats, StepStats
from ddp_models import MLP, TINY_MB
from shm_run import connect, ok, run_world

pytestmark = pytest.mark.timeout(120)

STEPS = 4
ACCUMULATE = 2  # this step runs one micro-batch inside no_sync() before its synced one


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def numpy_steps(pg: Any, steps: int = STEPS) -> dict[str, Any]:
    """`steps` steps of the test MLP, one bucket per parameter; the stats, each step's interval as read
    around it, and the model's parameter bytes and count."""
    model = MLP(seed=1, dtype=np.float32)
    ddp = ad.DDP(model, pg, bucket_cap_mb=TINY_MB)
    rng = np.random.default_rng(pg.rank())
    spans = []
    for step in range(steps):
        model.zero_grad()
        before = wall_ns()
        if step == ACCUMULATE:
            with ddp.no_sync():
                out = ddp(rng.normal(size=(4, 5)).astype(np.float32))
                forwarded = wall_ns()
                model.backward(out)
                ddp.sync_gradients()  # does nothing: the gradients accumulate
        out = ddp(rng.normal(size=(4, 5)).astype(np.float32))
        if step != ACCUMULATE:
            forwarded = wall_ns()
        model.backward(out)
        ddp.sync_gradients()
        spans.append((before, forwarded, wall_ns()))
        model.sgd()
        # An evaluation forward between steps starts no step.
        ddp.eval()
        ddp(rng.normal(size=(4, 5)).astype(np.float32))
        ddp.train()
    params = list(model.parameters())
    return {
        "kind": "numpy",
        "stats": ddp.stats(),
        "spans": spans,
        "bytes": sum(p.data.nbytes for p in params),
        "params": len(params),
    }


def torch_steps(pg: Any, steps: int = STEPS) -> dict[str, Any]:
    """As `numpy_steps`, for a torch module wrapped by our DDP (torch's loop: backward averages)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = ad.DDP(model, pg, bucket_cap_mb=TINY_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(pg.rank())
    spans = []
    for step in range(steps):
        opt.zero_grad()
        before = wall_ns()
        if step == ACCUMULATE:
            with ddp.no_sync():
                out = ddp(torch.randn(4, 6, generator=gen))
                forwarded = wall_ns()
                out.square().sum().backward()
        out = ddp(torch.randn(4, 6, generator=gen))
        if step != ACCUMULATE:
            forwarded = wall_ns()
        out.square().sum().backward()
        spans.append((before, forwarded, wall_ns()))
        opt.step()
        # An evaluation forward between steps starts no step.
        with torch.no_grad():
            ddp(torch.randn(4, 6, generator=gen))
    params = list(model.parameters())
    return {
        "kind": "torch",
        "stats": ddp.stats(),
        "spans": spans,
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "params": len(params),
    }


STEPPERS = {"numpy": numpy_steps, "torch": torch_steps}


def check(result: dict[str, Any], steps: int = STEPS) -> None:
    stats, spans = result["stats"], result["spans"]
    assert isinstance(stats, DDPStats) and stats.steps == steps
    kept = min(steps, 100)
    assert [s.step for s in stats.last] == list(range(steps - kept, steps))
    assert len(spans) == steps
    for s, (before, forwarded, after) in zip(stats.last, spans[-kept:], strict=True):
        assert (s.bytes, s.buckets) == (result["bytes"], result["params"])
        assert all(getattr(s, f.name) >= 0 for f in dataclasses.fields(StepStats))
        # The step lies inside the interval the test read around it, on the same clock, and starts at
        # its first training forward (not at its first gradient, nor at an evaluation forward before).
        assert before <= s.start_ns <= forwarded
        compute, visible, overlapped, comm = map(
            _ns, (s.compute_s, s.visible_sync_s, s.overlapped_sync_s, s.comm_s)
        )
        assert s.start_ns + compute + visible <= after
        # Overlapped communication ran under compute; the rest of it, while the caller waited.
        assert overlapped <= min(compute, comm)
        assert comm - overlapped <= visible
        # A torch module's buckets (one a parameter here) go out from autograd's hooks while backward
        # still computes the earlier layers' gradients, so some of every step's sync is hidden; a
        # numpy model's go out in sync_gradients(), after its backward: none is.
        assert overlapped > 0 if result["kind"] == "torch" else overlapped == 0
    t = stats.totals
    assert (t.step, t.bytes, t.buckets) == (steps, steps * result["bytes"], steps * result["params"])
    if steps <= 100:
        assert t.start_ns == stats.last[0].start_ns
        for name in ("compute_s", "visible_sync_s", "overlapped_sync_s", "comm_s"):
            assert getattr(t, name) == pytest.approx(sum(getattr(s, name) for s in stats.last), abs=1e-9)


@pytest.mark.parametrize("kind", STEPPERS)
def test_thread_world_counts_and_structure(kind: str) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    for result in ad.spawn(STEPPERS[kind], 2):
        check(result)


def test_only_the_last_100_steps_are_kept_and_the_totals_count_every_one() -> None:
    for result in ad.spawn(numpy_steps, 2, 103):
        check(result, 103)


def w_steps(
    rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any, kind: str
) -> dict[str, Any]:
    pg = connect(rank, n, ports[0], timeout)
    result = STEPPERS[kind](pg)
    result["stats"] = dataclasses.asdict(result["stats"])
    return result


@pytest.mark.parametrize("kind", STEPPERS)
def test_shm_world_counts_and_structure(kind: str) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    for result in ok(run_world(2, w_steps, kind, timeout=60, limit=100)):
        raw = result["stats"]
        result["stats"] = DDPStats(StepStats(**raw["totals"]), tuple(StepStats(**s) for s in raw["last"]))
        check(result)
