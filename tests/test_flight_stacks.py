"""The caller's Python stack in the flight recorder (AXONML_FLIGHT_RECORDER_STACKS, read once per process,
so each case runs in a fresh interpreter): kept as torch's `frames` when on, for collectives (blocking and
asynchronous) and sends and receives alike; absent when off; shown by `trace analyze` for the call at
which ranks diverged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

JOB = textwrap.dedent(
    """
    import json
    import numpy as np
    import axonml_distributed as ad
    from axonml_distributed import trace

    def caller_of_the_reduce(pg):
        pg.all_reduce(np.ones(4, np.float32))
        pg.all_reduce(np.ones(4, np.float32), async_op=True).wait()

    def caller_of_the_message(pg):
        x = np.ones(3, np.float64)
        if pg.rank() == 0:
            pg.send(x, 1)
        else:
            pg.recv(x, 0)

    def caller_astray(pg):
        x = np.ones(2, np.float32)
        try:
            pg.broadcast(x, 0) if pg.rank() == 1 else pg.all_reduce(x)
        except ad.CollectiveMismatchError:
            pass  # the world is aborted: no call after this one

    def job(pg):
        caller_of_the_reduce(pg)
        caller_of_the_message(pg)
        caller_astray(pg)
        return trace.flight_record()["ranks"][str(pg.rank())]

    dumps = ad.spawn(job, 2)
    content = trace.merge([{"world_size": 2, "ranks": {str(d["rank"]): d for d in dumps}}])
    print(json.dumps({"dumps": dumps, "analysis": trace.analyze(content).lines()}))
    """
)

CALLERS = ["caller_of_the_reduce", "caller_of_the_reduce", "caller_of_the_message", "caller_astray"]


def _run(stacks: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "AXONML_FLIGHT_RECORDER_STACKS"}
    if stacks is not None:
        env["AXONML_FLIGHT_RECORDER_STACKS"] = stacks
    run = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_with_stacks_on_each_call_keeps_its_caller_s_frames() -> None:
    out = _run("1")
    for dump in out["dumps"]:
        entries = dump["entries"]
        # The calls in order: each one's innermost frame is its caller, in this script, then the job.
        assert [e["frames"][0]["name"] for e in entries] == CALLERS, entries
        for e in entries:
            assert e["frames"][0]["filename"] == "<string>" and e["frames"][0]["line"] > 0, e["frames"]
            assert e["frames"][1]["name"] == "job", e["frames"]
    lines = out["analysis"]
    assert any(
        line.strip().startswith("rank 1 called it from: caller_astray at <string>:") for line in lines
    ), lines


def test_without_stacks_no_call_keeps_frames() -> None:
    # Only "1" turns it on, as the core's other switches read (AXONML_SHM_CMA): "false" is not on.
    for stacks in (None, "0", "false"):
        out = _run(stacks)
        for dump in out["dumps"]:
            assert dump["entries"] and all(e["frames"] == [] for e in dump["entries"]), dump["entries"]
        assert not any("called it from" in line for line in out["analysis"]), out["analysis"]
