"""What every "axonml" torch group answers torch itself, whatever carries its data (one host's shared
memory, or several hosts): its backend's name, its name and description, its size, and itself as its
CPU backend."""

# mypy: disable-error-code="override"

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed.torch_entry import BACKEND


class NamedGroup(dist.ProcessGroup):
    """torch's ProcessGroup, named as torch names groups. `ranks`: the group's global ranks."""

    def __init__(self, rank: int, ranks: list[int]) -> None:
        super().__init__(rank, len(ranks))
        self._ranks = ranks
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    # torch names every group (destroy_process_group(g), functional collectives and DeviceMesh look
    # groups up by name) through methods that only reach registered C++ backends: keep them here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def size(self) -> int:
        return len(self._ranks)

    def _get_backend(self, device: Any) -> NamedGroup:
        """This group is its own CPU backend: torch asks for it (batch_isend_irecv does, and a Python
        ProcessGroup has none registered), and a RuntimeError means none, as torch expects."""
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"the axonml backend has no backend for device {device} (CPU only)")
        return self
