"""Native core of axonml-distributed (Rust, via PyO3). Hand-written stub, checked with mypy.stubtest."""

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar, Protocol, final

import numpy.typing as npt

# The errors the native calls raise, with their facts as attributes (defined in Python).
from axonml_distributed.exceptions import CollectiveMismatchError as CollectiveMismatchError
from axonml_distributed.exceptions import CollectiveTimeoutError as CollectiveTimeoutError
from axonml_distributed.exceptions import DistributedError as DistributedError
from axonml_distributed.exceptions import PeerFailureError as PeerFailureError

__version__: str
INLINE_BYTES: int
# The shortest job secret the rendezvous takes, in bytes.
JOB_SECRET_MIN_BYTES: int

_Array = npt.NDArray[Any]

class _Tensor(Protocol):
    """A CPU torch.Tensor (torch itself is optional): passed zero-copy through its numpy view."""

    def detach(self) -> Any: ...
    def is_contiguous(self) -> bool: ...

class _Store(Protocol):
    """A key-value store with torch.distributed.Store's methods (TCPStore, FileStore, HashStore, ...)."""

    # bytes are written; torch's own stubs type the value as str (its runtime takes both).
    def set(self, key: str, value: Any, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def check(self, keys: list[str], /) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta, /) -> None: ...
    def add(self, key: str, value: int, /) -> int: ...
    def delete_key(self, key: str, /) -> bool: ...

# What collectives take: a numpy array or a CPU torch tensor. The `*_tensor` calls return the caller's type.
_Buf = _Array | _Tensor

@final
class ReduceOp:
    """How values from the ranks are combined."""

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    AVERAGE: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]  # torch's name for AVERAGE (the same member)
    def __int__(self) -> int: ...  # the core's code: OP_CODES[name]
    def __hash__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...  # the same member, or its code

_Op = ReduceOp | str | None

# The core's tables, for the backends written in Python (MPI): name -> code, as in call signatures.
DTYPE_CODES: dict[str, int]  # "float32" -> ...; also "bfloat16", "bool", "complex64", ...
OP_CODES: dict[str, int]  # "SUM" -> ...; int(ReduceOp.X) == OP_CODES["X"]
KIND_CODES: dict[str, int]  # "all_reduce" -> ...

def check_op(op: ReduceOp | str, dtype: npt.DTypeLike) -> int:
    """The code of `op` when the core allows it on `dtype` (a dtype name, "bfloat16" too, or anything
    `numpy.dtype` takes); else the TypeError a collective raises (e.g. AVERAGE of integers)."""

def validate_ranks(ranks: Sequence[int], world_size: int) -> list[int]:
    """`ranks` sorted, when the core's member check accepts them (not empty, in range, no duplicate);
    else the ValueError a group raises."""

def mismatch_error(
    signatures: Sequence[tuple[int, int, int, int, int, int, float, float] | None], members: Sequence[int]
) -> CollectiveMismatchError | None:
    """The CollectiveMismatchError the native worlds raise (message and facts), given each member's call as
    `(seq, kind, dtype, count, root, op, prescale, postscale)` (codes from the tables above, -1 for a
    field not set, factors 1.0 when not scaled; `root` is a global rank) or None for a member that
    entered no call; None when every member agrees."""

def layout_mismatch_error(
    signature: tuple[int, int, int, int, int, int, float, float],
    layouts: Sequence[Sequence[int]],
    members: Sequence[int],
) -> CollectiveMismatchError | None:
    """The CollectiveMismatchError the native worlds raise (message and facts) when the members of a call with
    per-member sizes, whose (agreed) signature is `signature`, published `layouts` (each member's layout
    words from `ProcessGroup.call_check`, in group order); None when they agree."""

