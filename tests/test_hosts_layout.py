"""`find_hosts` and `HostLayout` in one process: ranks are threads exchanging over a fake all_gather,
their identities and proofs made to differ (simulated hosts run the real thing:
tests/test_hosts_torch.py)."""

from __future__ import annotations

import os
import threading

import pytest

from axonml_distributed.hosts import layout


def test_find_hosts_splits_by_identity_and_by_proof_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_hosts over a fake all_gather (4 ranks as threads of one process): identities group the
    ranks, the proof confirms each group, a rank whose proof fails is a host of its own; no proof object
    is left behind."""
    # Each thread's claim and the host it "really" is on: it reads only objects made on that host.
    mine = threading.local()
    owners: dict[bytes, int] = {}
    monkeypatch.setattr(layout, "identity", lambda: mine.claim)
    real_create, real_check = layout._Proof.create, layout._Proof.check

    def create() -> layout._Proof:
        proof = real_create()
        owners[proof.name] = mine.host
        return proof

    def check(offer: bytes) -> bool:
        return owners.get(offer[: layout.ITEM_BYTES // 2]) == mine.host and real_check(offer)

    monkeypatch.setattr(layout._Proof, "create", create)
    monkeypatch.setattr(layout._Proof, "check", check)

    def run(claims: list[bytes], real: list[int] | None = None) -> list[layout.HostLayout]:
        size = len(claims)
        slots: list[bytes] = [b""] * size
        barrier = threading.Barrier(size)
        found: list[layout.HostLayout | None] = [None] * size

        def rank(r: int) -> None:
            mine.claim, mine.host = claims[r], (real or [0] * size)[r]

            def all_gather(item: bytes) -> list[bytes]:
                slots[r] = item
                barrier.wait()
                items = list(slots)
                barrier.wait()
                return items

            found[r] = layout.find_hosts(r, size, all_gather)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all(f is not None for f in found)
        return found  # type: ignore[return-value]

    before = set(os.listdir(layout.SEGMENT_DIR))
    a, b = bytes(32), b"\1" * 32
    same = run([a, a, a, a])
    assert [f.hosts for f in same] == [((0, 1, 2, 3),)] * 4
    two = run([a, a, b, b], [0, 0, 1, 1])
    assert [f.hosts for f in two] == [((0, 1), (2, 3))] * 4
    assert [f.host for f in two] == [0, 0, 1, 1] and [f.local_rank for f in two] == [0, 1, 0, 1]
    assert two[3].peers() == (1, 3) and two[0].uniform
    # One claim (AXONML_HOST_ID alike on two hosts): ranks 2 and 3 cannot read rank 0's object, so they
    # prove among themselves next.
    split = run([a, a, a, a], [0, 0, 1, 1])
    assert [f.hosts for f in split] == [((0, 1), (2, 3))] * 4
    # Rank 3 alone on its host: a host of its own.
    alone = run([a, a, a, a], [0, 0, 0, 1])
    assert [f.hosts for f in alone] == [((0, 1, 2), (3,))] * 4
    assert not alone[0].uniform
    # Interleaved claims: hosts ordered by their lowest rank on every rank.
    mixed = run([b, a, b, a], [0, 1, 0, 1])
    assert [f.hosts for f in mixed] == [((0, 2), (1, 3))] * 4
    assert mixed[0].within([1, 2, 3]).hosts == ((2,), (1, 3))
    assert set(os.listdir(layout.SEGMENT_DIR)) == before
