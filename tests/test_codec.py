"""The restricted object codec: round trips against the objects themselves, every refused type named
where it sits, and a decoder that trusts nothing (truncated, corrupted, oversized or hostile payloads
are a ValueError, never a crash, a huge allocation or an import)."""

from __future__ import annotations

import pickle
import struct
import sys
from collections import OrderedDict
from enum import IntEnum
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonml_distributed.codec import DEFAULT_MAX_BYTES, MAX_DEPTH, decode, encode
from conformance import same_object

U64 = struct.Struct("<Q")
HEADER = b"AXO\x01"

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**300), max_value=2**300)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.binary()
)


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes of `dtype` (any bit pattern: NaN payloads, invalid bools excluded by the caller)."""
    size = (*shape, np.dtype(dtype).itemsize)
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).view(dtype).reshape(shape)


arrays = st.builds(
    random_array,
    st.sampled_from(["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                     "float16", "float32", "float64", "complex64", "complex128"]),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.integers(0, 2**32),
)  # fmt: skip
objects = st.recursive(
    scalars | arrays.filter(lambda a: a.dtype != bool),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(objects)
def test_every_carried_object_comes_back_the_same(obj: Any) -> None:
    assert same_object(decode(encode(obj)), obj)


@pytest.mark.parametrize(
    "obj",
    [
        None, True, False, 0, -1, 127, 128, -128, -129, 2**64, -(2**64), 2**1000, 0.0, -0.0, float("nan"),
        "", "héllo ✓", "\ud800", b"", b"\x00\xff", [], (), {}, [[[]]], ((1,),), {"a": {"b": [1, (2, "c")]}},
        {"": None, "x": b"y"},
    ],
)  # fmt: skip
def test_scalars_and_containers_keep_their_values_and_types(obj: Any) -> None:
    assert same_object(decode(encode(obj)), obj)


def test_bool_arrays_keep_their_values():
    a = np.array([[True, False], [False, True]])
    assert same_object(decode(encode(a)), a)


def test_arrays_come_back_native_contiguous_and_writable_with_the_same_values():
    a = np.arange(24, dtype=">f8").reshape(4, 6)[::2, ::3]  # big-endian and strided
    b = decode(encode(a))
    assert b.dtype == np.dtype("float64") and b.dtype.isnative and b.flags.c_contiguous and b.flags.writeable
    assert b.shape == a.shape and (b == a).all()
    zero_d = decode(encode(np.array(3.5, np.float32)))
    assert zero_d.shape == () and zero_d.dtype == np.float32 and zero_d == 3.5
    assert decode(encode(np.empty((0, 7), np.int16))).shape == (0, 7)


def test_bfloat16_arrays_when_ml_dtypes_is_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert same_object(decode(encode(a)), a)


class Color(IntEnum):
    RED = 1


class Mine:
    pass


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({1, 2}, "obj is a set"),
        ({"a": [0, 1, {3}]}, "obj['a'][2] is a set"),
        ([(1, frozenset())], "obj[0][1] is a frozenset"),
        ({"k": Mine()}, f"obj['k'] is a {__name__}.Mine"),
        ([1.5j], "obj[0] is a complex"),
        (bytearray(b"x"), "obj is a bytearray"),
        (OrderedDict(a=1), "obj is a collections.OrderedDict (a subclass"),
        (np.float64(1.0), "obj is a numpy.float64 (a numpy scalar: convert it with .item()"),
        ([np.int64(3)], "obj[0] is a numpy.int64 (a numpy scalar"),
        ({"x": {1.5: 2}}, "obj['x'] has the key 1.5, a float: dict keys must be str or int"),
        ({"x": {True: 2}}, "obj['x'] has the key True, a bool: dict keys must be str or int"),
        ({"x": {(1,): 2}}, "obj['x'] has the key (1,), a tuple"),
        (np.array([object()], dtype=object), "obj is an array of dtype object"),
        (np.zeros(2, [("a", "i4"), ("b", "f4")]), "obj is an array of dtype"),
        (np.zeros(2, "datetime64[s]"), "obj is an array of dtype datetime64[s]"),
        (np.array(["ab"]), "obj is an array of dtype <U2"),
        (np.zeros(2, "V4"), "obj is an array of dtype |V4"),
        (np.ma.masked_array([1, 2]), "obj is a numpy.ma.MaskedArray"),
        (print, "obj is a builtin_function_or_method"),
        (type, "obj is a type"),
    ],
)
def test_anything_else_is_a_type_error_naming_where_it_sits(obj: Any, message: str) -> None:
    with pytest.raises(TypeError) as info:
        encode(obj)
    assert message in str(info.value), str(info.value)


def test_enum_message_names_the_type():
    with pytest.raises(TypeError, match=r"obj is a test_codec\.Color \(a subclass"):
        encode(Color.RED)


def test_self_containing_and_too_deep_objects_are_refused():
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH} levels"):
        encode(loop)
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert same_object(decode(encode(deep)), deep)
    with pytest.raises(ValueError, match="nests deeper"):
        encode([deep])


def test_the_size_limit_is_checked_on_encode_and_on_decode():
    payload = encode(b"x" * 1000)
    assert len(payload) == len(HEADER) + 1 + 8 + 1000
    with pytest.raises(ValueError, match="exceeds max_bytes=1000"):
        encode(b"x" * 1000, max_bytes=1000)
    with pytest.raises(ValueError, match="exceed max_bytes=1000"):
        decode(payload, max_bytes=1000)
    assert decode(payload, max_bytes=len(payload)) == b"x" * 1000
    # An array over the limit is refused before its bytes are copied.
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.float64), shape=(1 << 40,), strides=(0,))
    with pytest.raises(ValueError, match=f"exceeds max_bytes={DEFAULT_MAX_BYTES}"):
        encode(big)


def node(tag: bytes, n: int) -> bytes:
    return tag + U64.pack(n)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "does not start with the object codec's header"),
        (b"AXO\x02N", "does not start with the object codec's header"),
        (pickle.dumps({"a": 1}), "does not start with the object codec's header"),
        (HEADER, "1 bytes needed at offset 4, 0 left"),
        (HEADER + b"Z", "unknown tag 90 at offset 4"),
        (HEADER + b"NN", "1 bytes left after the object"),
        (HEADER + node(b"l", 2**64 - 1), "a count of 18446744073709551615 at offset 5 is too large"),
        (HEADER + node(b"d", 3) + b"N" * 29, "a count of 3"),
        (HEADER + node(b"s", 5) + b"abc", "a count of 5"),
        (HEADER + node(b"b", 2**63), "is too large"),
        (HEADER + node(b"i", 2**40), "is too large"),
        (HEADER + node(b"s", 2) + b"\xff\xfe", "a string is not UTF-8"),
        (HEADER + node(b"d", 1) + b"N" + b"N" * 9, "a dict key at offset 13 is not a str"),
        (HEADER + node(b"d", 2) + (node(b"s", 1) + b"kN") * 2, "the dict key 'k' appears twice"),
        (HEADER + b"f\x00", "8 bytes needed"),
        (HEADER + b"a\x63\x01" + U64.pack(1), "unknown array dtype code 99"),
        (HEADER + b"a\x0c\x41", "an array of 65 dimensions"),
        (
            HEADER + b"a\x0c\x02" + U64.pack(2**40) + U64.pack(2**40),
            "9671406556917033397649408 bytes needed at offset 23",
        ),
        (HEADER + b"a\x0c\x02" + U64.pack(0) + U64.pack(2**63), "an array of shape (0, 9223372036854775808)"),
        (HEADER + b"a\x0c\x01" + U64.pack(3) + b"\x00" * 23, "24 bytes needed"),
        (HEADER + b"l" * 5, "needed"),
        # A bool array (or tensor) is bytes 0 and 1: anything else is no bool numpy or torch should hold.
        (HEADER + b"a\x01\x01" + U64.pack(2) + b"\x01\x02", "a bool array holds a byte other than 0 and 1"),
        (HEADER + b"P\x01\x00" + b"\xff", "a bool array holds a byte other than 0 and 1"),
        (HEADER + b"P\x63\x01" + U64.pack(1), "unknown tensor dtype code 99"),
        (HEADER + b"P\x0c\x41", "an array of 65 dimensions"),
        (HEADER + node(b"d", 1) + b"f" + b"\x00" * 8 + b"N", "key at offset 13 is not a str or an int"),
        (HEADER + (node(b"l", 1)) * (MAX_DEPTH + 2) + b"N", f"nested deeper than {MAX_DEPTH} levels"),
    ],
)  # fmt: skip
def test_the_decoder_refuses_what_is_not_a_payload(payload: bytes, message: str) -> None:
    with pytest.raises(ValueError, match="invalid object payload") as info:
        decode(payload)
    assert message in str(info.value), str(info.value)


@settings(max_examples=400, deadline=None)
@given(objects, st.data())
def test_a_corrupted_or_truncated_payload_is_a_value_error_or_a_carried_object(obj: Any, data: Any) -> None:
    payload = bytearray(encode(obj))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    for candidate in (bytes(payload), bytes(payload[:cut])):
        try:
            got = decode(candidate)
        except ValueError:
            continue
        # Whatever decodes is made of carried types only.
        assert same_object(decode(encode(got)), got)


def test_decoding_never_unpickles_or_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the codec must never unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    before = set(sys.modules)
    obj = {"a": [np.arange(3), (1, "x")], "b": b"\x80\x04"}
    assert same_object(decode(encode(obj)), obj)
    assert set(sys.modules) == before


def test_a_bfloat16_array_without_ml_dtypes_is_a_clear_error(monkeypatch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    payload = encode(np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16))
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if it were not installed
    with pytest.raises(ValueError, match="bfloat16 array; decoding it needs ml_dtypes"):
        decode(payload)
