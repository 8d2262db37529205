"""A CPU torch tensor handed to a collective is taken by its memory (its DLPack description: device,
element size, shape, strides, address), in place: every dtype the core reduces, views with a storage
offset, dimensions of size 1 with any stride (contiguous to torch), 0-d tensors, tensors that require
grad. A view whose elements are not laid out in order (transposed, expanded, a column) is refused as
before, and so are lazily negated or conjugated views (`test_tensors_everywhere`). References: torch's
own arithmetic on the same values, and the untouched rest of each view's storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import axonml_distributed as ad  # noqa: E402

pytestmark = pytest.mark.timeout(60)

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]

# Views of a 4x6 base: name -> the view. Each is contiguous to torch (`is_contiguous()`).
VIEWS: dict[str, Callable[[Any], Any]] = {
    "whole": lambda b: b,
    "rows with a storage offset": lambda b: b[1:3],
    "one row with a storage offset": lambda b: b[2],
    "a size-1 dimension with a stray stride": lambda b: b.as_strided((1, 5), (100, 1), 7),
    "0-d with a storage offset": lambda b: b[3, 4],
    "flat tail": lambda b: b.view(-1)[13:],
}


def _base(dtype: Any, rank: int) -> Any:
    """Small values, different on each rank, exact in every dtype (sums stay below 16)."""
    values = (torch.arange(24).reshape(4, 6) + 3 * rank) % 7
    if dtype.is_complex:
        return torch.complex(values.double(), -values.double()).to(dtype)
    return values.to(dtype)


def _op(dtype: Any) -> ad.ReduceOp:
    return ad.ReduceOp.MAX if dtype == torch.bool else ad.ReduceOp.SUM


def _reference(dtype: Any, view: Callable[[Any], Any], n: int, rank: int) -> Any:
    """What rank `rank`'s base holds after the all_reduce of `view` over `n` ranks, by torch."""
    want = _base(dtype, rank).clone()
    bases = [_base(dtype, r) for r in range(n)]
    wide = torch.complex128 if dtype.is_complex else torch.float64
    if dtype == torch.bool:
        reduced = torch.stack([view(b) for b in bases]).any(0)
    else:
        reduced = torch.stack([view(b).to(wide) for b in bases]).sum(0).to(dtype)
    view(want).copy_(reduced)
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_contiguous_view_is_reduced_in_place_and_only_its_elements(dtype: Any) -> None:
    def fn(pg: ad.ProcessGroup) -> list[Any]:
        out = []
        for view in VIEWS.values():
            base = _base(dtype, pg.rank())
            v = view(base)
            assert v.is_contiguous()
            pg.all_reduce(v, _op(dtype))
            out.append(base)
        return out

    for rank, bases in enumerate(ad.spawn(fn, 2, timeout=30)):
        for (name, view), got in zip(VIEWS.items(), bases, strict=True):
            want = _reference(dtype, view, 2, rank)
            assert torch.equal(got, want), (name, rank, got, want)


def test_a_tensor_that_requires_grad_is_reduced_in_place_asynchronously_too() -> None:
    def fn(pg: ad.ProcessGroup) -> tuple[list[float], list[float]]:
        p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3) * (pg.rank() + 1))
        pg.all_reduce(p)
        q = torch.arange(6.0, requires_grad=True) * 0 + pg.rank()  # a non-leaf
        w = pg.all_reduce(q[2:], async_op=True)
        w.wait()
        return p.detach().flatten().tolist(), q.detach().tolist()

    for r, (p, q) in enumerate(ad.spawn(fn, 2, timeout=30)):
        assert p == (torch.arange(6.0) * 3).tolist()
        assert q == [float(r)] * 2 + [1.0] * 4


@pytest.mark.parametrize(
    "view",
    [
        lambda b: b.t(),
        lambda b: b[:, 1:2],
        lambda b: b[:, ::2],
        lambda b: b[0:1].expand(3, 6),
        lambda b: b.reshape(1, 4, 6, 1).to(memory_format=torch.channels_last),
    ],
    ids=["transposed", "a column", "every other element", "expanded", "channels last"],
)
def test_a_view_whose_elements_are_not_in_order_is_refused_and_left_alone(view: Callable[[Any], Any]) -> None:
    # One rank: refusing aborts the world, which has no peer to free.
    base = torch.arange(24.0).reshape(4, 6)
    v = view(base)
    assert not v.is_contiguous()
    before = base.clone()

    def fn(pg: ad.ProcessGroup) -> None:
        pg.all_reduce(v, ad.ReduceOp.PRODUCT)

    with pytest.raises(ad.SpawnError) as e:
        ad.spawn(fn, 1, timeout=30)
    assert isinstance(e.value.__cause__, ValueError) and "C-contiguous" in str(e.value.__cause__)
    assert torch.equal(base, before)


def test_empty_tensors_are_taken_as_before() -> None:
    def fn(pg: ad.ProcessGroup) -> list[tuple[int, ...]]:
        shapes = []
        for t in (torch.zeros(0), torch.zeros(3, 0), torch.zeros(0, 4)[:, 1:3]):
            pg.all_reduce(t)
            shapes.append(tuple(t.shape))
        return shapes

    assert ad.spawn(fn, 2, timeout=30) == [[(0,), (3, 0), (0, 2)]] * 2


def test_the_memory_reduced_is_that_of_the_storage_kept_even_if_python_code_swaps_it() -> None:
    # A subclass's __torch_function__ runs Python code while the tensor is taken (its untyped_storage()
    # swaps the tensor's storage here): the address written must be that of the storage kept alive, so
    # the result lands in the tensor, and the storage it had before is left alone.
    class Swapping(torch.Tensor):
        replaced: list[Any] = []

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if getattr(func, "__name__", "") == "untyped_storage" and not cls.replaced:
                t = args[0]
                with torch._C.DisableTorchFunction():
                    cls.replaced.append(t.untyped_storage())  # kept: its memory stays valid
                    t.set_(torch.full((3,), 10.0 * (t[0].item() + 1)))
            return super().__torch_function__(func, types, args, kwargs or {})

    def fn(pg: ad.ProcessGroup) -> tuple[list[float], list[float]]:
        if pg.rank() == 0:
            t = torch.zeros(3).as_subclass(Swapping)
            pg.all_reduce(t)
            old = torch.tensor([], dtype=torch.float32).set_(Swapping.replaced[0])
            return t.tolist(), old.tolist()
        t = torch.ones(3)
        pg.all_reduce(t)
        return t.tolist(), []

    (mine, old), (theirs, _) = ad.spawn(fn, 2, timeout=30)
    assert mine == theirs == [11.0] * 3  # 10 (rank 0's new storage) + 1
    assert old == [0.0] * 3
