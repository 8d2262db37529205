"""The "axonml" torch.distributed backend: torch's own API, DDP and object collectives on our world,
under torchrun (env://), env:// by hand, and torch.multiprocessing.spawn with tcp:// and file://.
Every job is a real multi-process run of tests/torch_jobs/job.py at 2 ranks."""

from __future__ import annotations

import datetime
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

JOB = Path(__file__).parent / "torch_jobs" / "job.py"
WORLD = 2
sys.path.insert(0, str(JOB.parent))
from job import DTYPES, OPS, UNSIGNED, allowed, data  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AXONML_JOB_SECRET"]:
        env.pop(k, None)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def result(out: Path, mode: str, rank: int) -> dict[str, Any]:
    """What rank `rank` of a job saved for `mode` (see torch_jobs/job.py)."""
    return torch.load(out / f"{mode}-rank{rank}.pt", weights_only=False)


def _results(out: Path, mode: str, procs: str, world: int = WORLD) -> list[dict[str, Any]]:
    missing = [r for r in range(world) if not (out / f"{mode}-rank{r}.pt").exists()]
    assert not missing, f"ranks {missing} wrote no result for {mode}:\n{procs}"
    return [result(out, mode, r) for r in range(world)]


def torchrun(mode: str, tmp_path: Path, world: int = WORLD) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    cmd += ["--master-port", str(_port()), str(JOB), mode, str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=150)
    return _results(tmp_path, mode, p.stdout + p.stderr, world)


# Modes that leave their processes able to init again run in one torchrun job: a job's start-up (three
# processes importing torch, 4 s each) costs more than most modes.
TOGETHER = ["collectives", "nested", "reinit"]


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each mode of TOGETHER's results, from one torchrun job."""
    out = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
    cmd += ["--master-port", str(_port()), str(JOB), ",".join(TOGETHER), str(out)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    return {mode: _results(out, mode, p.stdout + p.stderr) for mode in TOGETHER}


def axonml_run(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Our launcher: the script's env:// init finds torch's variables (and the job secret) there."""
    cmd = [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", str(WORLD)]
    cmd += [str(JOB), mode, str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=150)
    return _results(tmp_path, mode, p.stdout + p.stderr)


def by_hand(mode: str, tmp_path: Path, **extra: str) -> list[dict[str, Any]]:
    """env:// as torchrun sets it up, each rank a process of its own (so one may die alone)."""
    env = _env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": str(WORLD)} | extra
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), mode, str(tmp_path)],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=150)[0] for p in procs]
    return _results(tmp_path, mode, "\n".join(logs))


def spawned(mode: str, tmp_path: Path, init: str) -> list[dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, str(JOB), mode, str(tmp_path), init],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    return _results(tmp_path, mode, p.stdout + p.stderr)


