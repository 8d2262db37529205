"""CPU torch tensors as numpy arrays over the same memory, for the code that computes with numpy (the MPI
group, the comm helpers that split or concatenate), and results given back in the caller's type.

torch stays optional: a tensor can only exist if torch is imported, so nothing here imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def is_tensor(t: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def numpy_view(t: Any) -> Any:
    """A CPU tensor's memory as a numpy array (zero-copy; strided as the tensor is), anything else as it
    is: callers validate what they get, so a CUDA tensor or a list is reported by their checks."""
    if is_tensor(t) and t.device.type == "cpu":
        return t.detach().numpy()
    return t


def _same(array: np.ndarray) -> np.ndarray:
    return array


def like(t: object) -> Callable[[np.ndarray], Any]:
    """How to give a new numpy result back in `t`'s type: a tensor over the same memory for a tensor."""
    return sys.modules["torch"].from_numpy if is_tensor(t) else _same  # type: ignore[no-any-return]


def as_numpy(t: Any) -> tuple[Any, Callable[[np.ndarray], Any]]:
    """`numpy_view` and `like` together, refusing a tensor that is not on the CPU."""
    if is_tensor(t) and t.device.type != "cpu":
        raise ValueError(f"collectives run on CPU tensors; got one on {t.device}")
    return numpy_view(t), like(t)


def raw_memory(t: Any) -> np.ndarray:
    """A CPU tensor's memory as numpy bytes, to broadcast it whatever its dtype (bool, bfloat16 ...):
    flat uint8 when contiguous, else the strided numpy view (`ddp.broadcast_arrays` copies it back)."""
    t = t.detach()
    if t.is_contiguous():
        return t.reshape(-1).view(sys.modules["torch"].uint8).numpy()  # type: ignore[no-any-return]
    return t.numpy()  # type: ignore[no-any-return]
