"""axonml-distributed: data-parallel training on CPUs.

Real collectives (every rank waits for every other, results bitwise identical on all ranks) over an
in-process world of threads (`spawn`, `ThreadBackend`), a shared-memory world of processes on one host
(`init_process_group("shm")` under `axonml-run`), or MPI (`init_process_group("mpi")` under mpiexec);
process groups and subgroups; `DistributedDataParallel` for numpy models and torch modules; Horovod's
`broadcast_parameters`, `broadcast_optimizer_state` and `DistributedOptimizer` for torch scripts;
object collectives (`broadcast_object` ...) through a restricted codec, never pickle; a flight recorder
of every rank's last calls, always on (`dump_flight_recorder`, `python -m axonml_distributed.trace`);
a timeline of every call as a Chrome trace (`timeline`, AXONML_TIMELINE, `trace_span`).
"""

from axonml_distributed._core import (
    Backend,
    GradientBucket,
    GradientSynchronizer,
    GradSyncStrategy,
    ProcessGroup,
    ReduceOp,
    ThreadBackend,
    Work,
    World,
    __version__,
)
from axonml_distributed.comm import (
    all_gather,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    barrier,
    broadcast,
    broadcast_from,
    gather_tensor,
    get_rank,
    get_world_size,
    is_main_process,
    monitored_barrier,
    new_group,
    rank,
    reduce_scatter_mean,
    reduce_scatter_sum,
    scatter_tensor,
    sync_gradient,
    sync_gradients,
    world_size,
)
from axonml_distributed.ddp import DDP, DistributedDataParallel
from axonml_distributed.ddp_stats import DDPStats, StepStats
from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    PeerFailureError,
    SpawnError,
)
from axonml_distributed.horovod import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from axonml_distributed.init import (
    destroy_process_group,
    get_default_group,
    init_process_group,
    is_initialized,
)
from axonml_distributed.objects import (
    all_gather_object,
    broadcast_object,
    gather_object,
    recv_object,
    scatter_object,
    send_object,
)
from axonml_distributed.sampler import DistributedSampler
from axonml_distributed.spawn import spawn
from axonml_distributed.trace import dump_flight_recorder, timeline, trace_span
from axonml_distributed.trace.timeline_file import from_environment as _timeline_from_environment

__all__ = [
    "Backend",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DDP",
    "DDPStats",
    "DistributedDataParallel",
    "DistributedError",
    "DistributedOptimizer",
    "DistributedSampler",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
    "ThreadBackend",
    "PeerFailureError",
    "ProcessGroup",
    "ReduceOp",
    "SpawnError",
    "StepStats",
    "Work",
    "World",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_product",
    "all_reduce_sum",
    "barrier",
    "broadcast",
    "broadcast_from",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "destroy_process_group",
    "dump_flight_recorder",
    "gather_object",
    "gather_tensor",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "is_main_process",
    "monitored_barrier",
    "new_group",
    "rank",
    "recv_object",
    "reduce_scatter_mean",
    "reduce_scatter_sum",
    "scatter_object",
    "scatter_tensor",
    "send_object",
    "spawn",
    "sync_gradient",
    "sync_gradients",
    "timeline",
    "trace_span",
    "world_size",
]

# AXONML_TIMELINE: the process's timeline, from here to its exit.
_timeline_from_environment()