# The shared-memory segment, for the launcher and the stale-segment cleanup: names are
# SEGMENT_PREFIX + "<uid>-<job>", files SEGMENT_DIR + name; the header (little endian) starts with these
# fields.
SEGMENT_PREFIX: str
SEGMENT_DIR: str
SEGMENT_MAGIC: int
SEGMENT_VERSION: int
SEGMENT_HEADER: dict[str, tuple[int, int]]  # "magic", "version", "world", "uid", "creator" -> (offset, bytes)

def flight_records() -> list[dict[str, Any]]:
    """Every flight recorder of this process (one per rank and communicator it is a member of): "rank",
    "world_size", "ranks", "occurrence", "index", "world", "world_ordinal", and "entries", its last
    calls, oldest first (each: "record_id", "kind", "call", "dtype", "count", "bytes", "seq", "root",
    "op", "p2p", for a send or receive "peer", "any_source", "tag", then "frames" (the caller's stack
    as [{"name", "filename", "line"}], innermost first, or None), "input_elems", "output_elems",
    "state", "created_ns", "started_ns", "completed_ns", "route")."""

@final
class FlightCall:
    """A call a `FlightRecorder` recorded, scheduled: mark it started and ended."""

    def started(self) -> None:
        """Every member arrived: it moves data from now on."""

    def end(self, ok: bool, route: str | None = None, source: int | None = None) -> None:
        """It returned, successfully (`ok`) or not, carried by `route` ("mpi", "gloo", ...); `source`: the
        sender of a receive from any source. A second end is ignored."""