def reduce_ref(tensors: list[Any], op: str) -> Any:
    """Rank order; float16/bfloat16 in float32, rounded once; bool ops as torch's (OR / AND); the
    wider unsigned ints in int64 (their small inputs fit; torch lacks some of their kernels)."""
    dtype = tensors[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    wide = torch.int64 if dtype in UNSIGNED[1:] else wide
    bitwise = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
    acc = tensors[0].to(wide)
    for t in tensors[1:]:
        t = t.to(wide)
        if op in bitwise:
            acc = bitwise[op](acc, t)
        elif dtype == torch.bool:
            acc = acc | t if op in ("SUM", "MAX") else acc & t
        elif op in ("SUM", "AVG"):
            acc = acc + t
        elif op == "PRODUCT":
            acc = acc * t
        else:
            acc = torch.minimum(acc, t) if op == "MIN" else torch.maximum(acc, t)
    if op == "AVG":
        acc = acc / len(tensors)
    return acc.to(dtype)


def same(a: Any, b: Any) -> bool:
    """Bitwise equal tensors (dtype, shape and bytes)."""

    def bits(t: Any) -> Any:
        return t.contiguous().view(-1).view(torch.uint8)

    return bool(a.dtype == b.dtype and a.shape == b.shape and bits(a).equal(bits(b)))


@pytest.mark.timeout(200)
def test_every_collective_and_dtype_under_torchrun(under_torchrun: dict[str, list[dict[str, Any]]]) -> None:
    res = under_torchrun["collectives"]
    assert all("error" not in r for r in res), res
    for dtype in DTYPES:
        for i, op in enumerate(OPS):
            if not allowed(op, dtype):
                continue
            want = reduce_ref([data(r, 33, dtype, seed=i) for r in range(WORLD)], op)
            for r in range(WORLD):
                assert same(res[r][f"all_reduce/{dtype}/{op}"], want), (dtype, op, r)
        for r in range(WORLD):
            assert same(res[r][f"broadcast/{dtype}"], data(WORLD - 1, 5, dtype))
            for j in range(WORLD):
                assert same(res[r][f"all_gather/{dtype}"][j], data(j, 4, dtype))
    ins = [data(r, 6, torch.float32) for r in range(WORLD)]
    rs_full = reduce_ref(
        [torch.stack([data(r, 3, torch.float32, seed=10 + j) for j in range(WORLD)]) for r in range(WORLD)],
        "SUM",
    )
    rst_full = reduce_ref([data(r, 3 * WORLD, torch.float64) for r in range(WORLD)], "MAX")
    for r in range(WORLD):
        got = res[r]
        assert same(got["premul_sum"], reduce_ref([x * 0.5 for x in ins], "SUM"))
        assert same(
            got["all_gather_into_tensor"], torch.cat([data(j, 4, torch.float32) for j in range(WORLD)])
        )
        assert same(got["reduce_scatter"], rs_full[r])
        assert same(got["reduce_scatter_tensor"], rst_full[3 * r : 3 * r + 3])
        assert same(got["scatter"], data(r, 2, torch.int32, seed=7))
        nc_want = reduce_ref([data(j, 12, torch.float32).reshape(3, 4).t() for j in range(WORLD)], "SUM")
        assert same(got["non_contiguous"].contiguous(), nc_want.contiguous())
        assert same(got["future"], reduce_ref([data(j, 7, torch.float64) for j in range(WORLD)], "SUM"))
        assert got["work_completed"]
        for key in ("non_contiguous_future", "non_contiguous_async"):
            assert same(got[key].contiguous(), nc_want.contiguous()), key
        # Every other rank's two messages, each from the rank it names, the sender's rank as its value.
        assert sorted(s for s, _ in got["recv_anysource"]) == sorted(2 * [j for j in range(WORLD) if j != r])
        assert all(values == [float(s)] for s, values in got["recv_anysource"]), got["recv_anysource"]
        assert got["all_gather_object"] == [{"rank": j, "name": f"r{j}"} for j in range(WORLD)]
        assert got["broadcast_object_list"] == ["from 1", 1]
        assert same(got["batch_isend_irecv"], data((r - 1) % WORLD, 5, torch.float32))
        assert same(
            got["new_group_all"], reduce_ref([data(j, 3, torch.float32) for j in range(WORLD)], "SUM")
        )
        assert same(got["new_subgroups"], data(r, 3, torch.float32))
        # all_to_all_single, equal and with splits; all_to_all of lists; uneven all_gather / reduce_scatter.
        parts = [data(j, WORLD * 3, torch.float32, seed=20) for j in range(WORLD)]
        assert same(got["all_to_all_single"], torch.cat([p[3 * r : 3 * r + 3] for p in parts]))
        sent = [sum(j + i + 1 for i in range(WORLD)) for j in range(WORLD)]
        rows = [data(j, 2 * sent[j], torch.int64, seed=21).view(-1, 2) for j in range(WORLD)]
        start = [sum(j + i + 1 for i in range(r)) for j in range(WORLD)]
        want = torch.cat([rows[j][start[j] : start[j] + j + r + 1] for j in range(WORLD)])
        assert same(got["all_to_all_single_splits"], want)
        for j in range(WORLD):
            assert same(got["all_to_all"][j], data(j, j + 1, torch.float32, seed=30 + r))
            assert same(got["all_gather_uneven"][j], data(j, j + 1, torch.float64, seed=40))
        rsv = [data(j, r + 1, torch.float32, seed=50 + r) for j in range(WORLD)]
        assert same(got["reduce_scatter_uneven"], reduce_ref(rsv, "SUM"))
        coalesced = [
            [
                data(j, 3, torch.float32, seed=60),
                torch.empty(0),
                data(j, 4, torch.float32, seed=61).view(2, 2),
            ]
            for j in range(WORLD)
        ]
        for j in range(WORLD):
            for got_t, want_t in zip(got["all_gather_coalesced"][j], coalesced[j], strict=True):
                assert same(got_t, want_t), ("all_gather_coalesced", r, j)
        before, after = got["sequence_numbers"]
        assert after == before + 1 and before > 0
    assert len({res[r]["sequence_numbers"] for r in range(WORLD)}) == 1
    assert all(
        same(a, b)
        for a, b in zip(res[0]["gather"], [data(j, 2, torch.int64) for j in range(WORLD)], strict=True)
    )
    assert same(
        res[WORLD - 1]["reduce"], reduce_ref([data(j, 5, torch.float16) for j in range(WORLD)], "SUM")
    )
    premul = [data(j, 6, torch.float64) * 0.25 for j in range(WORLD)]
    assert same(res[WORLD - 1]["premul_sum_reduce"], reduce_ref(premul, "SUM"))
    assert same(res[0]["premul_sum_reduce"], data(0, 6, torch.float64))
    assert same(res[1]["send_recv"], data(0, 3, torch.int64))
    first, second, tagged = res[0]["recv_anysource_tags"]
    assert (first, second) == (WORLD - 1, WORLD - 1)
    assert same(tagged[0], torch.full((2,), 2.0)) and same(tagged[1], torch.ones(2))
    assert same(res[WORLD - 1]["new_group_single"], data(WORLD - 1, 3, torch.float32))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launch", ["by_hand", "axonml_run"])
def test_torch_ddp_over_axonml_matches_gloo_bitwise(tmp_path: Path, launch: str) -> None:
    res = by_hand("ddp", tmp_path) if launch == "by_hand" else axonml_run("ddp", tmp_path)
    assert all("error" not in r for r in res), res
    for r in range(WORLD):
        for name in ("axonml", "axonml async"):  # small buckets inside backward run inline, or not
            for key in ("", " buffers"):
                pairs = zip(res[r][name + key], res[r]["gloo" + key], strict=True)
                assert all(same(a, b) for a, b in pairs), (r, name, key)
        assert all(same(a, b) for a, b in zip(res[r]["axonml"], res[0]["axonml"], strict=True))


@pytest.mark.timeout(300)
def test_torch_ddp_over_axonml_agrees_with_gloo_at_4_ranks_under_torchrun(tmp_path: Path) -> None:
    res = torchrun("ddp", tmp_path, world=4)
    assert all("error" not in r for r in res), res
    for r in range(4):
        # Rank order here, a ring's order in gloo: the same to float32 rounding, not bitwise.
        for key in ("", " buffers"):
            for a, b in zip(res[r]["axonml" + key], res[r]["gloo" + key], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(same(a, b) for a, b in zip(res[r]["axonml"], res[0]["axonml"], strict=True))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_spawn_with_tcp_and_file_init_and_torch_style_arguments(tmp_path: Path, scheme: str) -> None:
    init = f"tcp://127.0.0.1:{_port()}" if scheme == "tcp" else f"file://{tmp_path / 'store'}"
    res = spawned("init_args", tmp_path, init)
    for r in res:
        assert "error" not in r, r
        assert same(r["sum"], torch.full((3,), float(sum(range(WORLD)))))
        assert r["backend"] == ("cpu:axonml" if scheme == "file" else "axonml")


# Calls gloo carries out as another collective, whose event it names: ours is named for the call, as
# torch's tests and its NCCL backend name it, with the same input shapes.
GLOO_EMULATES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "all_reduce"}


@pytest.mark.timeout(250)
def test_profiler_events_match_gloos_names_counts_async_and_shapes(tmp_path: Path) -> None:
    """Each collective and point-to-point call, blocking and not, under torch.autograd.profiler and
    torch.profiler, records the events gloo records for the same call in the same job: one per call,
    asynchronous (as torch's tests check), with the input shapes."""
    res = by_hand("profiled", tmp_path)
    assert all("error" not in r for r in res), res
    for r in range(WORLD):
        got = res[r]
        calls = {k.split("/")[1] for k in got}
        assert len(calls) == 19, calls
        for call in sorted(calls - {"reduce_scatter"}):
            for kind in ("autograd", "torch"):
                ours, gloo = got[f"axonml/{call}/{kind}"], got[f"gloo/{call}/{kind}"]
                assert gloo, (call, kind)  # the reference records something
                want = [
                    (f"axonml:{call if GLOO_EMULATES.get(call) == n[5:] else n[5:]}", *rest)
                    for n, *rest in gloo
                ]
                assert ours == want, (r, call, kind)
        # gloo reduces a list once per output; ours is one call with every input tensor.
        for kind in ("autograd", "torch"):
            assert got[f"axonml/reduce_scatter/{kind}"] == [("axonml:reduce_scatter", 1, True, [[2]] * WORLD)]


@pytest.mark.timeout(250)
def test_sparse_all_reduce_matches_gloo_and_a_dense_sum_and_ddp_trains_a_sparse_embedding_as_gloo(
    tmp_path: Path,
) -> None:
    """Sparse COO all_reduce (SUM): coalesced, the same bits on every rank and as gloo's (where gloo has
    a kernel: not float16 or bool), the dense sum of the inputs; other ops and differing shapes raise on
    every rank; torch DDP with a sparse EmbeddingBag trains to gloo's weights, bitwise."""
    from job import sparse_inputs

    res = by_hand("sparse", tmp_path)
    assert all("error" not in r for r in res), res
    inputs = [sparse_inputs(r, WORLD) for r in range(WORLD)]
    for name in inputs[0]:
        want = reduce_ref([inputs[r][name].to_dense() for r in range(WORLD)], "SUM")
        coalesced, indices, values = res[0][f"axonml/{name}"]
        assert coalesced, name
        got = torch.sparse_coo_tensor(indices, values, want.shape).to_dense()
        torch.testing.assert_close(got, want)  # its tolerance for float dtypes: sums in another order
        for r in range(WORLD):
            ours = res[r][f"axonml/{name}"]
            assert same(ours[1], indices) and same(ours[2], values), (name, r)
            gloo = res[r].get(f"gloo/{name}")
            if want.dtype not in (torch.float16, torch.bool):
                assert gloo is not None and gloo[0] and same(gloo[1], indices) and same(gloo[2], values), name
    for r in range(WORLD):
        for op in ["MAX", "AVG"]:
            assert "SUM only" in res[r][f"error {op}"] and op in res[r][f"error {op}"], res[r]
        assert "differ in shape (rank 0: [3], rank 1: [4])" in res[r]["error shape"], res[r]
        assert res[r]["after errors"] == WORLD
        ddp = res[r]["ddp"]
        assert all(same(a, b) for a, b in zip(ddp["axonml"], ddp["gloo"], strict=True)), r
        assert all(same(a, b) for a, b in zip(ddp["axonml"], res[0]["ddp"]["axonml"], strict=True)), r


@pytest.mark.timeout(200)
def test_a_mismatch_raises_our_error_on_every_rank(tmp_path: Path) -> None:
    for r in by_hand("mismatch", tmp_path):
        assert r.get("error") == "CollectiveMismatchError", r
        assert "all_reduce" in r["message"] and "broadcast" in r["message"]
        facts = r["facts"]  # our error's facts reach the script through torch
        assert (facts["ranks"], facts["group"], sorted(facts["calls"])) == ((1,), (0, 1), [0, 1]), r
        assert facts["calls"][1].startswith(f"broadcast(#{facts['seq']}, 4 x float32, root=0)"), r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["group_timeout", "group_recv_timeout"])
