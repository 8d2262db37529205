"""A training loop that forgets sync_gradients() fails loudly at the next training forward, as torch's
DDP does; new weights without gradients, and forwards with nothing to sync, are no step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from axonml_distributed import spawn
from axonml_distributed._core import ProcessGroup, ThreadBackend
from axonml_distributed.ddp import DDP
from ddp_models import (
    MLP,
    batches,
    mse_grad,
)

pytestmark = pytest.mark.timeout(120)


def forgetful_loop(pg: Any, steps: int, sync: bool, inplace: bool, zero_first: bool) -> None:
    model = MLP(pg.rank(), inplace=inplace)
    ddp = DDP(model, pg)
    for x, y in batches(2, np.float64, steps):
        if zero_first:
            model.zero_grad()
        out = ddp(x)
        if not zero_first:
            model.zero_grad()
        model.backward(mse_grad(out, y))
        if sync:
            ddp.sync_gradients()
        model.sgd()


# zero_grad() to None before the forward leaves nothing to see at the next forward (no gradient exists,
# as after a checkpoint load); every other order is caught.
@pytest.mark.parametrize(
    ("inplace", "zero_first"),
    [(True, False), (False, False), (True, True)],
    ids=["grads-written", "grads-replaced", "grads-zeroed-before-forward"],
)
def test_a_forgotten_sync_gradients_fails_loudly_at_the_next_training_forward(
    inplace: bool, zero_first: bool
) -> None:
    spawn(forgetful_loop, 2, 3, True, inplace, zero_first)  # the loop with the sync trains
    with pytest.raises(Exception, match=r"never averaged.*ddp\.sync_gradients\(\)") as error:
        spawn(forgetful_loop, 2, 3, False, inplace, zero_first)
    assert isinstance(error.value.__cause__, RuntimeError)


def test_new_weights_between_forwards_are_no_step_without_gradients() -> None:
    # A forward, a checkpoint load, a forward: no gradient exists, so nothing was left unsynced.
    model = MLP(0, inplace=False)
    ddp = DDP(model, ProcessGroup(ThreadBackend.single()))
    x, y = batches(2, np.float64, 1)[0]
    ddp(x)
    for p in model.parameters():
        p.data = p.data + 1.0
    ddp(x)
    # With gradients (zeros) in place the new weights look like a step; sync_parameters() after the load
    # says they are not.
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.zero_grad()
    ddp(x)
    for p in model.parameters():
        p.data[...] = 0.5
    ddp.sync_parameters()
    ddp(x)
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()


@pytest.mark.parametrize("inplace", [True, False], ids=["grads-written", "grads-replaced"])
def test_forwards_with_nothing_left_to_sync_do_not_raise(inplace: bool) -> None:
    pg = ProcessGroup(ThreadBackend.single())
    model = MLP(0, inplace=inplace)
    ddp = DDP(model, pg)
    x, y = batches(2, np.float64, 1)[0]
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.sgd()
    ddp(x)  # a forward with no backward (a metric, say), then zero_grad and the next step
    model.zero_grad()
    ddp(x)
    with ddp.no_sync():  # micro-batches whose gradients stay local on purpose
        for _ in range(2):
            model.backward(mse_grad(ddp(x), y))
    ddp.eval()
    ddp(x)  # evaluation forwards never raise
    ddp.train()
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.sgd()
    model.zero_grad()
    model.backward(mse_grad(ddp(x), y))
    with pytest.raises(RuntimeError, match="sync_gradients"):
        ddp(x)  # a backward since the last forward, never synced
    with ddp.no_sync(), pytest.raises(RuntimeError, match="sync_gradients"):
        model.sgd()
        ddp(x)  # and a step on top: inside no_sync() too
