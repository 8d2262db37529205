"""How torch finds the "axonml" backend when a script names it and imports nothing of ours.

torch calls `register` through two entry points of this package: ``torch.backends``, which torch 2.5
and later run at the end of ``import torch`` (its device-extension autoload; ``TORCH_DEVICE_BACKEND_
AUTOLOAD=0`` turns it off), and ``torch.distributed.backends``, which torch 2.14 and later read the
first time a script names a backend. torch 2.4 has neither, hence ``torch>=2.5``.

Registering costs ``import torch`` nothing it has not loaded already: this module imports no torch layer
of ours; the first "axonml" group imports it (`axonml_distributed.torch`).
"""

from __future__ import annotations

from typing import Any

BACKEND = "axonml"


def register() -> None:
    """Register "axonml" with torch.distributed, once (torch before 2.15 refuses a name registered
    twice); nothing on a torch built without distributed support."""
    import torch.distributed as dist

    if dist.is_available() and BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def _create(opts: Any, backend_options: Any) -> Any:
    """torch's creator (extended API), from the torch layer, imported now."""
    from axonml_distributed.torch import create

    return create(opts, backend_options)