@final
class FlightRecorder:
    """The flight recorder of a group whose calls Python drives (the MPI group, the gloo legs across
    hosts), in the engine's recorder: `flight_records`, the timeline and `trace analyze` see its calls."""

    def __new__(cls, world: str, rank: int, world_size: int, ranks: Sequence[int]) -> FlightRecorder:
        """Global rank `rank`'s recorder of the group over `ranks` (global, in the group's order), the
        first group of a new world of `world_size` ranks carried by `world` ("mpi" or "hosts")."""

    def new_group(self, ranks: Sequence[int]) -> FlightRecorder:
        """The recorder of this rank's next group over `ranks`, in the same world."""

    def collective(
        self,
        kind: str,
        seq: int,
        dtype: int | str | None,
        count: int,
        root: int | None = None,
        op: ReduceOp | int | str | None = None,
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> FlightCall:
        """Record collective `kind` number `seq` (alike on every member) as scheduled now: `count`
        elements of `dtype` (a code, or a name such as "float32" or "torch.float32"; one the core does not
        know is recorded as none) each member's part, `root` a global rank, `op` a ReduceOp, a code
        (-1: none) or name. This member's input and output elements follow from the kind and the
        group (ValueError when they overflow)."""

    def p2p(self, send: bool, peer: int | None, tag: int, dtype: int | str, count: int) -> FlightCall:
        """Record a send (`send`) or receive of `count` x `dtype` (as `collective` takes it) with global
        rank `peer` (None: a receive from any source) and `tag` as scheduled now."""

    def stats(self) -> dict[str, dict[str, Any]]:
        """Totals per kind, as `ProcessGroup.stats()`."""

def set_timeline(on: bool) -> None:
    """Turn the timeline on or off: while on, every recorder of this process logs each call it finishes
    (and each gradient bucket reduced), until `take_timeline`."""

def take_timeline() -> list[dict[str, Any]]:
    """What every recorder logged for the timeline since the last take, as `flight_records` gives them
    (its finished calls as "entries", oldest first) with "buckets": the gradient buckets reduced over
    the communicator ("bucket", "bytes", "ready_ns", "launched_ns", "done_ns", "ok")."""

def wall_ns() -> int:
    """Now, on the recorders' clock: wall-clock nanoseconds since the Unix epoch."""

def segment_name(job_id: str) -> str:
    """The ``shm_open`` name of job `job_id`'s segment (this user's effective uid and the job id)."""

def check_job_secret(secret: bytes) -> None:
    """Refuse a job secret the rendezvous would refuse (shorter than JOB_SECRET_MIN_BYTES): ValueError."""

def checked_timeout(seconds: float | timedelta | None = None) -> float:
    """`seconds` (a number or a timedelta) checked as every native timeout is (positive, at most about
    31 years; None: 300), in seconds."""

@final
class Backend:
    """One rank's handle on a world. Calls block, with the GIL released, until every member arrives."""

    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def name(self) -> str: ...
    # Every collective is a ProcessGroup method (`ProcessGroup(backend)`); a backend keeps these two.
    def all_reduce(self, buf: _Buf, op: _Op = None) -> None: ...
    def barrier(self) -> None: ...
    def send(self, buf: _Buf, dst: int, tag: int = 0) -> None: ...
    def recv(self, buf: _Buf, src: int, tag: int = 0) -> None: ...
    def recv_any(self, buf: _Buf, tag: int = 0) -> int: ...
    def abort(self, reason: str) -> None: ...
    def leave(self) -> None: ...

@final
class ThreadBackend:
    """The in-process world: each rank is a thread; collectives exchange data through the callers' arrays."""

    @staticmethod
    def create_world(n: int, timeout: float | None = None) -> list[Backend]: ...
    @staticmethod
    def single(timeout: float | None = None) -> Backend: ...

@final
class ShmBackend:
    """Joins the multi-process world on this host, through a shared-memory segment."""

    @staticmethod
    def connect(
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout: float | None = None,
        job_id: str | None = None,
        arena_bytes: int | None = None,
        secret: bytes | None = None,
    ) -> Backend: ...
    @staticmethod
    def join(
        store: _Store,
        rank: int,
        world_size: int,
        timeout: float | None = None,
        job_id: str | None = None,
        arena_bytes: int | None = None,
        secret: bytes | None = None,
    ) -> Backend: ...

@final
class SegmentMemory:
    """Keeps segment memory alive: the base object of the arrays `ProcessGroup.empty` makes with "shm"."""

@final
class Work:
    """The handle of an asynchronous collective."""

    def wait(self) -> _Array | int | None: ...
    def is_completed(self) -> bool: ...
    def source_rank(self) -> int: ...

@final
class ProcessGroup:
    """A group of ranks as seen from this rank: collectives involve only its members. Ranks are global."""

    def __new__(
        cls, backend: Backend, ranks: Sequence[int] | None = None, timeout: float | timedelta | None = None
    ) -> ProcessGroup: ...
    @staticmethod
    def with_ranks(
        backend: Backend, ranks: Sequence[int], timeout: float | timedelta | None = None
    ) -> ProcessGroup: ...
    # In check mode, for a backend written in Python (MPI): each method takes what it takes on any group
    # and raises what it would for bad arguments, or returns, running nothing, the call's
    # `(dtype, count, root, op, layout)` (codes from the tables above, `root` a group index, -1 for a
    # field the call has not; `layout` the words of a collective with per-member sizes, else None).
    @staticmethod
    def call_check(ranks: Sequence[int], rank: int, world_size: int) -> ProcessGroup: ...
    def backend(self) -> Backend: ...
    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def size(self) -> int: ...
    def ranks(self) -> list[int]: ...
    def sequence_number(self) -> int: ...
    # This rank's totals per kind it called on the group (collectives, "send", "recv"): {"all_reduce":
    # {"calls", "failed", "bytes", "wait_s", "move_s", "routes": {"oneshot": n, ...}}, ...}; {} on a
    # non-member.
    def stats(self) -> dict[str, dict[str, Any]]: ...
    def contains(self, rank: int) -> bool: ...
    def group_rank(self, rank: int) -> int: ...
    def new_group(self, ranks: Sequence[int], timeout: float | timedelta | None = None) -> ProcessGroup: ...
    def timeout(self) -> float: ...
    def empty(self, shape: Any, dtype: npt.DTypeLike) -> _Array: ...
    def all_reduce(
        self,
        buf: _Buf,
        op: _Op = None,
        *,
        out: _Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> Work | None: ...
    def broadcast(self, buf: _Buf, src: int | None = None, *, async_op: bool = False) -> Work | None: ...
    def all_gather(self, send: _Buf, recv: _Buf, *, async_op: bool = False) -> Work | None: ...
    def reduce_scatter(
        self, send: _Buf, recv: _Buf, op: _Op = None, *, async_op: bool = False
    ) -> Work | None: ...
    def gather(self, send: _Buf, recv: _Buf | None, dst: int, *, async_op: bool = False) -> Work | None: ...
    def scatter(self, send: _Buf | None, recv: _Buf, src: int, *, async_op: bool = False) -> Work | None: ...
    def reduce(
        self,
        buf: _Buf,
        dst: int,
        op: _Op = None,
        *,
        out: _Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> Work | None: ...
    def barrier(self, *, async_op: bool = False) -> Work | None: ...
    def monitored_barrier(
        self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False
    ) -> None: ...
    def all_to_all(self, send: _Buf, recv: _Buf, *, async_op: bool = False) -> Work | None: ...
    def all_to_all_single(
        self,
        send: _Buf,
        recv: _Buf,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Work | None: ...
    def all_gather_v(
        self, send: _Buf, recv: _Buf, counts: Sequence[int], *, async_op: bool = False
    ) -> Work | None: ...
    def gather_v(
        self, send: _Buf, recv: _Buf | None, counts: Sequence[int], dst: int, *, async_op: bool = False
    ) -> Work | None: ...
    def scatter_v(
        self, send: _Buf | None, recv: _Buf, counts: Sequence[int], src: int, *, async_op: bool = False
    ) -> Work | None: ...
    def reduce_scatter_v(
        self, send: _Buf, recv: _Buf, counts: Sequence[int], op: _Op = None, *, async_op: bool = False
    ) -> Work | None: ...
    def send(self, buf: _Buf, dst: int, tag: int = 0, *, async_op: bool = False) -> Work | None: ...
    def recv(self, buf: _Buf, src: int, tag: int = 0, *, async_op: bool = False) -> Work | None: ...
    # Returns the sender's global rank; with async_op, a Work whose wait() and source_rank() do.
    def recv_any(self, buf: _Buf, tag: int = 0, *, async_op: bool = False) -> int | Work: ...
    def all_reduce_tensor(
        self,
        t: _Buf,
        op: _Op = None,
        *,
        out: _Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> Any: ...
    def broadcast_tensor(self, t: _Buf, src: int | None = None, *, async_op: bool = False) -> Any: ...
    def all_gather_tensor(self, t: _Buf, *, out: _Buf | None = None, async_op: bool = False) -> Any: ...
    def reduce_scatter_tensor(
        self, t: _Buf, op: _Op = None, *, out: _Buf | None = None, async_op: bool = False
    ) -> Any: ...
    def send_tensor(self, t: _Buf, dst: int, tag: int = 0, *, async_op: bool = False) -> Work | None: ...
    def recv_tensor(
        self, shape: Any, dtype: npt.DTypeLike, src: int, tag: int = 0, *, async_op: bool = False
    ) -> Any: ...

@final
class World:
    """The world: the default group over every rank, and the factory of subgroups."""

    def __new__(cls, backend: Backend) -> World: ...
    @staticmethod
    def init(backend: Backend) -> World: ...
    def default_group(self) -> ProcessGroup: ...
    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def is_main(self) -> bool: ...
    def barrier(self) -> None: ...
    def new_group(self, ranks: Sequence[int], timeout: float | timedelta | None = None) -> ProcessGroup: ...

@final
class GradientBucket:
    """A fixed-capacity flat buffer of gradients of one dtype; `data_mut()` is a zero-copy view of it."""

    def __new__(cls, capacity: int) -> GradientBucket: ...
    def add(self, grad: _Buf) -> bool: ...
    def is_full(self) -> bool: ...
    def is_empty(self) -> bool: ...
    def size(self) -> int: ...
    def capacity(self) -> int: ...
    def data(self) -> _Array: ...
    def data_mut(self) -> _Array: ...
    def extract(self) -> list[_Array]: ...
    def clear(self) -> None: ...

@final
class GradSyncStrategy:
    """When a `GradientSynchronizer` reduces its buckets."""

    SYNCHRONOUS: ClassVar[GradSyncStrategy]
    OVERLAPPED: ClassVar[GradSyncStrategy]
    NO_SYNC: ClassVar[GradSyncStrategy]
    def __int__(self) -> int: ...

def assign_buckets(nbytes: Sequence[int], dtypes: Sequence[Any], cap_bytes: int) -> list[list[int]]:
    """Parameter positions grouped into buckets, in reduction order: reverse order, one bucket per dtype
    (values compared with ==) at a time, closed before it would pass `cap_bytes`."""

@final
class BucketMemory:
    """Keeps a synchronizer's bucket alive: the base object of its gradient views."""

def set_default_group_source(get_default_group: Any) -> None:
    """What `GradientSynchronizer.sync_all()` calls for a group when given none (the package passes its
    `get_default_group` on import; the native module never imports the package)."""

@final
class GradientSynchronizer:
    """Buckets gradients and averages them across a group, in place."""

    def __new__(
        cls, strategy: GradSyncStrategy = ..., bucket_size: int | None = None
    ) -> GradientSynchronizer: ...
    def strategy(self) -> GradSyncStrategy: ...
    def bucket_size(self) -> int: ...
    def num_buckets(self) -> int: ...
    def launched_buckets(self) -> int: ...
    @staticmethod
    def for_parameters(
        process_group: Any, parameters: Sequence[tuple[Sequence[int], Any]], bucket_cap_bytes: int
    ) -> GradientSynchronizer: ...
    def bucket_assignment(self) -> list[list[int]]: ...
    def in_shared_memory(self) -> bool: ...
    def views(self) -> list[_Array]: ...
    def ready(self, i: int) -> None: ...
    def is_ready(self, i: int) -> bool: ...
    def in_flight(self) -> bool: ...
    def waiting(self) -> list[int]: ...
    def finish(self, used: Sequence[bool], exchange: bool) -> list[bool] | None: ...
    def prepare(self, num_params: int, process_group: Any = None) -> None: ...
    def add_gradient(self, bucket_idx: int, grad: _Buf) -> None: ...
    def sync_all(self, process_group: Any = None) -> None: ...
    def begin_step(self) -> None: ...
    # {"totals": step figures summed ("step": the number of steps), "last": the last steps, oldest
    # first}; each with "step", "start_ns", "compute_s", "visible_sync_s", "overlapped_sync_s",
    # "comm_s", "bytes", "buckets" (see axonml_distributed.ddp_stats).
    def stats(self) -> dict[str, Any]: ...
    def clear(self) -> None: ...

__all__ = [
    "BucketMemory",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
    "DTYPE_CODES",
    "INLINE_BYTES",
    "JOB_SECRET_MIN_BYTES",
    "KIND_CODES",
    "OP_CODES",
    "SEGMENT_DIR",
    "SEGMENT_HEADER",
    "SEGMENT_MAGIC",
    "SEGMENT_PREFIX",
    "SEGMENT_VERSION",
    "__version__",
    "Backend",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "PeerFailureError",
    "ProcessGroup",
    "ReduceOp",
    "SegmentMemory",
    "ThreadBackend",
    "ShmBackend",
    "Work",
    "World",
    "check_op",
    "flight_records",
    "FlightCall",
    "FlightRecorder",
    "set_timeline",
    "take_timeline",
    "wall_ns",
    "check_job_secret",
    "checked_timeout",
    "layout_mismatch_error",
    "mismatch_error",
    "segment_name",
    "assign_buckets",
    "set_default_group_source",
    "validate_ranks",
]
