"""The restricted codec of the object collectives: a fixed set of plain types, never pickle.

`encode` takes None, bool, int (any size), float, str, bytes, list, tuple, dict with str or int keys
(a torch optimizer's ``state_dict()`` keys its state by parameter index), numpy arrays of numeric or bool
dtypes (bfloat16 too, with ml_dtypes) and CPU torch tensors of those dtypes (not requiring grad);
anything else (a set, a numpy scalar, an object array, a subclass of the types above such as an
``nn.Parameter`` ...) is a TypeError naming the type and where it sits (``obj['a'][2] is a set``). Types
are exact, so what `decode` returns equals what was encoded, with the same types; arrays and tensors
come back C-ordered, writable and native-endian, tensors with their dtype and shape.

`decode` trusts nothing: every length is checked against the bytes that remain before anything is
allocated, nesting is bounded, unknown tags, bad UTF-8, duplicate dict keys and trailing bytes are
errors (ValueError), a bool array holds only 0 and 1, and nothing of the payload's choosing is ever
executed or imported (a bfloat16 array loads ml_dtypes, the one module that gives numpy that dtype, and a
tensor loads torch). Both sides refuse payloads over `max_bytes` (64 MiB by default).

The format: ``b"AXO" + version``, then one value. A value is a one-byte tag and its body; lengths and
counts are little-endian u64, ints little-endian two's complement, floats IEEE-754 binary64, arrays
and tensors ``dtype code, ndim, dims, data`` and a dict's keys the str or int values before each item.
"""

from __future__ import annotations

import importlib
import struct
import sys
from typing import Any

import numpy as np

DEFAULT_MAX_BYTES = 64 << 20
# Deep enough for any configuration or state dict; a list that contains itself stops here too.
MAX_DEPTH = 100
_MAGIC = b"AXO\x01"
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_DIMS_MAX = 64  # numpy's own limit

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST, _TUPLE, _DICT, _ARRAY, _TENSOR = b"NFTifsbltdaP"


_NAMES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
# Array dtypes by wire code (little-endian), and back by dtype name. bfloat16 is ml_dtypes' type, looked
# up only when one is sent or arrives: importing ml_dtypes takes a second.
_DTYPES = {code: np.dtype(name).newbyteorder("<") for code, name in enumerate(_NAMES, 1)}
_BFLOAT16 = len(_NAMES) + 1
_CODES = {dt.name: code for code, dt in _DTYPES.items()} | {"bfloat16": _BFLOAT16}


def _dtype(code: int) -> np.dtype[Any] | None:
    """The dtype of wire code `code`; None for an unknown code (or bfloat16 without ml_dtypes)."""
    if code != _BFLOAT16:
        return _DTYPES.get(code)
    try:
        return np.dtype(importlib.import_module("ml_dtypes").bfloat16)
    except ImportError:
        return None


# The exact types carried: a subclass (an IntEnum, an OrderedDict, a numpy matrix) is refused, so that
# what comes out is what went in.
_CARRIED = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict, np.ndarray})