def test_a_groups_own_timeout_raises_with_torchs_words(tmp_path: Path, mode: str) -> None:
    """torch's test_barrier_timeout_full_group (and a receive): a group made with a 1 s timeout in a
    world of 30 s gives up after its own, with a message torch's tests match."""
    late, early = by_hand(mode, tmp_path)[::-1]
    assert early.get("error") == "CollectiveTimeoutError", early
    assert re.search(r" (Timed out|closed|timeout) ", early["message"]), early
    assert "Timed out after 1s" in early["message"] and "rank(s) [1]" in early["message"], early
    assert early["waited"] < 8, early  # the group's 1 s and slack, far below the world's 30 s
    facts = early["facts"]
    assert (facts["rank"], facts["ranks"], facts["waited"]) == (0, (1,), 1.0), early
    assert facts["call"].startswith("barrier(#" if mode == "group_timeout" else "recv("), early
    assert late.get("error") == "PeerFailureError", late  # its barrier finds the world aborted


@pytest.mark.timeout(200)
def test_a_zero_timeout_monitored_barrier_times_out_at_once_in_torchs_words(tmp_path: Path) -> None:
    """torch's test_monitored_barrier_gloo_rank_0_timeout: a RuntimeError saying "Rank 0 timed out in
    monitoredBarrier", as gloo's, where the native group refuses a zero timeout (ValueError)."""
    zero, other = by_hand("monitored_zero", tmp_path)
    assert zero.get("error") == "CollectiveTimeoutError" and zero["runtime_error"], zero
    assert "Rank 0 timed out in monitoredBarrier" in zero["message"], zero
    facts = zero["facts"]
    assert (facts["rank"], facts["ranks"], facts["group"], facts["waited"]) == (0, (1,), (0, 1), 0.0), zero
    assert "error" not in other, other


