"""The package's environment settings (`axonml_distributed.settings`): each variable's documented meaning,
default and refusals; and that they have one home in Python, apart from the core's own."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import axonml_distributed as ad
from axonml_distributed import settings
from axonml_distributed._core import ShmBackend

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(ad.__file__).parent
# The repository's, beside these tests: the package may be installed from a wheel, away from the source.
RUST_CONFIG = Path(__file__).resolve().parents[1] / "rust" / "config.rs"

READERS: dict[str, Callable[[], Any]] = {
    "RANK": settings.rank,
    "WORLD_SIZE": settings.world_size,
    "MASTER_ADDR": settings.master_addr,
    "MASTER_PORT": settings.master_port,
    "AXONML_JOB_ID": settings.job_id,
    "AXONML_JOB_SECRET": settings.job_secret,
    "AXONML_ERROR_FILE": settings.error_file,
    "AXONML_FLIGHT_RECORD_FILE": settings.flight_record_file,
    "AXONML_TIMELINE": settings.timeline_file,
    "AXONML_LAUNCHER_PID": settings.launched_by_axonml_run,
    "AXONML_SHM_ARENA_MB": settings.shm_arena_bytes,
    "AXONML_HOST_ID": settings.host_id,
    "AXONML_HOSTS_FLAT_BELOW": settings.hosts_flat_below,
    "AXONML_HOSTS_SEGMENT_KIB": settings.hosts_segment_bytes,
}
# What each reader gives when its variable is unset or empty (the docs' defaults).
DEFAULTS = {name: None for name in READERS} | {"MASTER_ADDR": "127.0.0.1", "AXONML_LAUNCHER_PID": False}


def _dev_shm_mib() -> int:
    fs = os.statvfs("/dev/shm")
    return (fs.f_blocks * fs.f_frsize) >> 20


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in READERS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", READERS)
def test_unset_or_empty_gives_the_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert READERS[name]() == DEFAULTS[name]
    monkeypatch.setenv(name, "")
    assert READERS[name]() == DEFAULTS[name]


SECRET = secrets.token_bytes(32)

VALID = [
    ("RANK", "0", 0),
    ("RANK", "7", 7),
    ("WORLD_SIZE", "1", 1),
    ("WORLD_SIZE", " 4\n", 4),
    ("MASTER_ADDR", "10.1.2.3", "10.1.2.3"),
    ("MASTER_PORT", "1", 1),
    ("MASTER_PORT", "65535", 65535),
    ("AXONML_JOB_ID", "0123abcd", "0123abcd"),
    ("AXONML_ERROR_FILE", "/tmp/x/rank-0.json", "/tmp/x/rank-0.json"),
    ("AXONML_FLIGHT_RECORD_FILE", "/tmp/x/flight-rank-0.json", "/tmp/x/flight-rank-0.json"),
    ("AXONML_TIMELINE", "/tmp/x/timeline.json", "/tmp/x/timeline.json"),
    ("AXONML_SHM_ARENA_MB", "1", 1 << 20),
    ("AXONML_HOST_ID", "rack4-node17", "rack4-node17"),
    ("AXONML_HOSTS_FLAT_BELOW", "0", 0),
    ("AXONML_HOSTS_SEGMENT_KIB", "4", 4 << 10),
    ("AXONML_SHM_ARENA_MB", "256", 256 << 20),
    # Hex digits decoded: either case, surrounding whitespace ignored, 16 bytes the shortest.
    ("AXONML_JOB_SECRET", SECRET.hex(), SECRET),
    ("AXONML_JOB_SECRET", SECRET.hex().upper(), SECRET),
    ("AXONML_JOB_SECRET", f"  {SECRET.hex()}\n", SECRET),
    ("AXONML_JOB_SECRET", "ab" * 16, b"\xab" * 16),
]


@pytest.mark.parametrize(("name", "text", "expected"), VALID)
def test_valid_values(name: str, text: str, expected: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, text)
    assert READERS[name]() == expected


INVALID = [
    ("RANK", "-1", "RANK must be a whole number of at least 0"),
    ("AXONML_HOSTS_SEGMENT_KIB", "2", "AXONML_HOSTS_SEGMENT_KIB must be a whole number of at least 4"),
    ("AXONML_HOSTS_FLAT_BELOW", "64k", "AXONML_HOSTS_FLAT_BELOW must be a whole number"),
    ("RANK", "one", "RANK must be a whole number"),
    ("RANK", "1.0", "RANK must be a whole number"),
    ("WORLD_SIZE", "0", "WORLD_SIZE must be a whole number of at least 1"),
    ("MASTER_PORT", "0", "MASTER_PORT must be a whole number of at least 1"),
    ("MASTER_PORT", "65536", "MASTER_PORT must be a TCP port, 1 to 65535"),
    ("MASTER_PORT", "http", "MASTER_PORT must be a whole number"),
    ("AXONML_SHM_ARENA_MB", "0", "AXONML_SHM_ARENA_MB must be a whole number of at least 1"),
    ("AXONML_SHM_ARENA_MB", "-64", "AXONML_SHM_ARENA_MB must be a whole number"),
    ("AXONML_SHM_ARENA_MB", "0.5", "AXONML_SHM_ARENA_MB must be a whole number"),
    ("AXONML_SHM_ARENA_MB", "64MB", "AXONML_SHM_ARENA_MB must be a whole number"),
    ("AXONML_SHM_ARENA_MB", str(_dev_shm_mib() + 1), "is more than /dev/shm holds"),
    ("AXONML_SHM_ARENA_MB", str(1 << 60), "is more than /dev/shm holds"),
    ("AXONML_JOB_SECRET", "not hex", "AXONML_JOB_SECRET must be hex digits"),
    ("AXONML_JOB_SECRET", "abc" * 11, "AXONML_JOB_SECRET must be hex digits, two per byte"),
    ("AXONML_JOB_SECRET", "ab cd" * 8, "AXONML_JOB_SECRET must be hex digits"),
    (
        "AXONML_JOB_SECRET",
        "ab" * 15,
        "AXONML_JOB_SECRET has 15 bytes (30 hex digits); it must have at least 16",
    ),
    ("AXONML_LAUNCHER_PID", "launcher", "AXONML_LAUNCHER_PID must be a whole number"),
]


@pytest.mark.parametrize(("name", "text", "message"), INVALID)
def test_invalid_values_are_refused_naming_the_variable(
    name: str, text: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(message)):
        READERS[name]()


def test_the_arena_may_take_all_of_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXONML_SHM_ARENA_MB", str(_dev_shm_mib()))
    assert settings.shm_arena_bytes() == _dev_shm_mib() << 20


def test_launched_means_the_launcher_is_this_process_s_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXONML_LAUNCHER_PID", str(os.getppid()))
    assert settings.launched_by_axonml_run()
    # A launcher's variables inherited by a process it did not start (a worker's child).
    monkeypatch.setenv("AXONML_LAUNCHER_PID", str(os.getpid()))
    assert not settings.launched_by_axonml_run()
    # The job id says nothing about who started this process.
    monkeypatch.delenv("AXONML_LAUNCHER_PID")
    monkeypatch.setenv("AXONML_JOB_ID", "ab12")
    assert not settings.launched_by_axonml_run()


def test_the_shortest_secret_is_the_core_s() -> None:
    """The torch backend's rendezvous refuses short secrets in Python: at the core's own minimum."""
    shortest = settings.JOB_SECRET_MIN_BYTES
    with pytest.raises(ValueError, match=f"it must have at least {shortest} "):
        ShmBackend.connect(0, 1, "127.0.0.1", 1, timeout=1, secret=bytes(shortest - 1))


def test_init_process_group_refuses_a_bad_rank_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK must be a whole number"):
        ad.init_process_group("shm")
    assert not ad.is_initialized()


def test_every_variable_is_named_in_settings_alone() -> None:
    """No other module of the package spells a variable's name; Python declares none the core reads."""
    literal = re.compile(r"""["'](AXONML_[A-Z_]+|RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)["']""")
    spelled = {}
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE))
        names = literal.findall(path.read_text())
        if where.startswith("bench/"):
            # The bench's workers also run under another checkout's package (--compare-python) and under
            # mpiexec: they read torchrun's variables as they are, never ours.
            names = [name for name in names if name.startswith("AXONML_")]
        if names and where != "settings.py":
            spelled[where] = names
    assert spelled == {}
    declared = [value for value in vars(settings).values() if isinstance(value, str)]
    ours = {name for name in declared if name.startswith("AXONML_")}
    assert ours == {name for name in READERS if name.startswith("AXONML_")}
    core = set(re.findall(r'"(AXONML_[A-Z_]+)"', RUST_CONFIG.read_text()))
    assert core and not core & ours, core
