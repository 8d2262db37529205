"""MPI process group: the package's ProcessGroup methods, carried by MPI through mpi4py.

For jobs that span hosts (or already live under `mpiexec`). Launch with
`mpiexec -n N python -m mpi4py train.py`: `-m mpi4py` turns an unhandled exception on any rank into
MPI_Abort, so the job ends instead of hanging in a collective.

- Only mpi4py's buffer API with `MPI.IN_PLACE`; nothing is pickled. Buffers are numpy arrays or CPU torch
  tensors, used in place through their memory (``t.detach().numpy()``, zero-copy); the *_tensor
  operations return a tensor when given one.
- AVERAGE (also ReduceOp.AVG, "avg", "mean") is MPI SUM followed by a division by the group size
  (floating and complex dtypes only). BAND/BOR/BXOR are MPI's; on bool (MPI C_BOOL) every op is MPI's
  logical one (SUM and MAX LOR, PRODUCT and MIN LAND, BXOR LXOR), as the core defines them.
- float16 and bfloat16 (ml_dtypes' numpy arrays; torch's bfloat16 tensors have no numpy view, so not
  here): MPI has no 16-bit float arithmetic, so reductions widen to float32, reduce, and round once;
  operations that only move bytes send the 16-bit patterns unchanged.
- prescale_factor/postscale_factor: the input is multiplied into the reduction buffer (for out=, into
  out; off a reduce's root, into a scratch copy) once the signatures agree, the result after MPI (and
  after AVERAGE's division); complex numbers part by part, as the core. out= without a prescale factor
  is MPI's own Allreduce(send, recv) / Reduce(send, recv).
- Timeouts: every operation is issued non-blocking and completed by a Test loop with a deadline. MPI
  cannot cancel a collective, so a rank whose deadline passes prints a CollectiveTimeoutError naming the
  operation and calls MPI_Abort: the whole job dies (and should the launcher not end it, the rank exits
  with status 1 after 5 s). Creating a communicator (`init_mpi_process_group`,
  `new_group`) has no such form: the ranks first wait, with the deadline, until every member has
  arrived (an empty message to and from each, on the largest tag MPI allows, which send and recv
  therefore refuse), and a rank that never arrives is named in the CollectiveTimeoutError.
  `monitored_barrier` is the exception: it raises its CollectiveTimeoutError (naming the missing ranks,
  found by that same exchange once its deadline passed) to the caller, and the group is then unusable:
  its next use, or the interpreter's exit, calls MPI_Abort saying why.
- Signature check (on by default): before data moves, the ranks agree on (kind, dtype, count, root, op,
  scaling factors, sequence number) with one small float64 SUM-allreduce, the same MPI call on every
  rank (a persistent one with MPI 4; see `check_signatures` in mpi.check); on disagreement every rank
  raises CollectiveMismatchError naming the ranks that differ, no data moves, and the group stays usable.
  A rank whose arguments are invalid takes part with an "invalid" signature and raises its
  TypeError/ValueError, so its peers fail at once instead of timing out. Without the check, mismatched
  calls are undefined behaviour in MPI. A blocking SUM/AVERAGE all_reduce of at most 8 float32/float64
  elements rides along with the check when every rank's does: one MPI call in all (float32 is summed in
  float64 and rounded once). Its cost: `python -m axonml_distributed.bench --backend mpi`.
- Small messages: Python overhead is most of the time of an 8-byte all_reduce, so a blocking all_reduce
  with nothing pending takes a short path (`_all_reduce_now`) and waits start with a tight Test spin.
- Several hosts: a job spanning hosts with as many ranks (more than one) on each gets an
  `MpiHostsProcessGroup` (`mpi.hosts`), whose large all_reduces run through our shared memory inside
  each host and MPI between hosts; every other call is the flat group's.
"""

from __future__ import annotations

try:
    from mpi4py import MPI  # noqa: F401 - imported first, for the error below
except (ImportError, RuntimeError) as exc:  # RuntimeError: mpi4py found no MPI library to load
    raise ImportError(
        'the MPI backend needs mpi4py and an MPI library: pip install "axonml-distributed[mpi]"',
        name="mpi4py",
    ) from exc

from axonml_distributed.mpi.group import MpiProcessGroup
from axonml_distributed.mpi.hosts import MpiHostsProcessGroup
from axonml_distributed.mpi.queue import MpiWork
from axonml_distributed.mpi.world import init_mpi_process_group

__all__ = ["MpiHostsProcessGroup", "MpiProcessGroup", "MpiWork", "init_mpi_process_group"]
