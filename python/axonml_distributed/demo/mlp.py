"""A small multilayer perceptron in plain numpy: the model the demo trains.

Forward and backward are written by hand so the demo needs nothing beyond numpy. Every parameter is an
object with float32 ``.data`` and ``.grad`` arrays, the shape DistributedDataParallel expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float32]


class Parameter:
    """A trainable array and its gradient, both float32 and C-contiguous."""

    __slots__ = ("data", "grad")

    def __init__(self, data: NDArray[np.floating]) -> None:
        self.data: Array = np.ascontiguousarray(data, dtype=np.float32)
        self.grad: Array = np.zeros_like(self.data)


class Linear:
    """``y = x @ weight + bias``, keeping ``x`` for the backward pass."""

    def __init__(self, n_in: int, n_out: int, rng: np.random.Generator) -> None:
        # He initialisation: keeps activation variance steady through ReLU layers.
        self.weight = Parameter(rng.normal(0.0, np.sqrt(2.0 / n_in), size=(n_in, n_out)))
        self.bias = Parameter(np.zeros(n_out))
        self._x: Array | None = None

    def forward(self, x: Array) -> Array:
        self._x = x
        return x @ self.weight.data + self.bias.data

    def backward(self, dy: Array) -> Array:
        if self._x is None:
            raise RuntimeError("backward() called before forward()")
        # Write into the existing .grad arrays: DDP may have made them views of its flat buckets.
        np.matmul(self._x.T, dy, out=self.weight.grad)
        np.sum(dy, axis=0, out=self.bias.grad)
        return dy @ self.weight.data.T


class MLP:
    """Fully connected layers with ReLU between them; the last layer outputs logits."""

    def __init__(self, sizes: Sequence[int] = (64, 128, 10), seed: int = 0) -> None:
        if len(sizes) < 2:
            raise ValueError(f"sizes needs an input and an output width, got {list(sizes)}")
        rng = np.random.default_rng(seed)
        self.layers = [Linear(n_in, n_out, rng) for n_in, n_out in pairwise(sizes)]
        self._masks: list[NDArray[np.bool_]] = []

    def parameters(self) -> list[Parameter]:
        return [p for layer in self.layers for p in (layer.weight, layer.bias)]

    def forward(self, x: Array) -> Array:
        self._masks = []
        h = x
        for layer in self.layers[:-1]:
            h = layer.forward(h)
            mask = h > 0
            self._masks.append(mask)
            h = h * mask
        return self.layers[-1].forward(h)

    __call__ = forward

    def backward(self, dlogits: Array) -> None:
        """Set every parameter's ``.grad`` (overwritten, not accumulated) from d(loss)/d(logits)."""
        dh = self.layers[-1].backward(dlogits)
        for layer, mask in zip(reversed(self.layers[:-1]), reversed(self._masks), strict=True):
            dh = layer.backward(dh * mask)

    def flat_parameters(self) -> Array:
        return np.concatenate([p.data.ravel() for p in self.parameters()])


def cross_entropy(logits: Array, labels: NDArray[np.integer]) -> tuple[float, Array]:
    """Mean softmax cross-entropy over the batch and its gradient with respect to ``logits``."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # avoids overflow in exp
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = float(-log_probs[rows, labels].mean())
    dlogits = np.exp(log_probs)
    dlogits[rows, labels] -= 1.0
    dlogits /= len(labels)
    return loss, dlogits.astype(np.float32, copy=False)


class SGD:
    """Stochastic gradient descent with classical momentum, updating ``.data`` in place."""

    def __init__(self, params: Sequence[Parameter], lr: float, momentum: float = 0.0) -> None:
        self.params = list(params)
        self.lr = lr
        self.momentum = momentum
        self._velocity = [np.zeros_like(p.data) for p in self.params]

    def step(self) -> None:
        for p, v in zip(self.params, self._velocity, strict=True):
            v *= self.momentum
            v += p.grad
            p.data -= self.lr * v