@pytest.mark.timeout(200)
def test_a_rank_that_dies_raises_peer_failure_in_ddp_and_after_not_a_hang(tmp_path: Path) -> None:
    env = _env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": str(WORLD)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), "dies", str(tmp_path)],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=150)[0] for p in procs]
    assert procs[1].returncode == 3
    got = result(tmp_path, "dies", 0)
    assert got.get("error") == "PeerFailureError", (got, logs)
    assert "rank 1" in got["message"]
    # Through torch's C++ (DDP's reducer waiting on the bucket's future): a RuntimeError, our message.
    assert got["ddp"].startswith("RuntimeError") and "PeerFailureError: peer rank 1 died" in got["ddp"], got


@pytest.mark.timeout(200)
def test_nested_futures_powersgd_many_groups_names_and_device_mesh(
    under_torchrun: dict[str, list[dict[str, Any]]],
) -> None:
    res = under_torchrun["nested"]
    assert all("error" not in r for r in res), res
    for r in res:
        assert float(r["nested"][0]) == WORLD
        assert r["sums"] == [float(WORLD)] * 5
        assert len(set(r["names"])) == 5 and all(r["names"])
        assert r["mesh"].tolist() == [float(sum(range(WORLD)))] * 2


@pytest.mark.timeout(200)
def test_a_rank_that_raises_and_lingers_fails_its_peers_at_once(tmp_path: Path) -> None:
    res = by_hand("raises", tmp_path)
    assert res[1]["error"] == "ValueError", res[1]
    assert res[0]["error"] == "PeerFailureError" and "ValueError in rank 1" in res[0]["message"], res[0]
    assert res[0]["waited"] < 5, res[0]  # rank 1 lingers for 8 s


