"""all_reduce of sparse COO tensors (the gradients of ``nn.Embedding(sparse=True)``), as gloo does it.

Each rank coalesces its tensor; the ranks all-gather a header (entry count and dimensions), then every
rank's shape and indices, then its values (the counts come from the headers); each rank concatenates
the pieces in rank order and coalesces them, so every rank ends with the same bits. gloo adds the same
pieces in rank order, then coalesces: the same bits at 2 ranks (tested); float16 and bool, which
gloo's sparse addition lacks, work here. The tensor takes the coalesced sum in place. Only SUM, as in
gloo: what the others mean for the entries some ranks lack is not defined. A disagreement in dimensions
or shape is an error on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def all_reduce_sparse(native: Any, t: torch.Tensor) -> None:
    """Sum the sparse COO tensor `t` over the native group's members, in place (blocking)."""
    ranks = native.ranks()
    size = len(ranks)
    with torch.no_grad():
        local = t.coalesce()
        indices, values = local.indices(), local.values()
        sparse_dim, dense_dim = local.sparse_dim(), local.dense_dim()
        header = torch.tensor([indices.shape[1], sparse_dim, dense_dim, t.dim()], dtype=torch.int64)
        headers = torch.empty(size, 4, dtype=torch.int64)
        native.all_gather(header, headers)
        if not bool((headers[:, 1:] == header[1:]).all()):
            raise ValueError(_disagree("sparse_dim, dense_dim, ndim", ranks, headers[:, 1:].tolist()))
        nnz = headers[:, 0].tolist()
        # Each member's shape, then its indices (sparse_dim rows of nnz).
        shape = torch.tensor(t.shape, dtype=torch.int64)
        counts = [t.dim() + sparse_dim * n for n in nnz]
        flat = torch.empty(sum(counts), dtype=torch.int64)
        native.all_gather_v(torch.cat([shape, indices.reshape(-1)]), flat, counts)
        pieces = flat.split(counts)
        shapes = [p[: t.dim()].tolist() for p in pieces]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(_disagree("shape", ranks, shapes))
        dense = t.shape[sparse_dim:]
        per_entry = math.prod(dense)
        gathered = torch.empty(sum(nnz) * per_entry, dtype=values.dtype)
        native.all_gather_v(values.contiguous().view(-1), gathered, [n * per_entry for n in nnz])
        every = torch.cat([p[t.dim() :].view(sparse_dim, n) for p, n in zip(pieces, nnz, strict=True)], 1)
        total = torch.sparse_coo_tensor(every, gathered.view(-1, *dense), t.shape).coalesce()
        t.copy_(total)


def _disagree(what: str, ranks: list[int], per_rank: list[Any]) -> str:
    listed = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, per_rank, strict=True))
    return f"sparse all_reduce: the members' tensors differ in {what} ({listed})"