def encode(obj: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The payload of `obj`; TypeError for a type the codec does not carry, ValueError when the
    payload would exceed `max_bytes`."""
    out = _Writer(max_bytes)
    out.add(_MAGIC)
    out.value(obj, "obj", 0)
    return b"".join(out.parts)


class _Writer:
    def __init__(self, max_bytes: int) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.max_bytes = max_bytes

    def add(self, part: bytes) -> None:
        self.reserve(len(part))
        self.parts.append(part)

    def reserve(self, n: int) -> None:
        # Checked before the bytes are made, so an oversized array is never copied.
        self.size += n
        if self.size > self.max_bytes:
            raise ValueError(
                f"the encoded object exceeds max_bytes={self.max_bytes} bytes; pass a larger max_bytes "
                "(on every rank) to send it"
            )

    def length(self, tag: int, n: int) -> None:
        self.add(bytes((tag,)) + _U64.pack(n))

    def value(self, obj: object, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(f"{path} nests deeper than {MAX_DEPTH} levels (or contains itself)")
        if _is_plain_tensor(obj):
            self.tensor(obj, path)
            return
        if type(obj) not in _CARRIED:
            raise TypeError(f"{path} is {_a(obj)}{_hint(obj)}")
        if obj is None:
            self.add(bytes((_NONE,)))
        elif isinstance(obj, bool):
            self.add(bytes((_TRUE if obj else _FALSE,)))
        elif isinstance(obj, int):
            self.integer(obj)
        elif isinstance(obj, float):
            self.add(bytes((_FLOAT,)) + _F64.pack(obj))
        elif isinstance(obj, str):
            self.blob(_STR, obj.encode("utf-8", "surrogatepass"))
        elif isinstance(obj, bytes):
            self.blob(_BYTES, obj)
        elif isinstance(obj, list | tuple):
            self.length(_LIST if isinstance(obj, list) else _TUPLE, len(obj))
            for i, item in enumerate(obj):
                self.value(item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            self.length(_DICT, len(obj))
            for key, item in obj.items():
                if type(key) is str:
                    self.blob(_STR, key.encode("utf-8", "surrogatepass"))
                elif type(key) is int:
                    self.integer(key)
                else:
                    raise TypeError(f"{path} has the key {key!r}, {_a(key)}: dict keys must be str or int")
                self.value(item, f"{path}[{_key(key)}]", depth + 1)
        else:
            assert isinstance(obj, np.ndarray)
            self.array(obj, path)

    def blob(self, tag: int, data: bytes) -> None:
        self.length(tag, len(data))
        self.add(data)

    def integer(self, n: int) -> None:
        self.blob(_INT, n.to_bytes((n + (n < 0)).bit_length() // 8 + 1, "little", signed=True))

    def array(self, a: np.ndarray, path: str) -> None:
        code = _CODES.get(a.dtype.name) if a.dtype.fields is None else None
        if code is None:
            raise TypeError(
                f"{path} is an array of dtype {a.dtype}, which the object codec does not carry "
                "(numeric and bool dtypes only)"
            )
        self.header(_ARRAY, code, a.shape, a.nbytes)
        self.parts.append(np.ascontiguousarray(a, _dtype(code)).tobytes())

    def tensor(self, t: Any, path: str) -> None:
        torch = sys.modules["torch"]
        name = str(t.dtype).removeprefix("torch.")
        code = _CODES.get(name)
        if t.layout != torch.strided or t.device.type != "cpu" or t.requires_grad or code is None:
            raise TypeError(
                f"{path} is a torch.Tensor of dtype {name} on {t.device} ({t.layout}"
                f"{', requiring grad' if t.requires_grad else ''}): the object codec carries dense CPU "
                "tensors of numeric and bool dtypes that do not require grad (send t.detach().cpu())"
            )
        self.header(_TENSOR, code, tuple(t.shape), t.numel() * t.element_size())
        # bfloat16 travels as its 16-bit patterns (numpy has no bfloat16 without ml_dtypes).
        plain = t.resolve_conj().resolve_neg()
        a = (plain.view(torch.int16) if code == _BFLOAT16 else plain).numpy()
        self.parts.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())

    def header(self, tag: int, code: int, shape: tuple[int, ...], nbytes: int) -> None:
        self.add(bytes((tag, code, len(shape))) + b"".join(_U64.pack(d) for d in shape))
        self.reserve(nbytes)  # before the data is copied


def _is_plain_tensor(obj: object) -> bool:
    # A tensor can only exist once torch is imported: the codec never imports it to encode.
    torch = sys.modules.get("torch")
    return torch is not None and type(obj) is torch.Tensor


def _key(key: str | int) -> str:
    """A dict key as paths show it (an int key of thousands of digits has no repr)."""
    if isinstance(key, int) and key.bit_length() > 64:
        return f"<an int of {key.bit_length()} bits>"
    return repr(key)


def _a(obj: object) -> str:
    """ "a set", "an int", "a numpy.float64": the type of `obj` as messages name it."""
    kind = type(obj)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _hint(obj: object) -> str:
    if isinstance(obj, np.generic):
        return " (a numpy scalar: convert it with .item(), or send a 0-d array)"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return " (a tensor subclass: send a plain torch.Tensor, t.detach())"
    if isinstance(obj, int | float | str | bytes | list | tuple | dict | np.ndarray):
        return " (a subclass: the object codec carries the exact built-in types only)"
    return (
        " (the object codec carries None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and "
        "torch tensors)"
    )


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The object in `data` (a payload from `encode`), or ValueError for anything that is not one."""
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise ValueError(f"invalid object payload: {len(view)} bytes exceed max_bytes={max_bytes}")
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise ValueError("invalid object payload: it does not start with the object codec's header")
    reader = _Reader(view, len(_MAGIC))
    obj = reader.value(0)
    if reader.pos != len(view):
        raise ValueError(f"invalid object payload: {len(view) - reader.pos} bytes left after the object")
    return obj


class _Reader:
    def __init__(self, view: memoryview, pos: int) -> None:
        self.view = view
        self.pos = pos

    def take(self, n: int) -> memoryview:
        if n > len(self.view) - self.pos:
            raise ValueError(
                f"invalid object payload: {n} bytes needed at offset {self.pos}, "
                f"{len(self.view) - self.pos} left (truncated or corrupted)"
            )
        part = self.view[self.pos : self.pos + n]
        self.pos += n
        return part

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def count(self, least: int) -> int:
        """A count of items of at least `least` bytes each, checked against what remains."""
        n = self.u64()
        if n * least > len(self.view) - self.pos:
            raise ValueError(f"invalid object payload: a count of {n} at offset {self.pos - 8} is too large")
        return n

    def text(self) -> str:
        try:
            return str(self.take(self.count(1)), "utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise ValueError(f"invalid object payload: a string is not UTF-8 ({exc.reason})") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"invalid object payload: nested deeper than {MAX_DEPTH} levels")
        tag = self.take(1)[0]
        if tag == _NONE:
            return None
        if tag in (_FALSE, _TRUE):
            return tag == _TRUE
        if tag == _INT:
            return self.integer()
        if tag == _FLOAT:
            return float(_F64.unpack(self.take(8))[0])
        if tag == _STR:
            return self.text()
        if tag == _BYTES:
            return bytes(self.take(self.count(1)))
        if tag in (_LIST, _TUPLE):
            items = [self.value(depth + 1) for _ in range(self.count(1))]
            return items if tag == _LIST else tuple(items)
        if tag == _DICT:
            return self.mapping(depth)
        if tag == _ARRAY:
            return self.array()
        if tag == _TENSOR:
            return self.tensor()
        raise ValueError(f"invalid object payload: unknown tag {tag} at offset {self.pos - 1}")

    def mapping(self, depth: int) -> dict[str | int, Any]:
        out: dict[str | int, Any] = {}
        key: str | int
        for _ in range(self.count(1 + 8 + 1)):  # a key's tag and length, an item's tag
            tag = self.take(1)[0]
            if tag == _STR:
                key = self.text()
            elif tag == _INT:
                key = self.integer()
            else:
                raise ValueError(
                    f"invalid object payload: a dict key at offset {self.pos - 1} is not a str or an int"
                )
            if key in out:
                raise ValueError(f"invalid object payload: the dict key {_key(key)} appears twice")
            out[key] = self.value(depth + 1)
        return out

    def integer(self) -> int:
        return int.from_bytes(self.take(self.count(1)), "little", signed=True)

    def array(self) -> np.ndarray:
        code, ndim = self.take(2)
        dtype = _dtype(code)
        if dtype is None and code == _BFLOAT16:
            raise ValueError("the object payload holds a bfloat16 array; decoding it needs ml_dtypes")
        if dtype is None:
            raise ValueError(f"invalid object payload: unknown array dtype code {code}")
        return self.data(dtype, ndim)

    def tensor(self) -> Any:
        code, ndim = self.take(2)
        # bfloat16 arrives as its 16-bit patterns, viewed as bfloat16 by torch itself.
        dtype = _DTYPES.get(code, np.dtype("<i2") if code == _BFLOAT16 else None)
        if dtype is None:
            raise ValueError(f"invalid object payload: unknown tensor dtype code {code}")
        a = self.data(dtype, ndim)
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            raise ValueError("the object payload holds a torch tensor; decoding it needs torch") from None
        t = torch.from_numpy(a)
        return t.view(torch.bfloat16) if code == _BFLOAT16 else t

    def data(self, dtype: np.dtype[Any], ndim: int) -> np.ndarray:
        """An array's dims and data (after its dtype code and ndim), as a new native-endian array."""
        if ndim > _DIMS_MAX:
            raise ValueError(f"invalid object payload: an array of {ndim} dimensions")
        shape = tuple(self.u64() for _ in range(ndim))
        n = 1
        for d in shape:
            n *= d
        data = self.take(n * dtype.itemsize)  # checked against what remains before anything is allocated
        if dtype == np.bool_ and np.frombuffer(data, np.uint8).max(initial=0) > 1:
            raise ValueError("invalid object payload: a bool array holds a byte other than 0 and 1")
        try:
            return np.frombuffer(data, dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)
        except (ValueError, OverflowError):  # an empty array with a dimension numpy cannot hold
            raise ValueError(f"invalid object payload: an array of shape {shape}") from None
