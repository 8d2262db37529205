"""A torch.distributed backend, "axonml": unchanged PyTorch scripts on the shared-memory world.

torch finds it through this package's entry points (see `axonml_distributed.torch_entry`: at ``import
torch`` from torch 2.5, and the first time a script names it from torch 2.14), so scripts need no import
of ours; ``import axonml_distributed.torch`` registers it explicitly (for a torch whose autoload is
turned off). Importing ``axonml_distributed`` alone registers nothing and never loads torch. Then
``torch.distributed.init_process_group("axonml")`` (or ``"cpu:axonml"``) joins the shared-memory world
of this host with any init method (``env://`` under torchrun or axonml-run, ``tcp://``, ``file://``),
and torch's DDP, object collectives and the rest of ``torch.distributed`` run on our core.

Rendezvous goes through the Store torch hands the backend, never through a socket of ours, by the
core's one rendezvous protocol (the one axonml-run's jobs run over rank 0's own store): the ranks meet
in the store, rank 0 refuses a job spread over several hosts, creates the segment and hands out its
token (name, session nonce, world size); every rank joins with it. The Store is the trust boundary:
torch's TCPStore is unauthenticated, so whoever reaches it learns the segment's name, but the segment is
a 0600 file of this user (checked on attach) and the nonce ties it to this job. With a job secret
(AXONML_JOB_SECRET, which axonml-run sets) every rank proves to rank 0 that it knows it and rank 0 proves
it back, as in the shm world: a rank of another job or with another secret is refused.

Tensors: CPU tensors of float32, float64, float16, bfloat16, int8, uint8, int32, int64 and bool are
handed to the core in place (zero copy). Non-contiguous tensors work: they go through a contiguous copy
that is copied back before the Work completes; only ``all_to_all_single`` refuses them, with gloo's and
nccl's ``ValueError("Tensors must be contiguous")``. List forms (``all_gather`` into a list,
``reduce_scatter`` from a list, ``gather``, ``scatter``) stage through one contiguous buffer. Subgroups
(``new_group``, ``new_subgroups``) are native subgroups of the same world, their members in torch's
order: ``new_group(ranks, sort_ranks=False)`` keeps the order given, as gloo does (`rank_order`).

Errors: a mismatch, timeout or dead peer raises our CollectiveMismatchError, CollectiveTimeoutError or
PeerFailureError (subclasses of RuntimeError) from ``Work.wait()`` and so from every blocking
``torch.distributed`` call; torch's C++ (DDP's reducer waiting on a bucket's future) re-raises them as a
plain RuntimeError with our message.

Speed: a blocking call from torch's Python API (``dist.all_reduce(t)`` and every other collective
without ``async_op=True``) runs on the calling thread and returns no Work, so it costs torch's own
wrapper, one native call and little else. An asynchronous call returns a Work that the thread in
``wait()`` finishes itself; a future (torch DDP asks for one per bucket) is completed by a thread per
lane, which runs the future's callbacks at once (see ``axonml_distributed.torch.work``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from axonml_distributed._core import Backend, DistributedError, ProcessGroup, ThreadBackend
from axonml_distributed.hosts.addresses import AddressBook
from axonml_distributed.hosts.host_group import HostGroup
from axonml_distributed.hosts.layout import HostLayout, find_hosts
from axonml_distributed.init import install_excepthook
from axonml_distributed.torch.group import BACKEND, AxonmlProcessGroup, OrderedProcessGroup
from axonml_distributed.torch.hosts import (
    FailureNote,
    HostRank,
    HostsProcessGroup,
    exchange_addresses,
    host_subgroup,
    init_prefix,
    join_host,
    local_group,
    store_all_gather,
)
from axonml_distributed.torch.rank_order import RankOrder
from axonml_distributed.torch.rendezvous import join_world
from axonml_distributed.torch_entry import register

__all__ = ["BACKEND", "AxonmlProcessGroup", "create", "register"]

# The world of this process's default group on this host (subgroups are native subgroups over it), and
# the job's hosts when it spans several.
_world: Backend | None = None
_hosts: HostLayout | None = None
_note: FailureNote | None = None
_book: AddressBook | None = None  # the job's hosts' addresses (`exchange_addresses`)
_prefix = ""  # this init's keys in torch's stores (`init_prefix`)


def create(opts: Any, _backend_options: Any) -> dist.ProcessGroup:
    """torch's creator (extended API; `register` hands torch a stub that imports this module first): the
    default group finds the job's hosts and joins this host's world; subgroups split it, with gloo
    between hosts when they span several (see `axonml_distributed.torch.hosts`)."""
    global _world, _hosts, _note, _book, _prefix
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        _prefix = init_prefix(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        store = dist.PrefixStore(_prefix, opts.store)
        gather = store_all_gather(store, opts.group_rank, opts.group_size, opts.timeout)
        _hosts = find_hosts(opts.group_rank, opts.group_size, gather)
        if len(_hosts.hosts) > 1:
            _world = join_host(store, _hosts, opts.timeout)
            every = list(range(opts.group_size))
            _note = FailureNote(store)
            _book = exchange_addresses(store, _hosts, opts.group_size, opts.timeout)
            group: dist.ProcessGroup = HostsProcessGroup(
                store, _hosts, every, _world, _hosts, opts.timeout, _note, _book
            )
            install_excepthook(HostRank(_world, opts.group_rank, _note))
            return group
        _world = join_world(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        native: ProcessGroup | HostGroup = ProcessGroup(_world)
        # As our own init_process_group does: an exception that ends this process's main thread aborts
        # the world at once (and leaves the launcher's error file), even if the process lingers.
        install_excepthook(native)
    elif _world is None or _hosts is None:
        raise DistributedError(
            "an axonml subgroup needs an axonml default group: init_process_group('axonml')"
        )
    elif len(ranks) == 1:
        # Nothing to exchange: a world of its own, which costs none of the segment's subgroup space.
        native = ProcessGroup(ThreadBackend.single(opts.timeout.total_seconds()))
    elif len(_hosts.within(ranks).hosts) > 1:
        assert _note is not None and _book is not None  # set with the hosts of a job over several
        store = dist.PrefixStore(_prefix, opts.store)
        within = _hosts.within(ranks)
        return HostsProcessGroup(store, within, ranks, _world, _hosts, opts.timeout, _note, _book)
    else:
        # torch's timeout for this group: the one given to new_group, else torch's default (as gloo).
        native = local_group(_world, _hosts, _hosts.within(ranks), opts.timeout)
        # The core numbers the members by ascending global rank; torch, in the order given to new_group.
        order = RankOrder.of(ranks)
        if isinstance(native, HostGroup):
            return host_subgroup(native, opts.group_rank, opts.group_size, order)
        if order is not None:
            return OrderedProcessGroup(native, opts.group_rank, opts.group_size, order)
    return AxonmlProcessGroup(native, opts.group_rank, opts.group_size)


register()