@pytest.mark.timeout(200)
def test_init_again_in_the_same_processes_under_torchrun(
    under_torchrun: dict[str, list[dict[str, Any]]],
) -> None:
    res = under_torchrun["reinit"]
    assert all("error" not in r for r in res), res
    assert [r["sums"] for r in res] == [[1.0, 3.0, 5.0]] * WORLD


def _with_secrets(tmp_path: Path, keys: list[str]) -> list[subprocess.Popen[str]]:
    """The job "init_args" by hand, rank r with AXONML_JOB_SECRET keys[r]."""
    env = _env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": str(WORLD)}
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), "init_args", str(tmp_path)],
            env=env | {"RANK": str(r), "AXONML_JOB_SECRET": key},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, key in enumerate(keys)
    ]


@pytest.mark.timeout(200)
def test_the_job_secret_must_match(tmp_path: Path) -> None:
    """Under axonml-run the token in the store carries an HMAC of the job secret."""
    procs = _with_secrets(tmp_path, [secrets.token_hex(32) for _ in range(WORLD)])
    log1 = procs[1].communicate(timeout=150)[0]
    procs[0].kill()  # it waits for rank 1 to join the segment until its timeout
    procs[0].communicate(timeout=60)
    # Killed while waiting, it could not remove the segment's name: as after any crash at start-up.
    from axonml_distributed.shm import cleanup_stale_segments

    cleanup_stale_segments(min_age=0)
    r1 = result(tmp_path, "init_args", 1)
    assert r1.get("error") == "DistributedError" and "AXONML_JOB_SECRET" in r1["message"], (r1, log1)


