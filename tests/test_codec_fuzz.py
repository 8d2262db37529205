"""Fuzzing the object codec's decoder, which reads what peers send: every input is either a valid payload
(its object encodes back to the same payload's object) or a ValueError, never another exception, and
decoding never allocates more than a small multiple of the payload (a length or count field cannot make
it allocate what the bytes do not hold). Round trips of generated objects of every carried type.

The example count is the Hypothesis profile's: 100 per test by default (seconds); for a long run:

    HYPOTHESIS_PROFILE=long python -m pytest tests/test_codec_fuzz.py
"""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from axonml_distributed.codec import DEFAULT_MAX_BYTES, decode, encode
from never_pickled import same

pytestmark = pytest.mark.timeout(600)  # the long profile

U64 = struct.Struct("<Q")
HEADER = b"AXO\x01"
NUMERIC = [
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
    "complex64", "complex128",
]  # fmt: skip
# Decoding may build Python objects several times the size of their bytes (a one-byte None becomes an
# 8-byte list slot, a ten-byte dict entry a hundred bytes of dict and key), never more.
ALLOCATION_PER_BYTE = 200
ALLOCATION_SLACK = 1 << 20
REFUSED = object()


@st.composite
def arrays(draw: Any) -> np.ndarray:
    """A native-endian array of any carried dtype and shape (any bit pattern; bool 0 or 1), maybe strided."""
    dtype = draw(st.sampled_from(["bool", "bfloat16", *NUMERIC]))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        a = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), bool).reshape(shape)
    else:
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        raw = draw(st.binary(min_size=size * dt.itemsize, max_size=size * dt.itemsize))
        a = np.frombuffer(raw, dt).reshape(shape).copy()
    return a.T if draw(st.booleans()) else a


def as_tensor(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


tensors = arrays().map(as_tensor) | arrays().map(lambda a: as_tensor(a).T)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
objects = st.recursive(
    scalars | arrays() | tensors,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)


def decoded_or_refused(payload: bytes) -> None:
    """`payload` decodes to an object that round-trips, or is refused with ValueError; either way within
    the allocation bound."""
    tracemalloc.start()
    try:
        try:
            got = decode(payload)
        except ValueError:
            got = REFUSED
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= ALLOCATION_PER_BYTE * len(payload) + ALLOCATION_SLACK, (peak, len(payload))
    if got is not REFUSED:
        assert same(decode(encode(got)), got)


@settings(deadline=None)
@given(objects)
@example(torch.tensor([], dtype=torch.bfloat16))  # found by the long run: an empty tensor of stride 0
def test_every_carried_object_round_trips(obj: Any) -> None:
    assert same(decode(encode(obj)), obj)


@settings(deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    decoded_or_refused(data)
    decoded_or_refused(HEADER + data)


# Pieces a payload is made of: tags, array and tensor headers (dtype code, ndim and dims, small and
# huge), lengths small and huge, and stray bytes.
LENGTHS = st.sampled_from(
    [0, 1, 2, 3, 8, 2**20, 2**31, 2**32, 2**62, 2**63, 2**64 - 1, DEFAULT_MAX_BYTES + 1]
)
LENGTHS |= st.integers(0, 2**64 - 1)


def array_header(tag: int, code: int, dims: list[int]) -> bytes:
    return bytes((tag, code, len(dims))) + b"".join(U64.pack(d) for d in dims)


TOKENS = (
    st.sampled_from([bytes([t]) for t in b"NFTifsbltdaP"])
    | st.tuples(st.sampled_from(b"aP"), st.integers(0, 17), st.integers(0, 66)).map(bytes)
    | st.builds(array_header, st.sampled_from(b"aP"), st.integers(1, 15), st.lists(LENGTHS, max_size=4))
    | LENGTHS.map(U64.pack)
    | st.binary(max_size=9)
)


@settings(deadline=None)
@given(st.lists(TOKENS, max_size=24).map(b"".join))
@example(array_header(ord("a"), 12, [2**20]))  # dims that promise more than the bytes hold
@example(array_header(ord("P"), 5, [2**16, 2**16]))
def test_payloads_made_of_tags_and_lengths(body: bytes) -> None:
    decoded_or_refused(HEADER + body)


@st.composite
def mutated(draw: Any) -> bytes:
    """A valid payload with a few bits flipped, bytes replaced, inserted or dropped, 8 bytes overwritten
    by a huge length, and maybe truncated."""
    payload = bytearray(encode(draw(objects)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(payload) - 1))
        kind = draw(st.sampled_from(["flip", "byte", "insert", "drop", "length"]))
        if kind == "flip":
            payload[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            payload[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            payload[i:i] = draw(st.binary(min_size=1, max_size=9))
        elif kind == "drop":
            del payload[i : i + draw(st.integers(1, 9))]
        else:
            huge = draw(st.sampled_from([2**32, 2**40, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
            payload[i : i + 8] = U64.pack(huge)
        if not payload:
            break
    cut = draw(st.integers(0, len(payload)))
    return bytes(payload[:cut] if draw(st.booleans()) else payload)


@settings(deadline=None)
@given(mutated())
def test_mutated_payloads(payload: bytes) -> None:
    decoded_or_refused(payload)
