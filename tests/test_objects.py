"""The object collectives' refusals beyond the conformance suite (tests/conformance.py::check_objects runs
the round trips and the group-wide refusals in every world): point to point, the source's list, bad
arguments. Every refusal reaches every rank involved; none leaves a peer waiting."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from conformance import same_object
from threads_run import outcomes

pytestmark = pytest.mark.timeout(60)


def test_an_object_the_sender_cannot_encode_fails_the_receiver_too_and_the_pair_stays_in_step():
    def fn(pg: ad.ProcessGroup) -> Any:
        if pg.rank() == 0:
            with pytest.raises(TypeError, match=r"obj\[1\] is a set"):
                ad.send_object([1, {2}], 1, pg, tag=5)
            ad.send_object({"then": np.arange(3)}, 1, pg, tag=5)
            return None
        with pytest.raises(TypeError, match=r"rank 0 could not encode its object"):
            ad.recv_object(0, pg, tag=5)
        return ad.recv_object(0, pg, tag=5)

    res = outcomes(2, fn)
    assert same_object(res[1], {"then": np.arange(3)}), res


def test_a_payload_over_the_receivers_max_bytes_is_refused_before_it_is_received_and_aborts_the_world():
    def fn(pg: ad.ProcessGroup) -> Any:
        if pg.rank() == 0:
            ad.send_object(b"x" * 1000, 1, pg)  # may return before the receiver looks (eager)
            pg.barrier()
            return "not aborted"
        return ad.recv_object(0, pg, max_bytes=100)

    res = outcomes(2, fn)
    assert isinstance(res[1], ValueError), res
    assert "rank 0 sends 1013 bytes, over max_bytes=100" in str(res[1]), res
    assert isinstance(res[0], ad.PeerFailureError), res[0]  # its payload was never taken: told at once


@pytest.mark.parametrize(
    ("objs", "message"),
    [
        ([1, 2], "objs on the source must be a list of 3 objects (one per member), not 2 objects"),
        ("abc", "objs on the source must be a list of 3 objects (one per member), not str"),
        ([1, 2, {3}], "obj is a set"),
    ],
)
def test_a_bad_list_on_the_scatter_source_fails_every_rank(objs: Any, message: str) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        try:
            ad.scatter_object(objs if pg.rank() == 1 else None, 1, pg)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)
        return "no error"

    res = outcomes(3, fn)
    kind = TypeError if "set" in message else ValueError
    assert res[1][0] is kind and message in res[1][1], res
    for r in (0, 2):
        assert res[r][0] is kind and "rank(s) [1] raised" in res[r][1], res
    scatter = lambda pg: ad.scatter_object(["a", "b"] if pg.rank() == 0 else None, 0, pg)  # noqa: E731
    assert ad.spawn(scatter, 2) == ["a", "b"]


BAD_ARGUMENTS = {
    "root outside": (lambda pg: ad.broadcast_object(1, 7, pg), ValueError, "rank 7, is not a member"),
    "root a str": (lambda pg: ad.gather_object(1, "0", pg), TypeError, "the root must be a rank, got str"),
    "max_bytes 0": (lambda pg: ad.all_gather_object(1, pg, max_bytes=0), ValueError, "must be positive"),
    "max_bytes float": (lambda pg: ad.all_gather_object(1, pg, max_bytes=1.5), TypeError, "must be an int"),
}


@pytest.mark.parametrize(("call", "kind", "message"), BAD_ARGUMENTS.values(), ids=list(BAD_ARGUMENTS))
def test_bad_arguments_fail_every_rank_alike(call: Any, kind: type, message: str) -> None:
    res = outcomes(2, call)
    assert all(isinstance(e, kind) and message in str(e) for e in res), res
    # The group is still usable: nothing was left half done.
    assert ad.spawn(lambda pg: ad.all_gather_object(pg.rank(), pg), 2) == [[0, 1], [0, 1]]


def test_torch_order_arguments_are_a_type_error_naming_the_call() -> None:
    with pytest.raises(TypeError, match=r"all_gather_object\(obj, group\) takes the process group second"):
        ad.all_gather_object([None, None], [1])  # type: ignore[arg-type]


def test_a_tensor_the_codec_does_not_carry_is_refused_with_the_fix() -> None:
    torch = pytest.importorskip("torch")
    pg = ad.ProcessGroup(ad.ThreadBackend.single())
    with pytest.raises(
        TypeError, match=r"obj\['w'\] is a torch.nn.parameter.Parameter \(a tensor subclass: send"
    ):
        ad.broadcast_object({"w": torch.nn.Parameter(torch.zeros(2))}, 0, pg)
    with pytest.raises(
        TypeError, match=r"obj\[0\] is a torch.Tensor of dtype float32 on cpu \(torch.strided, requ"
    ):
        ad.broadcast_object([torch.zeros(2, requires_grad=True)], 0, pg)
    with pytest.raises(TypeError, match=r"obj is a torch.Tensor of dtype float8_e4m3fn on cpu"):
        ad.broadcast_object(torch.zeros(2).to(torch.float8_e4m3fn), 0, pg)


def test_a_negative_root_is_refused_not_taken_for_no_root() -> None:
    res = outcomes(2, lambda pg: ad.broadcast_object("x", -1, pg))
    assert all(isinstance(e, ValueError) and "the root, rank -1, is out of range" in str(e) for e in res), res