@pytest.mark.timeout(200)
def test_the_job_secret_is_its_bytes_as_in_the_shm_world(tmp_path: Path) -> None:
    """The secret is the bytes its hex digits spell, whatever their case (as the shm world reads it)."""
    key = secrets.token_hex(32)
    procs = _with_secrets(tmp_path, [key.lower(), key.upper()])
    logs = [p.communicate(timeout=150)[0] for p in procs]
    res = _results(tmp_path, "init_args", "\n".join(logs))
    assert all("error" not in r for r in res), res
    assert [r["sum"].tolist() for r in res] == [[1.0] * 3] * WORLD


def test_a_short_job_secret_is_refused_before_the_store_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the shm world: at least 16 bytes (32 hex digits)."""
    import torch.distributed as dist

    from axonml_distributed.torch.rendezvous import join_world

    monkeypatch.setenv("AXONML_JOB_SECRET", "ab" * 15)
    store = dist.HashStore()
    with pytest.raises(ValueError, match="AXONML_JOB_SECRET has 15 bytes .* at least 16"):
        join_world(store, 0, 1, datetime.timedelta(seconds=10))
    assert store.num_keys() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["HashStore", "TCPStore"])
def test_a_wrong_secret_is_refused_through_torchs_store_as_through_ours(kind: str) -> None:
    """torch's Store, through the core's adapter: the refusal axonml-run's own store gives
    (test_shm_join), and rank 0 names the rank at its timeout."""
    import torch.distributed as dist

    from axonml_distributed import CollectiveTimeoutError, DistributedError
    from axonml_distributed._core import ShmBackend
    from test_shm_join import NOTED, REFUSED

    store = (
        dist.HashStore()
        if kind == "HashStore"
        else dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    )
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            ShmBackend.join(store, r, 2, timeout=3, secret=secrets.token_bytes(32))
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[r] = e

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert type(errors[1]) is DistributedError and str(errors[1]) == REFUSED, errors
    assert isinstance(errors[0], CollectiveTimeoutError) and NOTED in str(errors[0]), errors
    assert f"the job's store ({kind})" in str(errors[0])


def test_registration_without_and_with_our_import() -> None:
    """Importing the package alone registers nothing and does not load torch; importing torch registers
    the name (torch's autoload, torch 2.5 and later) without loading our torch layer; with autoload off,
    importing axonml_distributed.torch registers it; a script that only names the backend runs."""
    alone = (
        "import sys, axonml_distributed; "
        "assert 'torch' not in sys.modules and 'axonml_distributed.torch' not in sys.modules; "
        "import torch.distributed as d; assert 'AXONML' not in d.Backend._plugins; "
        "import axonml_distributed.torch; assert 'AXONML' in d.Backend._plugins"
    )
    autoloaded = (
        "import sys, torch.distributed as d; assert 'AXONML' in d.Backend._plugins; "
        "assert 'axonml_distributed.torch' not in sys.modules; "
        "import axonml_distributed.torch"  # registers again: harmless
    )
    unchanged = (
        "import sys, tempfile, torch, torch.distributed as d; "
        "d.init_process_group('axonml', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1); "
        "t = torch.ones(3); d.all_reduce(t); assert t.tolist() == [1.0] * 3; "
        "assert d.get_backend() == 'axonml' and 'axonml_distributed.torch' in sys.modules; "
        "d.destroy_process_group()"
    )
    # torch 2.5 to 2.13 find the name only through the autoload: without torch's lookup by entry point
    # (2.14 and later), the unchanged script must run as well.
    no_lookup = "import torch.distributed as d; d.Backend._ensure_backend_registered = lambda name: None; "
    no_autoload = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    runs = [(alone, no_autoload), (autoloaded, {}), (unchanged, {}), (no_lookup + unchanged, {})]
    procs = [subprocess.Popen([sys.executable, "-c", code], env=_env() | extra) for code, extra in runs]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]


class _Native:
    """A native work that finishes when told, with `error` if given."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def wait(self) -> None:
        assert self.done.wait(60)
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


def _completers() -> int:
    return sum(t.name == "axonml-completer" for t in threading.enumerate())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("queued_first", [False, True])
def test_a_future_callback_may_wait_for_a_later_work_of_its_lane(queued_first: bool) -> None:
    """Futures complete on their lane's completer thread, callbacks and all. A callback that waits for a
    later work's future (torch's PowerSGD hook does) gets another thread to complete that one, whether
    the work was queued before the callback ran or from inside it; the extra thread ends after."""
    from axonml_distributed.torch.work import Completer, Work

    before = _completers()
    completer = Completer()
    n1, n2 = _Native(), _Native()
    w1, w2 = (Work([n], [i], None, lambda: completer) for i, n in enumerate([n1, n2]))
    f2 = w2.get_future() if queued_first else None
    got = w1.get_future().then(lambda _: (f2 or w2.get_future()).wait())
    n2.done.set()
    n1.done.set()
    assert got.wait() == [1]
    deadline = time.monotonic() + 30
    while _completers() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _completers() == before + 1


@pytest.mark.timeout(60)
def test_a_work_finishes_when_polled_waited_or_asked_for_its_future() -> None:
    """is_completed() finishes a work whose native works are done (its copy-back runs first); an
    error reaches wait() and the future (as an error in torch's C++ too: the future is errored)."""
    from axonml_distributed.torch.work import Completer, Work

    completer = Completer()
    n, copied = _Native(), []
    w = Work([n], ["result"], lambda: copied.append(True), lambda: completer)
    assert not w.is_completed() and not copied
    n.done.set()
    assert w.is_completed() and copied == [True] and w.is_success()
    assert w.get_future().wait() == ["result"]
    bad = _Native(RuntimeError("peer rank 1 died"))
    w = Work([bad], ["result"], None, lambda: completer)
    fut = w.get_future()
    bad.done.set()
    with pytest.raises(RuntimeError, match="peer rank 1 died"):
        fut.wait()
    with pytest.raises(RuntimeError, match="peer rank 1 died"):
        w.wait()
    assert w.is_completed() and not w.is_success()


@pytest.mark.timeout(60)
def test_every_all_reduce_form_reduces_whichever_way_it_takes() -> None:
    """`allreduce` takes a short way for one contiguous dense tensor summed with the profiler off, and
    the general one for the rest: each form's result against the sum (or max) of both ranks' inputs, a
    blocking call returning no Work, an async one a Work whose future holds the tensors."""
    import torch.distributed as dist

    import axonml_distributed as ad
    from axonml_distributed.torch.group import AxonmlProcessGroup

    def opts(op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Any:
        o = dist.AllreduceOptions()
        o.reduceOp, o.asyncOp = op, async_op
        return o

    def forms(pg: AxonmlProcessGroup, r: int) -> dict[str, Any]:
        def mine() -> Any:
            return torch.arange(6.0).reshape(2, 3) + 10 * r

        out: dict[str, Any] = {}
        t = mine()
        out["blocking returns"] = pg.allreduce([t], opts())
        out["blocking"] = t
        t = mine()
        work = pg.allreduce([t], opts(async_op=True))
        out["async future"] = work.get_future().wait()[0].clone()
        out["async"], out["async completed"] = t, work.is_completed()
        t = mine()
        pg.allreduce([t], opts(dist.ReduceOp.MAX))
        out["max"] = t
        t = mine()
        pg.allreduce([t], None).wait()  # no options: torch's defaults (SUM), asynchronous
        out["no options"] = t
        nc = mine().t()
        pg.allreduce([nc], opts(async_op=True)).wait()
        out["non-contiguous async"] = nc
        pair = [mine(), mine()[0]]
        pg.allreduce(pair, opts())
        out["two tensors"] = pair
        return out

    worlds = ad.ThreadBackend.create_world(2, timeout=30)
    got: list[Any] = [None, None]

    def rank(r: int) -> None:
        got[r] = forms(AxonmlProcessGroup(ad.ProcessGroup(worlds[r]), r, 2), r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    base = torch.arange(6.0).reshape(2, 3)
    total, top = base + (base + 10), base + 10
    for out in got:
        assert out["blocking returns"] is None
        assert torch.equal(out["blocking"], total) and torch.equal(out["async"], total)
        assert torch.equal(out["async future"], total) and out["async completed"]
        assert torch.equal(out["max"], top) and torch.equal(out["no options"], total)
        assert torch.equal(out["non-contiguous async"], total.t())
        assert torch.equal(out["two tensors"][0], total) and torch.equal(out["two tensors"][1], total[0])
