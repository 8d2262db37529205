"""The demo's MLP against finite differences, and the demo itself run end to end as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from axonml_distributed.demo import CHECK_TOLERANCE
from axonml_distributed.demo.mlp import MLP, SGD, Parameter, cross_entropy

pytest.importorskip("sklearn")

pytestmark = pytest.mark.timeout(120)


def reference_loss(weights: list[np.ndarray], x: np.ndarray, labels: np.ndarray) -> float:
    """Forward pass and softmax cross-entropy in float64, written independently of mlp.py."""
    h = x.astype(np.float64)
    pairs = list(zip(weights[::2], weights[1::2], strict=True))
    for i, (w, b) in enumerate(pairs):
        h = h @ w + b
        if i < len(pairs) - 1:
            h = np.maximum(h, 0.0)
    log_z = np.log(np.sum(np.exp(h - h.max(axis=1, keepdims=True)), axis=1)) + h.max(axis=1)
    return float(np.mean(log_z - h[np.arange(len(labels)), labels]))


def test_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(1)
    model = MLP((5, 7, 6, 4), seed=3)
    x = rng.normal(size=(9, 5)).astype(np.float32)
    labels = rng.integers(0, 4, size=9)
    loss, dlogits = cross_entropy(model(x), labels)
    model.backward(dlogits)

    weights = [p.data.astype(np.float64) for p in model.parameters()]
    assert loss == pytest.approx(reference_loss(weights, x, labels), rel=1e-5)
    eps = 1e-6
    for weight, param in zip(weights, model.parameters(), strict=True):
        numeric = np.zeros_like(weight)
        for idx in np.ndindex(weight.shape):
            saved = weight[idx]
            weight[idx] = saved + eps
            up = reference_loss(weights, x, labels)
            weight[idx] = saved - eps
            down = reference_loss(weights, x, labels)
            weight[idx] = saved
            numeric[idx] = (up - down) / (2 * eps)
        assert param.grad.dtype == np.float32
        np.testing.assert_allclose(param.grad, numeric, rtol=1e-3, atol=1e-5)


def test_backward_writes_into_existing_grad_arrays() -> None:
    # DDP may point .grad at views of its flat buckets; backward must fill them, not rebind them.
    model = MLP((3, 4, 2), seed=0)
    bucket = np.zeros(sum(p.data.size for p in model.parameters()), dtype=np.float32)
    offset = 0
    for p in model.parameters():
        p.grad = bucket[offset : offset + p.data.size].reshape(p.data.shape)
        offset += p.data.size
    _, dlogits = cross_entropy(model(np.ones((2, 3), dtype=np.float32)), np.array([0, 1]))
    model.backward(dlogits)
    assert np.any(bucket != 0)
    np.testing.assert_array_equal(bucket, np.concatenate([p.grad.ravel() for p in model.parameters()]))


def test_sgd_momentum_by_hand() -> None:
    p = Parameter(np.array([1.0, 2.0]))
    opt = SGD([p], lr=0.5, momentum=0.9)
    p.grad[...] = [1.0, -1.0]
    opt.step()  # velocity g, data - lr * g
    np.testing.assert_allclose(p.data, [0.5, 2.5])
    opt.step()  # velocity 0.9 * g + g
    np.testing.assert_allclose(p.data, [0.5 - 0.5 * 1.9, 2.5 + 0.5 * 1.9])


def run_demo(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_demo_trains_and_ranks_agree() -> None:
    _, summary = run_demo("--epochs", "10")
    assert summary["test_accuracy"] >= 0.9
    assert summary["max_param_diff"] == 0.0
    assert summary["world_size"] == 4
    assert summary["backend"] == "threads"
    assert summary["samples_per_sec"] > 0
    assert summary["sync_seconds"] > 0
    assert summary["compute_seconds"] > 0


def test_demo_matches_single_process_on_union_batch() -> None:
    # 3 ranks: the 1438 training digits then need padding, and batch 50 leaves a short last step.
    _, summary = run_demo("--check", "--epochs", "5", "--world-size", "3", "--batch-size", "50")
    assert summary["max_param_diff"] == 0.0
    assert summary["check_max_diff"] <= CHECK_TOLERANCE


def test_demo_over_shm_processes() -> None:
    _, summary = run_demo("--backend", "shm", "--nproc", "2", "--epochs", "10", "--check")
    assert summary["backend"] == "shm"
    assert summary["world_size"] == 2
    assert summary["test_accuracy"] >= 0.9
    assert summary["max_param_diff"] == 0.0
    assert summary["check_max_diff"] <= CHECK_TOLERANCE


@pytest.mark.parametrize(
    ("environment", "path"),
    [
        ({}, "launch"),
        # A process that inherited a worker's environment (a worker's own child) is no worker: it launches.
        ({"AXONML_JOB_ID": "ab12", "AXONML_LAUNCHER_PID": str(os.getpid())}, "launch"),
        ({"AXONML_JOB_ID": "ab12"}, "launch"),
        # Started by axonml-run: its parent is the launcher.
        ({"AXONML_JOB_ID": "ab12", "AXONML_LAUNCHER_PID": str(os.getppid())}, "train"),
    ],
)
def test_shm_trains_in_a_worker_of_axonml_run_and_launches_elsewhere(
    environment: dict[str, str], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import axonml_distributed.demo as demo

    for name in ["AXONML_JOB_ID", "AXONML_LAUNCHER_PID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    taken = []
    monkeypatch.setattr(demo, "load_digits_split", lambda seed: None)
    monkeypatch.setattr(demo, "launch_shm", lambda nproc, argv: taken.append("launch") or 0)
    monkeypatch.setattr(demo, "run_shm_worker", lambda cfg, data: taken.append("train") or 0)
    assert demo.main(["--backend", "shm", "--nproc", "2"]) == 0
    assert taken == [path]


def test_missing_sklearn_says_what_to_install() -> None:
    code = "import sys; sys.modules['sklearn'] = None; from axonml_distributed.demo import main; main([])"
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert 'pip install "axonml-distributed[demo]"' in proc.stderr
